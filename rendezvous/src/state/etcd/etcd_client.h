// etcd's v3 API as the etcd backend uses it: one channel over every member (round robin, so a
// dead member is passed over), and unary calls retried on another member until a deadline.
#pragma once

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/run_store.h"
#include "etcd/etcdserver/api/v3election/v3electionpb/v3election.grpc.pb.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"

namespace muster::rendezvous::etcd {

struct Stubs {
  std::string endpoints;  // as given, for messages
  // The bound on one attempt of a call (limits::kEtcdAttemptsPerLease), set once the lease's
  // TTL is known; until then the whole request timeout.
  std::chrono::milliseconds attempt = limits::kEtcdRequestTimeout;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<etcdserverpb::KV::Stub> kv;
  std::unique_ptr<etcdserverpb::Lease::Stub> lease;
  std::unique_ptr<v3electionpb::Election::Stub> election;
  // One channel per member, for asking each one alone (reachable_members).
  std::vector<std::unique_ptr<etcdserverpb::Maintenance::Stub>> members;
};

// "HOST:PORT,..." (IPv6 as [ADDR]:PORT), each host looked up once: one gRPC target over all.
absl::StatusOr<std::shared_ptr<Stubs>> connect(const std::string& endpoints);

// Whether an attempt that ended with `st` is worth another one, on another member: the
// member is down or silent (UNAVAILABLE, or the attempt's own deadline), or etcd is electing
// its leader ("leader changed" / "no leader": UNAVAILABLE).
inline bool try_again(const grpc::Status& st) {
  return st.error_code() == grpc::StatusCode::UNAVAILABLE ||
         st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
}

// Calls `call(ctx)` until it succeeds, fails for good, or `deadline` passes. Each attempt is
// bounded by `attempt` (a silent member, whose connection looks open, costs one attempt);
// try_again() says which ends are tried again, on whichever member the round-robin channel
// picks next. Only for calls that may be repeated (every write of ours is idempotent: the
// same puts, under the same fence).
template <class Call>
grpc::Status call_with_retry(std::chrono::system_clock::time_point deadline,
                             std::chrono::milliseconds attempt, Call call) {
  for (;;) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::min(deadline, std::chrono::system_clock::now() + attempt));
    ctx.set_wait_for_ready(true);  // while every member is being reconnected
    grpc::Status st = call(ctx);
    const auto now = std::chrono::system_clock::now();
    if (!try_again(st) || now + std::chrono::milliseconds(10) >= deadline) return st;
    // An answer that came at once (etcd electing, a member refusing): not in a tight loop.
    if (st.error_code() == grpc::StatusCode::UNAVAILABLE) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
}

// How many members answer a Status call (each asked alone, all at once) within `bound`: a
// member answers it by itself, without its raft leader, so it tells "etcd is electing" (a
// quorum answers) from "this replica is cut off from etcd" (fewer do).
int reachable_members(const Stubs& s, std::chrono::milliseconds bound);

// "etcd at ENDPOINTS: MESSAGE (CODE)".
absl::Status error(const Stubs& s, const char* what, const grpc::Status& st);

// The leader's store (run_store.cc): every write is a transaction that first compares
// `fence_key`'s creation revision with `fence_revision` (the leader's election key), so it
// fails once that key is gone: FAILED_PRECONDITION, "no longer leads".
std::shared_ptr<RunStore> make_run_store(std::shared_ptr<Stubs> stubs, std::string prefix,
                                         std::chrono::milliseconds timeout, std::string fence_key,
                                         std::int64_t fence_revision);

}  // namespace muster::rendezvous::etcd
