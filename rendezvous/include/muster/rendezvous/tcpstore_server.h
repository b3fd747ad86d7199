// A store that speaks c10d's TCPStore wire protocol, so that torch's own TCPStore client (and
// so torch.distributed's env:// and the agent-store path of torchrun 2.x) can use it: torch
// 1.13's queries and torch 2.x's (the VALIDATE handshake, PING, APPEND, MULTI_GET, MULTI_SET,
// CANCEL_WAIT, the queue ops). The framing is in src/common/tcpstore_protocol.h.
//
// One server is one table (one run): keys, values and its byte total are bounded as the gRPC
// store's (StoreLimits, defaults in limits.h), and so are connections, parked WAITs, frame
// sizes, unread replies and half-sent frames (limits.h, "TCPStore-protocol store"). The
// protocol has no error reply: a query that breaks a limit, a frame that does not parse, or a
// client that does not read its replies gets its connection closed, with one log line naming
// the peer and why; the table and every other connection are untouched.
//
// Semantics are torch's (TCPStoreLibUvBackend.cpp, torch main): SET and APPEND and MULTI_SET
// and QUEUE_PUSH have no reply; GET of a missing key answers an empty value (torch's client
// WAITs first); COMPARE_SET on a missing key sets it only when the expected value is empty,
// and otherwise answers the expected value; ADD answers the new count and closes a connection
// that adds to a value that is not an integer; CHECK and WAIT count a non-empty queue as a
// present key; DELETE_KEY answers 1 or 0; CANCEL_WAIT takes the connection's wait out and
// answers WAIT_CANCELED; WATCH_KEY (torch 1.13) sends the watching connection every change of
// its key.
//
// Thread safety: start, port, stats and the destructor may be called from any thread but the
// loop's; the table is served by the loop's thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/store.h"

namespace muster::rendezvous {

struct TcpStoreOptions {
  std::string host = "127.0.0.1";  // the address to listen on ("0.0.0.0", "::" for all)
  int port = 0;                    // 0: the kernel picks (see port())
  StoreLimits limits;
  std::size_t max_frame_bytes = limits::kMaxTcpStoreFrameBytes;
  std::size_t max_connections = limits::kMaxTcpStoreConnections;
  std::size_t max_waits = limits::kMaxTcpStoreWaits;
  std::size_t max_unsent_bytes = limits::kMaxTcpStoreUnsentBytes;
  std::chrono::milliseconds partial_frame_timeout = limits::kTcpStorePartialFrameTimeout;
};

// A thread serving any number of TcpStoreServers (the rendezvous server's runs share one, so
// that 4,096 runs are not 4,096 threads). It ends when its last server and holder are gone; it
// must not be released on its own thread.
class TcpStoreLoop;
std::shared_ptr<TcpStoreLoop> make_tcpstore_loop();

class TcpStoreServer {
 public:
  // Binds, listens and starts serving, on `loop` (none: a loop of its own). An error (the
  // address taken, a bad host) is returned, nothing is left running.
  static absl::StatusOr<std::unique_ptr<TcpStoreServer>> start(
      TcpStoreOptions options, std::shared_ptr<TcpStoreLoop> loop = nullptr);
  // Closes the listener and every connection (waiting for the loop to have done so); a loop
  // of its own is joined.
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  int port() const;

  struct Stats {
    std::size_t connections = 0;
    std::size_t keys = 0;
    std::size_t parked_waits = 0;
    std::uint64_t closed_for_errors = 0;  // connections closed by the server (limits, frames)
    std::uint64_t refused_connections = 0;
  };
  Stats stats() const;

  class Impl;

 private:
  TcpStoreServer(std::shared_ptr<TcpStoreLoop> loop, std::shared_ptr<Impl> impl);
  std::shared_ptr<TcpStoreLoop> loop_;
  std::shared_ptr<Impl> impl_;
};

}  // namespace muster::rendezvous
