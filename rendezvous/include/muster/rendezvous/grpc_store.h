// A Store client of the rendezvous server's Store service (one run's table). Each call is
// one unary RPC; waits happen on the server, which answers when the keys appear or the
// timeout passes. A call the server cannot be reached for fails with UNAVAILABLE.
#pragma once

#include <memory>

#include "muster/rendezvous/store.h"

namespace muster::rendezvous {

struct GrpcStoreOptions {
  std::string target;  // host:port of the server
  std::string run_id;
  std::string token;
  // Deadline of calls that do not wait (set, add, ...).
  std::chrono::milliseconds call_timeout{std::chrono::seconds(30)};
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
