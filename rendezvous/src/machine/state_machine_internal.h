// What the state machine's files (state_machine*.cc) share and nothing else includes:
// replies, the saturating time arithmetic (nothing may wrap: a steady_clock duration holds
// only ~292 years, and the operator's defaults are not clamped), the one rule for durations a
// client or a record sets, and the checks of a Join.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>

#include "absl/status/status.h"
#include "muster/rendezvous/state_machine.h"

namespace muster::rendezvous::internal {

Outgoing send(SessionId s, v1::ServerMsg msg);
Outgoing close_with(SessionId s, absl::Status status);

Clock::duration to_clock(std::chrono::milliseconds d);
// t + d, or TimePoint::max() ("never") where that does not fit.
TimePoint after(TimePoint t, std::chrono::milliseconds d);
// A deadline at least 1 ms after `now`: a zero timeout from the operator must not make a
// timer that is always due (after on_tick(now), no deadline is at or before now).
TimePoint deadline(TimePoint now, std::chrono::milliseconds d);
std::chrono::milliseconds times(std::chrono::milliseconds d, int n);
// A client-supplied duration: 0 or less is `fallback`, more than `max` is `max`.
std::chrono::milliseconds client_duration(std::int64_t ms, std::chrono::milliseconds fallback,
                                          std::chrono::milliseconds max);
std::chrono::milliseconds shutdown_timeout_of(const v1::Join& j);

// What a run's timing may be set from: a Join (the run's first node), or a stored record.
struct TimingRequest {
  std::int64_t join_timeout_ms = 0, last_call_timeout_ms = 0, keep_alive_interval_ms = 0,
               hang_timeout_ms = 0, reattach_timeout_ms = 0, finished_run_grace_ms = 0;
  int keep_alive_max_attempt = 0;
};
enum class TimingSource {
  // A Join: each duration within its bound, the liveness window within its bound too.
  kJoin,
  // A record (input too): within the bounds a Join gets, or the operator's own (unclamped)
  // defaults where those are larger. The finished-run grace is a record's only.
  kRecord,
};
// What a Join or a RunRecord asks for (the fields they share; a record's finished-run grace is
// its own).
template <typename Message>
TimingRequest timing_asked(const Message& m) {
  TimingRequest t;
  t.join_timeout_ms = m.join_timeout_ms();
  t.last_call_timeout_ms = m.last_call_timeout_ms();
  t.keep_alive_interval_ms = m.keep_alive_interval_ms();
  t.keep_alive_max_attempt = m.keep_alive_max_attempt();
  t.hang_timeout_ms = m.hang_timeout_ms();
  t.reattach_timeout_ms = m.reattach_timeout_ms();
  return t;
}

// The timing rules, once: the operator's `defaults` with what was asked (0 or less: the
// default).
RendezvousTimeouts run_timing(const RendezvousTimeouts& defaults, const TimingRequest& asked,
                              TimingSource source);

absl::Status validate(const v1::Join& j);

template <typename Nodes>
auto find_session(Nodes& nodes, SessionId session) {
  return std::find_if(nodes.begin(), nodes.end(),
                      [session](const auto& n) { return n.session == session; });
}

// Whether an expected survivor has joined again since the restart (it is then waiting): its
// record's restart time is kept from the restart until its Join, or until it goes.
template <typename NodeState>
bool survivor_back(const NodeState& node) {
  return !node.restarted_at.has_value();
}

// Whether anybody holds the run: a connected node, or a detached member's place.
template <typename Run>
bool run_held(const Run& run) {
  return !run.nodes.all().empty();
}

// A member of the round with its first global rank. Ranks are contiguous per node, in the
// members' order (by group rank); node null: none.
template <typename Node>
struct Placed {
  const Node* node = nullptr;
  int first_rank = 0;
};

// The first member for which `is(member)` holds.
template <typename Nodes, typename Pred>
auto place_member(const Nodes& members, Pred is) {
  Placed<typename Nodes::value_type> p;
  for (const auto& n : members) {
    if (is(n)) {
      p.node = &n;
      return p;
    }
    p.first_rank += n.join.local_world_size();
  }
  return Placed<typename Nodes::value_type>{};
}

// The member that holds global `rank`.
template <typename Nodes>
auto member_holding(const Nodes& members, int rank) {
  Placed<typename Nodes::value_type> p;
  for (const auto& n : members) {
    const int count = n.join.local_world_size();
    if (rank >= p.first_rank && rank < p.first_rank + count) {
      p.node = &n;
      return p;
    }
    p.first_rank += count;
  }
  return Placed<typename Nodes::value_type>{};
}

}  // namespace muster::rendezvous::internal
