// What happened to a run, as the state machine decided it: the feed behind the server's
// metrics, its event log and the live page (docs/operations.md). Pure data; each of the
// machine's Decisions carries the RunEvents it made, and the server hands them to its event
// sinks on the io thread when it sends the decision's messages.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

namespace muster::rendezvous {

struct RunEvent {
  enum class Kind {
    kNodeJoined,    // a node waits for the next round (a newcomer, not a rejoin after a restart)
    kRoundFormed,   // a round closed: nodes, world_size, took (from the restart, if one)
    kWorkerFailed,  // a member reported a failed worker: rank, host, exit_code / signal
    kRestart,       // every member was told Restart: cause, counts, restart_count, reason
    kNodeLost,      // a node left the run: its stream ended (cause "stream_closed") or it
                    // was silent past the liveness window ("silent")
    kSucceeded,     // every member succeeded: the run finished
    kFailed,        // the run finished failed (budget spent, join timeout): reason
    kRunRestored,   // a restarted server loaded the run (RunStore): detached = places held
                    // for re-attach (0 for a joining or finished run)
    kNodeReattached,  // a member's new stream took its place (no restart): node_id, host;
                      // detached = places still waiting for their nodes
    // In-place recovery (docs/in_place.md):
    kInPlaceResumed,   // a node that joined in place reported every worker resumed: node_id,
                       // host, the node's phases, took (from the restart); resumed = nodes
                       // resumed so far, in_place = nodes in place (done when they are equal)
    kInPlaceFallback,  // a node's in-place recovery did not complete: node_id, host, reason;
                       // its failure report (kWorkerFailed, then kRestart) follows
    // The straggler watch (docs/stragglers.md): rank, node_id, host, cause ("compute",
    // "data"), slowdown, step, reason (one line naming it).
    kStragglerNamed,
    kStragglerCleared,  // a named rank is no longer slow (same fields)
    // launch --exclude_stragglers: a named rank's node left the world (node_id, host, rank,
    // cause, slowdown, step, reason), its cool-down and the times it was excluded.
    // A kRestart (cause "straggler_excluded") follows.
    kStragglerExcluded,
  };
  Kind kind = Kind::kNodeJoined;
  std::string run_id;
  int round = 0;  // the run's round when it happened (the new one for kRoundFormed)
  std::chrono::steady_clock::time_point at;
  // Node events (joined, lost) and a failed worker's node.
  std::string node_id;
  std::string host;
  // kRestart: "worker_failure", "node_lost", "node_joined" (scale up) or "rejoin" (a member
  // joined again). kNodeLost: "stream_closed", "silent", "not_reattached" (a restored
  // member not back in time) or "rejoined" (it joined afresh instead). kFailed: "budget_spent",
  // "no_progress" or "join_timeout".
  std::string cause;
  std::string reason;  // the text the agents were given
  bool counts = false;  // kRestart: spent from the restart budget
  int restart_count = 0;
  int nodes = 0;        // kRoundFormed: members
  int world_size = 0;   // kRoundFormed
  int spares = 0;       // kRoundFormed: nodes left waiting
  // kRoundFormed: members that kept their workers (Join.in_place); kInPlaceResumed: the
  // round's nodes in place.
  int in_place = 0;
  int resumed = 0;       // kInPlaceResumed: nodes in place that resumed so far
  bool member = false;   // kNodeLost: it was a member of the running round (not waiting)
  int detached = 0;      // kRunRestored, kNodeReattached: places held for their nodes
  // kRoundFormed after a restart: from the restart to this round; zero for a first round.
  // kInPlaceResumed: from the restart to this report.
  std::chrono::milliseconds took{0};
  // kInPlaceResumed: the node's own phases (ReportResumed).
  std::chrono::milliseconds abort{0}, rendezvous{0}, reform{0};
  // kWorkerFailed
  int rank = -1;
  int exit_code = 0;
  int signal = 0;
  // kStragglerNamed, kStragglerCleared, kStragglerExcluded
  double slowdown = 0;
  std::uint64_t step = 0;
  // kStragglerExcluded: how long its node stays out, and how many times it was excluded.
  std::chrono::milliseconds cooldown{0};
  int times_excluded = 0;
};

// "round_formed", "worker_failed", ...: the names the event log and metrics use.
std::string_view event_name(RunEvent::Kind kind);

}  // namespace muster::rendezvous
