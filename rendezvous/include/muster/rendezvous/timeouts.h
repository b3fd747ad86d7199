// A run's timing rules and the bounds on its size: what an agent sends in its Join and the
// server applies (state_machine.h). Header-only, on the client side: the agent and launch
// include this, not the server's rule engine.
#pragma once

#include <chrono>

#include "muster/rendezvous/limits.h"

namespace muster::rendezvous {

// Timing rules, with torchrun's c10d defaults. These are the server's (the operator's)
// defaults and are not clamped; what a Join sets is (see above).
struct RendezvousTimeouts {
  // A node waiting for a round that has not reached min_nodes gives up after this.
  std::chrono::milliseconds join_timeout{std::chrono::seconds(600)};
  // Once min_nodes have joined, the round stays open this long for more (unless max is reached).
  std::chrono::milliseconds last_call_timeout{std::chrono::seconds(30)};
  // A finished run's id is remembered this long, so a late join gets a clear error.
  std::chrono::milliseconds finished_run_grace{std::chrono::seconds(60)};
  // The liveness rule: a node that sends nothing for keep_alive_interval *
  // keep_alive_max_attempt (the liveness window) is lost, and a node that hears nothing from
  // its server for that long knows it is out. (A node whose process dies is lost at once:
  // its stream ends.) Default 0.5 s x 4 = 2 s, where torchrun's is 5 s x 3: a silent host is
  // noticed in 2 s (docs/rendezvous.md, "Liveness").
  std::chrono::milliseconds keep_alive_interval = limits::kDefaultKeepAliveInterval;
  int keep_alive_max_attempt = limits::kDefaultKeepAliveAttempts;
  // --hang_timeout (docs/hangs.md): a rank whose progress has not moved this long while
  // another rank's got further is stalled; its node is told (Stalled). 0: off.
  std::chrono::milliseconds hang_timeout{0};
  // How long a restarted server holds a running run's places for its members to re-attach,
  // and how long their agents try (limits.h, kDefaultReattachTimeout).
  std::chrono::milliseconds reattach_timeout = limits::kDefaultReattachTimeout;
};

// Bounds on what one Join may carry (the server also caps the message size).
inline constexpr int kMaxLocalWorldSize = 1 << 16;
inline constexpr int kMaxNodes = 1 << 20;

}  // namespace muster::rendezvous
