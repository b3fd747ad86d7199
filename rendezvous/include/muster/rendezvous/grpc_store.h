// A Store client of the rendezvous server's Store service (one run's table). Operations go
// over a small pool of long-lived streams, one request at a time per stream (a thread finding
// every stream busy opens another); waits happen on the server, which answers when the keys
// appear or the timeout passes. A call whose server cannot be reached fails with UNAVAILABLE;
// a later call, once the server is back (a restarted rdzvd), goes through on a new stream.
//
// set() is written behind, as TCPStore's set is: it returns once the request is sent, and the
// reply is read later, so a set followed by a get costs one round trip, not two.
// - Order: the server serves one stream's requests in order, and while a stream has sets
//   written behind every call of this GrpcStore, from any thread, goes on that stream (or
//   waits for it), so no later call overtakes a set.
// - Errors: the first call on a new stream is always answered before returning (a wrong token
//   or an unreachable server shows at once). A set the server refuses later (a limit) is
//   reported by the next call that is not a set, which returns that error instead of its own
//   result: a write (add, compare_set, delete_key, multi_set) is then not carried out, and a
//   read's answer is discarded. The destructor waits for the outstanding replies and writes a
//   refusal nobody was told of to stderr.
// - At most 64 sets are outstanding; the next one waits for their replies.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "muster/rendezvous/store.h"
#include "muster/rendezvous/tls.h"

namespace muster::rendezvous {

struct GrpcStoreOptions {
  // The server's gRPC target (host:port, or unix-abstract:NAME). Replicas: several, separated
  // by ';' (MUSTER_STORE_ADDR holds them so): a call whose server is lost fails with
  // UNAVAILABLE and later calls go to the next target, round the list (docs/rendezvous.md,
  // "Replicated rdzvd on etcd").
  std::string target;
  std::string run_id;
  std::string token;
  // A call the server has not answered this long after its own wait (get/wait/multi_get's
  // timeout; 0 for the others) fails with DEADLINE_EXCEEDED and its stream is dropped: a
  // server that is alive but stuck cannot block a caller for good (TCPStore's default, 300 s).
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // TLS to the server (not enabled: plaintext).
  ClientTls tls{};
};

class GrpcStore final : public Store {
 public:
  explicit GrpcStore(GrpcStoreOptions options);
  ~GrpcStore() override;

  absl::Status set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> get(const std::string& key, Duration timeout) override;
  absl::StatusOr<std::int64_t> add(const std::string& key, std::int64_t delta) override;
  absl::StatusOr<std::string> compare_set(const std::string& key, const std::string& expected,
                                          const std::string& desired) override;
  absl::StatusOr<bool> delete_key(const std::string& key) override;
  absl::StatusOr<bool> check(const std::vector<std::string>& keys) override;
  absl::Status wait(const std::vector<std::string>& keys, Duration timeout) override;
  absl::StatusOr<std::int64_t> num_keys() override;
  absl::StatusOr<std::vector<std::string>> multi_get(const std::vector<std::string>& keys,
                                                     Duration timeout) override;
  absl::Status multi_set(const std::vector<std::string>& keys,
                         const std::vector<std::string>& values) override;

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace muster::rendezvous
