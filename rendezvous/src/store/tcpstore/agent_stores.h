// The rendezvous server's per-run TCPStore-protocol stores. Each world of a run (each round:
// the workers one Assignment starts) gets a store of its own, a TcpStoreServer on a port of its
// own, opened when the round's first Assignment goes out: torch's workers of a new world never
// see the keys of an earlier one (torch keys its process group by TORCHELASTIC_RESTART_COUNT
// alone, or, in torch 2.x's newest client, not at all, "a new TCPStore for every retry"; a
// world formed after a node left or joined has the same restart count as the one before).
// The newest limits::kTcpStoreWorldsKept worlds of a run are kept (the workers of the world
// before may still be stopping, and use theirs until then); an older world's listener is
// closed with its connections and its keys. All of them are served by one thread (a
// TcpStoreLoop). The server's io thread owns it; not thread-safe.
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
  AgentStores(std::string host, StoreLimits limits,
              std::size_t worlds_kept = limits::kTcpStoreWorldsKept);

  // Holds `run` (from its first Join) until drop(); its worlds open in port().
  void open(const std::string& run);
  void drop(const std::string& run);
  // The port of the store of `run`'s world `round`, opened on the first call for a round newer
  // than every one before (which closes the worlds beyond the newest worlds_kept). 0: the run
  // is not held, the round is older than the worlds kept, or its listener could not be opened
  // (logged once; its workers then host their own store).
  int port(const std::string& run, int round);
  std::size_t size() const { return runs_.size(); }
  // The worlds of `run` with an open store (tests, metrics).
  std::size_t worlds(const std::string& run) const;

 private:
  std::string host_;
  StoreLimits limits_;
  std::size_t worlds_kept_;
  std::shared_ptr<TcpStoreLoop> loop_;  // declared first: it outlives the servers
  // run -> round -> its world's server (null: could not be opened).
  std::map<std::string, std::map<int, std::unique_ptr<TcpStoreServer>>> runs_;
};

// The host part of a listen address ("0.0.0.0:29400" -> "0.0.0.0", "[::]:0" -> "::",
// "localhost:1" -> "127.0.0.1", a host name -> "0.0.0.0"): where the run's TCPStore listeners
// go.
std::string listen_host(const std::string& listen_address);

}  // namespace muster::rendezvous
