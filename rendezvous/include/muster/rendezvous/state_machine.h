// The rendezvous state machine: every rule about rounds, membership, restarts and timeouts.
//
// Pure logic: no sockets, no threads, no clock of its own. The caller feeds it events,
// each stamped with `now`, and sends the messages it returns. The gRPC server drives it
// from one thread; tests drive it with a fake clock.
//
// Thread safety: none. Must be used from one thread (the server's io_context).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "muster/v1/rendezvous.pb.h"

namespace muster::rendezvous {

using Clock = std::chrono::steady_clock;
using TimePoint = Clock::time_point;
using SessionId = std::uint64_t;

// Timing rules, with torchrun's c10d defaults.
struct RendezvousTimeouts {
  // A node waiting for a round that has not reached min_nodes gives up after this.
  std::chrono::milliseconds join_timeout{std::chrono::seconds(600)};
  // Once min_nodes have joined, the round stays open this long for more (unless max is reached).
  std::chrono::milliseconds last_call_timeout{std::chrono::seconds(30)};
  // A finished run's id is remembered this long, so a late join gets a clear error.
  std::chrono::milliseconds finished_run_grace{std::chrono::seconds(60)};
  // A node that sends nothing for keep_alive_interval * keep_alive_max_attempt is lost.
  // (A node whose process dies is lost at once: its stream ends.)
  std::chrono::milliseconds keep_alive_interval{std::chrono::seconds(5)};
  int keep_alive_max_attempt = 3;
};

// Bounds on what one Join may carry (the server also caps the message size).
inline constexpr std::size_t kMaxIdLength = 256;
inline constexpr int kMaxLocalWorldSize = 1 << 16;
inline constexpr int kMaxNodes = 1 << 20;

// One thing for the server to do: send `msg` on `session`, or end the session's stream
// with `status` (after every message queued before it).
struct Outgoing {
  SessionId session = 0;
  std::optional<v1::ServerMsg> msg;
  bool close = false;
  absl::Status status;  // meaningful when close
};

class StateMachine {
 public:
  explicit StateMachine(RendezvousTimeouts timeouts = {}) : timeouts_(timeouts) {}

  // A message from an agent's stream. The caller has checked the token.
  std::vector<Outgoing> on_message(SessionId session, const v1::AgentMsg& msg, TimePoint now);

  // The agent's stream ended (the agent exited, was killed, or its connection broke).
  std::vector<Outgoing> on_stream_closed(SessionId session, TimePoint now);

  // Applies every timeout due at `now`.
  std::vector<Outgoing> on_tick(TimePoint now);

  // When on_tick next has work; nullopt when no timer is pending.
  std::optional<TimePoint> next_deadline() const;

  // Runs currently held (waiting, running, or finished and within their grace).
  std::size_t num_runs() const { return runs_.size(); }
  // Runs that have not finished.
  std::size_t num_active_runs() const;
  bool has_run(const std::string& run_id) const { return runs_.count(run_id) > 0; }

  // What is held for `run_id`, or for every run when it is empty.
  std::vector<v1::RunStatus> status(const std::string& run_id) const;

 private:
  struct Node {
    SessionId session = 0;
    v1::Join join;
  };
  enum class Phase { kJoining, kRunning, kFinished };
  struct Run {
    std::string id;
    RendezvousTimeouts timeouts;  // the server's defaults, overridden by the first Join
    int min_nodes = 1;
    int max_nodes = 1;
    int max_restarts = 0;
    Phase phase = Phase::kJoining;
    int round = 0;  // number of the last round that closed; 0 before the first
    int restart_count = 0;
    std::vector<Node> waiting;  // joined for the next round, in join order (spares included)
    std::vector<Node> members;  // the running round, by group rank
    std::set<SessionId> succeeded;
    std::map<std::string, int> last_rank;  // node_id -> group rank in the previous round
    // After a restart: the previous round's nodes still connected. Once all of them have
    // rejoined (and min is met) the round closes without waiting for the last call.
    std::set<std::string> expected;
    std::map<SessionId, TimePoint> last_seen;  // every connected node of the run
    std::optional<TimePoint> keep_alive_check;
    std::optional<TimePoint> join_deadline;
    std::optional<TimePoint> last_call_deadline;
    std::optional<TimePoint> expires_at;  // when a finished run's state is dropped
  };

  std::vector<Outgoing> on_join(SessionId session, const v1::Join& join, TimePoint now);
  void on_failure(Run& run, SessionId session, const v1::ReportFailure& f, TimePoint now,
                  std::vector<Outgoing>& out);
  void on_success(Run& run, SessionId session, const v1::ReportSuccess& s, TimePoint now,
                  std::vector<Outgoing>& out);
  void maybe_close_round(Run& run, TimePoint now, std::vector<Outgoing>& out);
  void close_round(Run& run, TimePoint now, std::vector<Outgoing>& out);
  void restart(Run& run, const std::string& reason, bool counts, TimePoint now,
               std::vector<Outgoing>& out);
  void finish(Run& run, const v1::ServerMsg& last, TimePoint now, std::vector<Outgoing>& out);
  Run* run_of(SessionId session);
  void drop_session(Run& run, SessionId session, TimePoint now, std::vector<Outgoing>& out);
  void check_keep_alive(Run& run, TimePoint now, std::vector<Outgoing>& out);

  RendezvousTimeouts timeouts_;
  std::map<std::string, Run> runs_;
  std::map<SessionId, std::string> session_run_;
};

}  // namespace muster::rendezvous
