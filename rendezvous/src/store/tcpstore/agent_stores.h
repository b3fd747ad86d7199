// The rendezvous server's per-run TCPStore-protocol stores: one TcpStoreServer per run, opened
// with the run's store table (its first Join) and closed when the run goes, so that its port is
// known before the first Assignment and stays the same across rounds (no port to race for, and
// the store outlives every worker). All of them are served by one thread (a TcpStoreLoop). The
// server's io thread owns it; not thread-safe.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "muster/rendezvous/tcpstore_server.h"

namespace muster::rendezvous {

class AgentStores {
 public:
  // Listeners go on `host` (the rendezvous listener's own address), each on a port of the
  // kernel's choosing.
  AgentStores(std::string host, StoreLimits limits);

  // Opens the run's listener if it has none. A listener that cannot be opened is logged once;
  // the run then has port 0 (its workers fall back to hosting their own store).
  void open(const std::string& run);
  void drop(const std::string& run);
  // The run's port, 0 when it has no listener.
  int port(const std::string& run) const;
  std::size_t size() const { return runs_.size(); }

 private:
  std::string host_;
  StoreLimits limits_;
  std::shared_ptr<TcpStoreLoop> loop_;  // declared first: it outlives the servers
  std::map<std::string, std::unique_ptr<TcpStoreServer>> runs_;
};

// The host part of a listen address ("0.0.0.0:29400" -> "0.0.0.0", "[::]:0" -> "::",
// "localhost:1" -> "127.0.0.1", a host name -> "0.0.0.0"): where the run's TCPStore listeners
// go.
std::string listen_host(const std::string& listen_address);

}  // namespace muster::rendezvous
