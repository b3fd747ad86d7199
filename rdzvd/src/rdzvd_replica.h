// rdzvd --etcd: this process as one replica of a group (docs/rendezvous.md, "Replicated rdzvd
// on etcd"): its lease, the server as a standby, the campaign on a thread of its own, and the
// leader it sees. Every way to lose the leadership ends the process at once (exit 1): another
// replica may lead by then, and this one's agents must move to it.
#pragma once

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "muster/rendezvous/etcd.h"
#include "muster/rendezvous/server.h"

namespace muster::rdzvd {

class ReplicaRole {
 public:
  // Reaches etcd and grants the lease; makes `server` (not started yet) a standby whose lost
  // writes end the process. INVALID_ARGUMENT for a bad --etcd (a usage error).
  static absl::StatusOr<std::unique_ptr<ReplicaRole>> connect(
      const rendezvous::EtcdOptions& etcd, rendezvous::ServerOptions& server);
  // Resigns if not done yet, then joins the campaign's thread and (through the replica) the
  // observer's. The server given to start() must outlive this role: both threads call it, so
  // destroy the role first (rdzvd's main does, with a cleanup declared after the server).
  ~ReplicaRole();

  // Once the server listens: prints the standby line, watches who leads, and campaigns as
  // `name` (empty: this host's name and the server's port); the server leads once it wins.
  void start(rendezvous::RendezvousServer& server, std::string name);
  // After the server's shutdown: gives the leadership up (a standby takes over at once).
  void resign();

 private:
  ReplicaRole(std::unique_ptr<rendezvous::EtcdReplica> replica, std::string prefix);
  std::unique_ptr<rendezvous::EtcdReplica> replica_;
  std::string prefix_;
  std::thread campaigner_;
  bool resigned_ = false;
};

}  // namespace muster::rdzvd
