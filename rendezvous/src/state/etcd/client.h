// etcd's v3 API as the etcd backend uses it: one channel over every member (round robin, so a
// dead member is passed over), and unary calls retried on another member until a deadline.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "muster/rendezvous/run_store.h"
#include "etcd/etcdserver/api/v3election/v3electionpb/v3election.grpc.pb.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"

namespace muster::rendezvous::etcd {

struct Stubs {
  std::string endpoints;  // as given, for messages
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<etcdserverpb::KV::Stub> kv;
  std::unique_ptr<etcdserverpb::Lease::Stub> lease;
  std::unique_ptr<v3electionpb::Election::Stub> election;
};

// "HOST:PORT,..." (IPv6 as [ADDR]:PORT), each host looked up once: one gRPC target over all.
absl::StatusOr<std::shared_ptr<Stubs>> connect(const std::string& endpoints);

// Calls `call(ctx)` until it succeeds, fails for good, or `deadline` passes: UNAVAILABLE (a
// member down, or etcd's "leader changed" / "no leader" while its own election runs) is tried
// again, on whichever member the channel picks. Only for calls that may be repeated (every
// write of ours is idempotent: the same puts, under the same fence).
template <class Call>
grpc::Status call_with_retry(std::chrono::system_clock::time_point deadline, Call call) {
  for (;;) {
    grpc::ClientContext ctx;
    ctx.set_deadline(deadline);
    ctx.set_wait_for_ready(true);  // while every member is being reconnected
    grpc::Status st = call(ctx);
    if (st.error_code() != grpc::StatusCode::UNAVAILABLE ||
        std::chrono::system_clock::now() + std::chrono::milliseconds(50) >= deadline) {
      return st;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // etcd's election, not ours
  }
}

// "etcd at ENDPOINTS: MESSAGE (CODE)".
absl::Status error(const Stubs& s, const char* what, const grpc::Status& st);

// The leader's store (run_store.cc): every write is a transaction that first compares
// `fence_key`'s creation revision with `fence_revision` (the leader's election key), so it
// fails once that key is gone: FAILED_PRECONDITION, "no longer leads".
std::shared_ptr<RunStore> make_run_store(std::shared_ptr<Stubs> stubs, std::string prefix,
                                         std::chrono::milliseconds timeout, std::string fence_key,
                                         std::int64_t fence_revision);

}  // namespace muster::rendezvous::etcd
