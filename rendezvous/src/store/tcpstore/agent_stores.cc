#include "store/tcpstore/agent_stores.h"

#include <algorithm>
#include <vector>

#include <spdlog/spdlog.h>

#include "muster/rendezvous/tcpstore_server.h"

namespace muster::rendezvous {

AgentStores::AgentStores(StoreLimits limits, std::size_t worlds_kept, std::size_t max_waits)
    : limits_(limits),
      worlds_kept_(std::max<std::size_t>(worlds_kept, 1)),
      max_waits_(max_waits),
      loop_(make_tcpstore_loop()) {}

AgentStores::~AgentStores() {
  std::vector<std::shared_ptr<TcpStoreWorld>> all;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [run, worlds] : runs_) {
      for (auto& [round, w] : worlds) all.push_back(std::move(w));
    }
    runs_.clear();
  }
  for (auto& w : all) close(std::move(w));
}

void AgentStores::open(const std::string& run) {
  absl::MutexLock lock(&mu_);
  runs_.try_emplace(run);
}

void AgentStores::drop(const std::string& run) {
  std::map<int, std::shared_ptr<TcpStoreWorld>> gone;
  {
    absl::MutexLock lock(&mu_);
    auto it = runs_.find(run);
    if (it == runs_.end()) return;
    gone = std::move(it->second);
    runs_.erase(it);
  }
  for (auto& [round, w] : gone) close(std::move(w));
}

bool AgentStores::holds(const std::string& run) const {
  absl::MutexLock lock(&mu_);
  return runs_.count(run) != 0;
}

std::shared_ptr<TcpStoreWorld> AgentStores::world(const std::string& run, int round) {
  std::vector<std::shared_ptr<TcpStoreWorld>> closed;
  std::shared_ptr<TcpStoreWorld> out;
  {
    absl::MutexLock lock(&mu_);
    auto it = runs_.find(run);
    if (it == runs_.end()) return nullptr;
    auto& worlds = it->second;
    auto found = worlds.find(round);
    if (found != worlds.end()) return found->second;
    if (!worlds.empty() && round < worlds.rbegin()->first) return nullptr;  // closed already
    out = std::make_shared<TcpStoreWorld>(run, round, limits_, max_waits_);
    worlds.emplace(round, out);
    while (worlds.size() > worlds_kept_) {
      closed.push_back(std::move(worlds.begin()->second));
      worlds.erase(worlds.begin());
    }
  }
  for (auto& w : closed) close(std::move(w));
  return out;
}

std::size_t AgentStores::worlds(const std::string& run) const {
  absl::MutexLock lock(&mu_);
  auto it = runs_.find(run);
  return it == runs_.end() ? 0 : it->second.size();
}

void AgentStores::close(std::shared_ptr<TcpStoreWorld> w) {
  boost::asio::post(loop_->io(), [w = std::move(w)] {
    w->closed = true;
    // One line for them all: a world of 100,000 ranks must not write 100,000 (on a console or
    // a pipe nobody reads, the loop would wait on each write).
    const std::size_t open = w->conns.size();
    const std::string why = "its world (round " + std::to_string(w->round) + ") was closed";
    for (const auto& c : std::vector<tcpstore::ConnPtr>(w->conns.begin(), w->conns.end())) {
      c->end(why);
    }
    w->conns.clear();
    if (open > 0) {
      spdlog::info("store relay: closed {} connection(s) of run '{}', round {}: {}", open, w->run,
                   w->round, why);
    }
  });
}

}  // namespace muster::rendezvous
