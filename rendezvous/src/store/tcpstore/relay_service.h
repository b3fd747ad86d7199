// The StoreRelay service (private to the rendezvous server): the server's end of the agents'
// relays (store_relay.h). One stream per agent carries every worker connection of its node;
// each becomes a connection of its world's table (agent_stores.h) as a socket would, and is
// bounded as one: frame sizes (the agent sends whole frames only), parked waits and
// connections per world (limits.h, "The agent's relay of that store"), and what the stream
// has not read yet (kMaxRelayUnsentBytes: the stream is ended). The stream's first message
// names the run, and its token must open it (credentials.h); a run the server does not hold
// is refused. Frames are served on the tables' loop, in the order they came; the next message
// is read once the loop has served the one before (nothing queues up unbounded).
#pragma once

#include <memory>

#include <grpcpp/grpcpp.h>

#include "muster/rendezvous/credentials.h"
#include "store/tcpstore/agent_stores.h"

namespace muster::rendezvous {

class RelayService {
 public:
  RelayService(std::shared_ptr<AgentStores> worlds, std::shared_ptr<const Credentials> credentials);
  ~RelayService();
  // Before BuildAndStart.
  void register_with(grpc::ServerBuilder& builder);
  // Ends every stream (UNAVAILABLE) and every later one, so that grpc::Server::Shutdown need
  // not wait for them. Before Shutdown; any thread but a gRPC callback's.
  void shutdown();

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace muster::rendezvous
