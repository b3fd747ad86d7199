#include "store/tcpstore/agent_stores.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "muster/rendezvous/resolve.h"

namespace muster::rendezvous {

AgentStores::AgentStores(std::string host, StoreLimits limits, std::size_t worlds_kept)
    : host_(std::move(host)),
      limits_(limits),
      worlds_kept_(std::max<std::size_t>(worlds_kept, 1)),
      loop_(make_tcpstore_loop()) {}

void AgentStores::open(const std::string& run) { runs_.try_emplace(run); }

void AgentStores::drop(const std::string& run) { runs_.erase(run); }

int AgentStores::port(const std::string& run, int round) {
  auto it = runs_.find(run);
  if (it == runs_.end()) return 0;
  auto& worlds = it->second;
  auto found = worlds.find(round);
  if (found == worlds.end()) {
    if (!worlds.empty() && round < worlds.rbegin()->first) return 0;  // a world already closed
    TcpStoreOptions o;
    o.host = host_;
    o.limits = limits_;
    auto server = TcpStoreServer::start(o, loop_);
    if (!server.ok()) {
      spdlog::error("rendezvous: run '{}' round {} has no TCPStore-protocol store: {}", run, round,
                    std::string(server.status().message()));
    }
    found = worlds.emplace(round, server.ok() ? std::move(*server) : nullptr).first;
    while (worlds.size() > worlds_kept_) worlds.erase(worlds.begin());
  }
  return found->second == nullptr ? 0 : found->second->port();
}

std::size_t AgentStores::worlds(const std::string& run) const {
  auto it = runs_.find(run);
  if (it == runs_.end()) return 0;
  return static_cast<std::size_t>(std::count_if(it->second.begin(), it->second.end(),
                                                [](const auto& w) { return w.second != nullptr; }));
}

std::string listen_host(const std::string& listen_address) {
  const std::string host = host_of(listen_address);
  if (host.empty() || host == "localhost") return "127.0.0.1";
  return is_ip_literal(host) ? host : "0.0.0.0";  // a name gRPC resolves: every address
}

}  // namespace muster::rendezvous
