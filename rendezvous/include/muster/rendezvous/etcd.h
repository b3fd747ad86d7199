// rdzvd --etcd: replicas of the rendezvous server on an etcd cluster, through etcd's v3 gRPC
// API (docs/rendezvous.md, "Replicated rdzvd on etcd"). etcd holds the durable state and
// decides who leads; there is no consensus of our own.
//
//  - Each replica holds a lease (lease_ttl), kept alive from a thread of its own, and
//    campaigns with etcd's election service (v3election) under PREFIX "leader", its value the
//    replica's advertised endpoint. One leads; the others stand by.
//  - The leader's run store (run_store()) keeps every RunRecord in etcd (etcd_layout.h) and
//    fences every write on its election key: a transaction compares that key's creation
//    revision, so a replica that no longer leads can never write, and its write fails.
//  - A lease that etcd says is gone, or whose renewals have not got through by the time it
//    may expire (the last renewal sent + lease_ttl, less lease_ttl /
//    limits::kEtcdStepDownMarginDivisor), calls on_lost (from the keep-alive thread) on a
//    leader: it must stop at once, as another may lead from then on. A standby (decided
//    nothing, wrote nothing) takes a new lease instead and campaigns on under it.
//  - Every call is bounded per attempt (limits::kEtcdAttemptsPerLease): a member that went
//    silent (its connection looks open, nothing answers) costs one attempt, and the call goes
//    on to another member (the channel is round robin over all of them) well inside the
//    lease, as etcd's own client does. A campaign and the observer are asked again after
//    each lease TTL, so a silent member does not hold them either.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/run_store.h"

namespace muster::rendezvous {

struct EtcdOptions {
  // etcd's client endpoints, "HOST:PORT,HOST:PORT,..." (each name looked up once, at connect).
  std::string endpoints;
  // Every key of this rdzvd group starts with it: replicas of one group share it, another
  // group on the same etcd uses another.
  std::string prefix = "/muster/rdzv/";
  std::chrono::milliseconds lease_ttl = limits::kDefaultEtcdLeaseTtl;
  std::chrono::milliseconds request_timeout = limits::kEtcdRequestTimeout;
};

class EtcdReplica {
 public:
  // Reaches etcd (one call, bounded by request_timeout), grants this replica's lease and
  // starts keeping it alive. Errors name the endpoints.
  static absl::StatusOr<std::unique_ptr<EtcdReplica>> connect(
      EtcdOptions options, std::function<void(const std::string& why)> on_lost);
  ~EtcdReplica();  // stops the threads; the lease is left to expire unless resign() was called
  EtcdReplica(const EtcdReplica&) = delete;
  EtcdReplica& operator=(const EtcdReplica&) = delete;

  // Blocks until this replica leads (or resign()/the destructor ends the wait). A lease that
  // lapses while it waits is replaced and the campaign goes on. From then on run_store() writes, fenced by this leadership. `name` is what
  // other replicas and messages call this one (its advertised HOST:PORT).
  absl::Status campaign(const std::string& name);
  // Calls `on_leader` from a thread of its own with the leader's name each time another
  // replica is seen to lead (and once for the one leading now, if any). Call once.
  void observe(std::function<void(const std::string& leader)> on_leader);
  // The store of every run (usable once campaign() returned OK).
  std::shared_ptr<RunStore> run_store();
  // The lease as etcd granted it (etcd may raise a short TTL to its floor).
  std::chrono::milliseconds lease_ttl() const;
  // Gives the leadership up now (revokes the lease): a standby takes over at once instead of
  // after the lease's TTL. Ends a campaign() in progress.
  void resign();

  class Impl;

 private:
  explicit EtcdReplica(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace muster::rendezvous
