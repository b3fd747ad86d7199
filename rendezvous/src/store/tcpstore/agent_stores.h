// The rendezvous server's per-run TCPStore-protocol stores, one table per world. Each world of
// a run (each round: the workers one Assignment starts) has a table of its own: torch's
// workers of a new world never see the keys of an earlier one (torch keys its process group by
// TORCHELASTIC_RESTART_COUNT alone, or, in torch 2.x's newest client, not at all, "a new
// TCPStore for every retry"; a world formed after a node left or joined has the same restart
// count as the one before). The workers reach it through their agent (relay_service.h): no
// listener of the server's own serves it.
//
// A world opens with the first relayed connection that names it, when it is newer than every
// world of the run before (the token that opened the stream opens the run); the newest
// limits::kTcpStoreWorldsKept worlds of a run are kept (the workers of the world before may
// still be stopping, and use theirs until then), an older world is closed with its
// connections and keys. All of them are served by one thread (a TcpStoreLoop).
//
// Thread safety: open, drop, world and worlds may be called from any thread; a World's table
// and connections are touched on the loop's thread only.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <unordered_set>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/store.h"
#include "store/tcpstore/loop.h"
#include "store/tcpstore/table.h"

namespace muster::rendezvous {

struct TcpStoreWorld {
  TcpStoreWorld(std::string run, int round, const StoreLimits& limits, std::size_t max_waits)
      : run(std::move(run)), round(round), table(limits, max_waits, round) {}
  const std::string run;
  const int round;
  // On the loop's thread:
  tcpstore::Table table;
  std::unordered_set<std::shared_ptr<tcpstore::Conn>> conns;
  bool closed = false;
};

class AgentStores {
 public:
  explicit AgentStores(StoreLimits limits, std::size_t worlds_kept = limits::kTcpStoreWorldsKept,
                       std::size_t max_waits = limits::kMaxRelayedWaitsPerWorld);
  ~AgentStores();

  // Holds `run` (from its first Join) until drop(), which closes its worlds.
  void open(const std::string& run);
  void drop(const std::string& run);
  bool holds(const std::string& run) const;
  // The world `round` of `run`: opened when newer than every world of the run before (which
  // closes the worlds beyond the newest worlds_kept). Null: the run is not held, or the round
  // is older than the worlds kept.
  std::shared_ptr<TcpStoreWorld> world(const std::string& run, int round);
  // The worlds of `run` open now (tests, metrics).
  std::size_t worlds(const std::string& run) const;
  boost::asio::io_context& io() { return loop_->io(); }
  const StoreLimits& limits() const { return limits_; }

 private:
  // Closes a world's connections and drops its table, on the loop.
  void close(std::shared_ptr<TcpStoreWorld> w);

  const StoreLimits limits_;
  const std::size_t worlds_kept_;
  const std::size_t max_waits_;
  std::shared_ptr<TcpStoreLoop> loop_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::map<int, std::shared_ptr<TcpStoreWorld>>> runs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muster::rendezvous
