#include "store/tcpstore/agent_stores.h"

#include <spdlog/spdlog.h>

#include "muster/rendezvous/resolve.h"

namespace muster::rendezvous {

AgentStores::AgentStores(std::string host, StoreLimits limits)
    : host_(std::move(host)), limits_(limits), loop_(make_tcpstore_loop()) {}

void AgentStores::open(const std::string& run) {
  if (runs_.count(run) != 0) return;
  TcpStoreOptions o;
  o.host = host_;
  o.limits = limits_;
  auto server = TcpStoreServer::start(o, loop_);
  if (!server.ok()) {
    spdlog::error("rendezvous: run '{}' has no TCPStore-protocol store: {}", run,
                  std::string(server.status().message()));
    runs_[run] = nullptr;
    return;
  }
  runs_[run] = std::move(*server);
}

void AgentStores::drop(const std::string& run) { runs_.erase(run); }

int AgentStores::port(const std::string& run) const {
  auto it = runs_.find(run);
  return it == runs_.end() || it->second == nullptr ? 0 : it->second->port();
}

std::string listen_host(const std::string& listen_address) {
  const std::string host = host_of(listen_address);
  if (host.empty() || host == "localhost") return "127.0.0.1";
  return is_ip_literal(host) ? host : "0.0.0.0";  // a name gRPC resolves: every address
}

}  // namespace muster::rendezvous
