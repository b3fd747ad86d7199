// The agent's end of the run's TCPStore-protocol store: torch's own TCPStore client (env://,
// TORCHELASTIC_USE_AGENT_STORE=True) connects to its agent, on loopback, and the agent carries
// every connection of its node to the server over one StoreRelay stream (proto), with the
// agent's TLS and token. The server keeps each world's table (agent_stores.h, server side).
//
// - Each world (round) has a listener of its own on 127.0.0.1, opened by world(): a worker of a
//   new world never reaches an earlier world's table, even with the same restart count. The
//   newest limits::kTcpStoreWorldsKept stay open; an older one is closed with its connections.
// - Nobody else gets in: a connection whose socket belongs to another user than the agent's
//   (the kernel says, sock_diag) is closed at once, with one log line.
// - Bounds as the server's own listener has them (limits.h, "TCPStore-protocol store"): frame
//   sizes (checked as the lengths arrive), connections per world, unread replies per
//   connection, half-sent frames. The relay reads from a worker's socket only while its
//   stream can take more (TCP's own flow control holds the rest), so nothing queues unbounded.
// - torch's get() is a WAIT and then a GET of the same key: the relay asks the server to send
//   the value with the WAIT's answer and answers that GET itself (one round trip, not two).
// - Reads of what this node set are answered here: the relay keeps the values its workers SET
//   (per world, within max_cached_bytes) and answers a WAIT, CHECK, GET or MULTI_GET of those
//   keys itself when the connection waits for no answer of the server. The server tells the
//   relay (RelayFrame.dropped) when another client writes such a key, on the same stream and
//   before any reply that write could lead to, so a worker never reads a value older than one
//   it could know of through the store; any other write of this node (ADD, APPEND,
//   COMPARE_SET, DELETE) forgets the key at once; a new stream starts with nothing kept.
// - A node's ADDs and WAITs are combined (issue 40's barrier: 100,000 ranks, one query per
//   node, not per rank): ADDs of one key from connections that wait for no other answer go up
//   as one ADD of their sum (one in flight per key and world, on a connection of the relay's
//   own; those that come meanwhile go with the next) and each is answered as if they had been
//   applied one after another; a WAIT for keys another connection of the node already waits
//   for at the server is not sent: it is answered with that one. A connection whose WAIT rides
//   on another's and that sends anything more has its WAIT sent after all; one whose WAIT led
//   and that goes (or cancels it) hands the wait to one that rode on it. A torch 2.x
//   connection's VALIDATE goes up only with its first query the relay cannot answer itself.
// - Write-behind: queries with no answer to wait for (SET...) wait in the stream's queue
//   limits::kRelayWriteBehind (limits::kRelayWriteBehindMax if the node's workers sent more
//   meanwhile), and go up at once with the next query that has an answer to wait for: a burst
//   of SETs is one message to the server, not one each, and a node busy with queries its
//   agent answers sends one message per kRelayWriteBehindMax.
// - Lost stream (a server gone, a failover): the connections stay open; the relay opens the
//   stream again (the next target, round the list) every limits::kRelayReconnectInterval and
//   carries them over: a connection idle or parked in a WAIT goes on (the WAIT asked again),
//   one with another query in flight is closed (it cannot know whether the query was served),
//   and what this node's workers wrote is written again first (docs/rendezvous.md, "The run's
//   TCPStore-protocol store").
//
// Thread safety: start, world, stats and the destructor may be called from any thread but the
// loop's.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/store.h"
#include "muster/rendezvous/tls.h"

namespace muster::rendezvous {

struct StoreRelayOptions {
  // The server's gRPC targets, tried in this order (replicas: the next one when a stream is
  // lost).
  std::vector<std::string> targets;
  std::string run_id;
  std::string token;
  ClientTls tls{};
  StoreLimits limits;  // key, value and keys-per-query bounds of a frame
  std::size_t max_frame_bytes = limits::kMaxTcpStoreFrameBytes;
  std::size_t max_connections = limits::kMaxTcpStoreConnections;  // per world
  std::size_t max_unsent_bytes = limits::kMaxTcpStoreUnsentBytes;
  std::size_t max_queued_up_bytes = limits::kMaxRelayQueuedUpBytes;  // for the stream
  std::chrono::milliseconds partial_frame_timeout = limits::kTcpStorePartialFrameTimeout;
  std::size_t worlds_kept = limits::kTcpStoreWorldsKept;
  // Answer reads (WAIT, CHECK, GET, MULTI_GET) of keys this node's workers SET, and nobody has
  // written since, here: the server tells the relay when another client writes one. Off: every
  // read goes to the server (tests, the benchmark's row without it).
  bool cache = true;
  // Combine this node's ADDs of one key and WAITs for the same keys (above). Off: each goes up
  // as it came (tests, the benchmark's row without it).
  bool combine = true;
  // Write-behind (above): a SET waits write_behind, or write_behind_max if the node's workers
  // sent more meanwhile.
  std::chrono::microseconds write_behind = limits::kRelayWriteBehind;
  std::chrono::microseconds write_behind_max = limits::kRelayWriteBehindMax;
  // What the cache holds at most per world, keys and values (beyond it, a SET is not kept).
  std::size_t max_cached_bytes = limits::kRelayCachedBytes;
  // The stream's keep-alive: a ping this often while nothing comes back, the stream taken for
  // lost when one is not answered within the timeout (tests that hold a server stopped
  // longer than that lengthen them).
  std::chrono::milliseconds keep_alive_interval = limits::kRelayKeepAliveInterval;
  std::chrono::milliseconds keep_alive_timeout = limits::kRelayKeepAliveTimeout;
  // Refuse connections from sockets of other users (false: tests of the check itself).
  bool same_user_only = true;
  // Open the stream with the first world, not with the first worker's connection: its
  // connection (and TLS handshake) is made while the workers start, not in their first query.
  // Off: nothing is opened for a job that never uses the store (a server in this process
  // starts its gRPC side only when a connection comes).
  bool connect_early = false;
};

// A thread serving any number of relays (a benchmark's simulated agents share one; an agent
// has its own).
class StoreRelayLoop;
std::shared_ptr<StoreRelayLoop> make_store_relay_loop();

class StoreRelay {
 public:
  static absl::StatusOr<std::unique_ptr<StoreRelay>> start(
      StoreRelayOptions options, std::shared_ptr<StoreRelayLoop> loop = nullptr);
  // Closes every listener and connection and the stream, and waits for the loop to have done so.
  ~StoreRelay();
  StoreRelay(const StoreRelay&) = delete;
  StoreRelay& operator=(const StoreRelay&) = delete;

  // The loopback port of world `round`'s listener, opened on the first call for a round newer
  // than every one before (which closes the worlds beyond the newest worlds_kept). An error: a
  // round older than the worlds kept, or no port to listen on.
  absl::StatusOr<int> world(int round);

  struct Stats {
    std::size_t connections = 0;
    std::uint64_t refused_other_user = 0;
    std::uint64_t refused_connections = 0;  // over max_connections
    std::uint64_t closed_for_errors = 0;    // by the relay or the server
    std::uint64_t streams = 0;              // streams opened
    std::uint64_t gets_answered_here = 0;   // torch's GET after a WAIT, from the prefetch
    std::uint64_t replayed_writes = 0;      // written again on a new stream
    std::uint64_t reads_answered_here = 0;  // from what this node set (the cache)
    std::uint64_t combined_adds = 0;        // ADDs the relay sent for its workers' ADDs
    std::uint64_t adds_combined = 0;        // workers' ADDs answered from those
    std::uint64_t waits_sent = 0;           // workers' WAITs sent to the server
    std::uint64_t waits_joined = 0;         // workers' WAITs answered with another's
    std::size_t adds_held = 0;  // workers' ADDs now waiting to go up combined, or for its answer
  };
  Stats stats() const;

  class Impl;

 private:
  StoreRelay(std::shared_ptr<StoreRelayLoop> loop, std::shared_ptr<Impl> impl);
  std::shared_ptr<StoreRelayLoop> loop_;
  std::shared_ptr<Impl> impl_;
};

}  // namespace muster::rendezvous
