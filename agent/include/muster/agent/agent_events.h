// What happened on this node, as the agent saw it: the feed behind launch's event log
// (--event_log) and its metrics (--metrics_port). Pure data, delivered on the agent's io
// thread in order (AgentOptions::event_sinks); a sink must be quick and must not call into
// the agent.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <string_view>

namespace muster::agent {

// One recovery, from the moment this node noticed that its round was over to its workers of
// the next round running: noticed -> workers stopped -> round formed -> workers started.
// In place (docs/in_place.md): noticed -> survivors aborted (`stopped`) -> round formed ->
// every worker resumed (`started`).
struct Recovery {
  std::string cause;  // "worker_failure" (one of ours), "restart" (the server's), "lost_server"
  std::chrono::steady_clock::time_point noticed, stopped, formed, started;
  bool in_place = false;
};

struct AgentEvent {
  enum class Kind {
    kRoundFormed,     // an Assignment came: round, group_rank, world_size, restart_count
    kWorkersStarted,  // the round's workers were spawned: workers; recovery when after one
    kWorkerFailed,    // one of ours failed: rank, local_rank, pid, exit_code / signal
    kRestart,         // the server said Restart: reason
    kLostServer,      // the stream to the server ended or went silent: reason
    kWorkersStopped,  // every worker of the round is gone (after a failure, restart, signal)
    kSucceeded,       // the run is done (every node's workers succeeded)
    kFailed,          // the run failed (the server's Fail, or this agent's own error): reason
    kReattached,      // after a lost stream, the server gave this node its place back (the
                      // workers kept running): reason = the endpoint
    kInPlaceResumed,   // an in-place recovery completed: every worker resumed; recovery
    kInPlaceFallback,  // an in-place recovery did not complete: reason; a full restart follows
  };
  Kind kind = Kind::kRoundFormed;
  std::chrono::steady_clock::time_point at;
  std::chrono::system_clock::time_point wall;
  int round = 0;
  int restart_count = 0;
  int group_rank = -1;
  int world_size = 0;
  int workers = 0;
  int rank = -1;
  int local_rank = -1;
  long long pid = 0;
  int exit_code = 0;
  int signal = 0;
  std::string reason;
  std::chrono::milliseconds took{0};  // kReattached: from the lost stream to the place back
  std::optional<Recovery> recovery;  // kWorkersStarted after a recovery
};

// "round_formed", "workers_started", ...: the names the event log and metrics use.
std::string_view event_name(AgentEvent::Kind kind);

}  // namespace muster::agent
