// The rendezvous state machine: every rule about rounds, membership, restarts and timeouts.
//
// Pure logic: no sockets, no threads, no clock of its own. The caller feeds it events,
// each stamped with `now`, and sends the messages it returns. The gRPC server drives it
// from one thread; tests and the fuzz target drive it with a fake clock.
//
// Thread safety: none. Must be used from one thread (the server's io_context).
//
// The rules (every bound is named in limits.h):
//
// Joins.
//  - A Join is refused, and its stream closed, with INVALID_ARGUMENT when: run_id is empty;
//    run_id, node_id or host is longer than limits::kMaxIdBytes or not valid UTF-8;
//    local_world_size is outside 1..kMaxLocalWorldSize; min_nodes < 1, max_nodes < min_nodes
//    or max_nodes > kMaxNodes; local_world_size x max_nodes above 2^31-1 (the world must fit
//    an int32); max_restarts < 0; master_port_candidate outside 0..65535;
//    requested_rank >= max_nodes; its nnodes/max_restarts differ from the run's.
//  - An AgentMsg (a Join included) larger than limits::kMaxAgentMessageBytes serialized ends
//    the stream with RESOURCE_EXHAUSTED (the server checks this first; this is a second edge).
//  - A Join that would create a run while limits::kMaxRuns are held is refused with
//    RESOURCE_EXHAUSTED. A Join to a finished run (within its grace) gets FAILED_PRECONDITION.
//  - A session (stream) serves exactly one run: a Join naming another run than the one the
//    session is in gets INVALID_ARGUMENT naming both runs.
//  - What is kept of a Join is what the node needs: the token and unknown fields are dropped.
//
// Timing a client may set. The first Join of a run sets its join_timeout, last_call_timeout,
// keep_alive_interval and keep_alive_max_attempt; each Join carries its node's own
// shutdown_timeout. A value of 0 *or less* means the server's default (limits' default for
// the shutdown timeout); a larger value is clamped to its bound: kMaxJoinTimeout,
// kMaxLastCallTimeout, kMaxKeepAliveInterval, kMaxKeepAliveAttempts, kMaxShutdownTimeout.
// Every deadline is computed with saturating arithmetic: a deadline past what the clock can
// hold is "never", and no product or sum wraps.
//
// Rounds.
//  - A round closes when max_nodes wait, or when min_nodes wait and last_call_timeout has
//    passed since min was reached. While fewer than min_nodes wait, a join deadline runs
//    (from the first Join, a restart, or the moment the round fell below min); when it
//    passes, every node of the run gets DEADLINE_EXCEEDED and the run is dropped.
//  - After a restart, the round waits for every survivor (a member of the previous round
//    still connected): while one is expected and not back, the round does not close, by
//    max_nodes nor by the last call, and no last call runs. A survivor holds the round for at
//    most its own shutdown timeout plus limits::kRejoinMargin from the restart; a survivor
//    whose stream ends (or is dropped for silence) before it rejoins no longer holds it. Once
//    every survivor still expected is back (at least one) and min_nodes wait, the round closes
//    at once, without a last call.
//  - Group ranks are stable: requested rank, else the previous one if in range, else the
//    lowest free one. Requested ranks and previous members get in first, then join order.
//
// Restarts. While a round runs, every member gets Restart when: a member reports a failure
// for the round (counts against max_restarts; when none is left, every node gets Fail
// instead), a member's stream ends or it is dropped for silence, a member sends a Join
// again, or a newcomer joins while the round has fewer than max_nodes (scale up; beyond
// max it waits as a spare). Only the failure counts against the budget. Ticks alone never
// restart a run except by a keep-alive drop of a member. A failure report's root cause and
// each other failure get `message` cut to kMaxFailureMessageBytes (keeping the start) and
// `traceback` to kMaxFailureTracebackBytes (keeping the end), each with a note saying how
// much was cut, and at most kMaxFailureOthers others are kept, before anything is stored or
// forwarded.
//
// Liveness. A connected node (waiting, member or expected survivor) that sends nothing for
// keep_alive_interval * keep_alive_max_attempt is dropped (UNAVAILABLE), as if its stream
// had ended. A session the machine closes for any reason is out of its run at once.
//
// Holding. A run that is not finished and has no connected node left (its last stream
// ended, or its last node was dropped or refused) is dropped at once, whatever its round.
// A finished run (Done or Fail) is kept for finished_run_grace, so a late Join gets a clear
// error, then dropped.
//
// Durability and re-attach (docs/rendezvous.md, "Restarting the server without restarting
// workers"). With enable_records(), every change to a run's durable state (RunRecord: its
// config and timing, round, phase, restart count and budget, members with their Joins in
// group-rank order, last ranks, a finished run's result) names the run in its Decision's
// `touched`, records() gives what to write, and every Assignment carries the run's
// reattach_timeout. Every such change emits a RunEvent
// of the run (or drops it), which is how changes are found. Not durable: waiting nodes,
// sessions, timers, success reports (a re-attached node sends its own again), this round's
// progress reports.
//  - restore(records, now) on a machine that holds no run: a running run comes back with
//    every member detached (no stream), holding its place until now + reattach_timeout; a
//    joining run comes back with nobody waiting and is held that long for its nodes to join
//    again; a finished run is kept for a whole finished_run_grace from now. Timers start at
//    `now`: nobody is dropped for the silence of the outage. Invalid records are refused.
//  - A Join with reattach_round > 0 must be the first message of its stream. When the run is
//    running that round and its member at reattach_group_rank has the Join's node id, the
//    stream takes that place (a detached one, or one whose old stream is still open here,
//    which is then closed with ABORTED) and gets Attached{ok}: no restart, no budget spent.
//    A member of a finished run gets the run's Done or Fail and its stream ends. Otherwise it
//    gets Attached{ok = false} and is in no run until it sends a plain Join; a KeepAlive from
//    such a stream is answered and a Progress ignored.
//  - A detached member not back by the hold's end is lost (kNodeLost "not_reattached") and
//    the others restart without spending the budget; a restart for any other reason drops
//    every detached member the same way (they cannot be told). A plain Join from the node of
//    a detached place gives the place up: the others restart (cause "rejoin").
//  - A run is held while it has a connected node, a detached member, or a restore hold.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "muster/rendezvous/events.h"
#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/straggler.h"
#include "muster/rendezvous/timeouts.h"
#include "muster/ops/text.h"
#include "muster/v1/rendezvous.pb.h"

namespace muster::rendezvous {

using Clock = std::chrono::steady_clock;
using TimePoint = Clock::time_point;
using SessionId = std::uint64_t;

// The RunRecord format this machine writes and restores.
inline constexpr int kRunRecordFormat = 1;
// Sessions from here up stand for detached members of a restored run; a caller's session ids
// must stay below.
inline constexpr std::uint64_t kFirstDetachedSession = std::uint64_t{1} << 62;

// One thing for the server to do: send `msg` on `session`, or end the session's stream
// with `status` (after every message queued before it).
struct Outgoing {
  SessionId session = 0;
  std::optional<v1::ServerMsg> msg;
  bool close = false;
  absl::Status status;  // meaningful when close
};

// The machine's whole answer to one input, as etcd's raft hands back one Ready: what must be
// durable before anything leaves, what to send, and what happened. The caller writes
// records(touched) first (a failed write sends nothing), then sends `messages` in order and
// hands `events` to its sinks. Decisions committed together are merged in order: a burst of
// joins is written once, and a big run's record is built once per commit, not once per join.
struct Decision {
  std::vector<Outgoing> messages;
  std::vector<RunEvent> events;   // oldest first, at most limits::kMaxPendingEvents
  std::set<std::string> touched;  // runs whose record may have changed (enable_records only)

  bool empty() const { return messages.empty() && events.empty() && touched.empty(); }
  // Appends `later` (decided after this one) to this one.
  void merge(Decision&& later);
};

// A WorkerFailure as the server keeps and forwards it: message and traceback cut to their
// bounds with a note (see the rules above). Exposed for tests.
v1::WorkerFailure cap_failure(const v1::WorkerFailure& f);

class StateMachine {
 public:
  explicit StateMachine(RendezvousTimeouts timeouts = {}) : timeouts_(timeouts) {}

  // A message from an agent's stream. The caller has checked the token.
  Decision on_message(SessionId session, const v1::AgentMsg& msg, TimePoint now);

  // The agent's stream ended (the agent exited, was killed, or its connection broke).
  Decision on_stream_closed(SessionId session, TimePoint now);

  // Applies every timeout due at `now`. Afterwards no deadline is at or before `now`.
  Decision on_tick(TimePoint now);

  // When on_tick next has work; nullopt when no timer is pending.
  std::optional<TimePoint> next_deadline() const;

  // Runs currently held (waiting, running, or finished and within their grace).
  std::size_t num_runs() const { return runs_.size(); }
  // Runs that have not finished.
  std::size_t num_active_runs() const;
  bool has_run(const std::string& run_id) const { return runs_.count(run_id) > 0; }
  // Nodes that joined a run and have not left it (their stream is open).
  std::size_t num_sessions() const { return session_run_.size(); }
  // The run a session belongs to, or null.
  const std::string* run_id_of(SessionId session) const {
    auto it = session_run_.find(session);
    return it == session_run_.end() ? nullptr : &it->second;
  }

  // Counts over every run, for metrics: cheaper than status(), which builds each run's
  // members and failures.
  struct Counts {
    std::int64_t joining = 0, running = 0, finished = 0;
    std::int64_t members = 0;  // in running rounds
    std::int64_t waiting = 0;  // waiting for a next round (spares included), unfinished runs
  };
  Counts counts() const;

  // What is held for `run_id`, or for every run when it is empty. With `now`, the ages
  // (phase_age_ms, last_failure.age_ms) are filled in; without, they are 0.
  std::vector<v1::RunStatus> status(const std::string& run_id,
                                    std::optional<TimePoint> now = std::nullopt) const;

  // --- Durable state (see "Durability and re-attach" above) ------------------------------
  // Turns record tracking on (off by default; a server without a run store never pays).
  // Call it before the first input or restore.
  void enable_records() { recording_ = true; }
  // What a restarted server needs to go on with `run_id`; nullopt when it is not held.
  std::optional<v1::RunRecord> record(const std::string& run_id) const;
  struct RecordChanges {
    std::vector<v1::RunRecord> put;    // runs created or changed: each one's whole record
    std::vector<std::string> erased;   // runs dropped
  };
  // What to write for `runs` (the `touched` of the decisions being committed): the record of
  // each one that changed since it was last given here or restored, and those dropped.
  RecordChanges records(const std::set<std::string>& runs);
  struct RestoreResult {
    int restored = 0;
    std::vector<std::string> refused;  // one line per record not restored, saying why
    std::vector<RunEvent> events;      // a kRunRestored for each run restored
  };
  // Loads `records` into a machine that holds no run (see above).
  RestoreResult restore(const std::vector<v1::RunRecord>& records, TimePoint now);

  // Checks the machine's internal invariants (for tests and the fuzz target); OK or the
  // first one broken.
  absl::Status check_invariants() const;

 private:
  struct Node {
    SessionId session = 0;
    v1::Join join;  // as kept: no token, no unknown fields
  };
  enum class Phase { kJoining, kRunning, kFinished };
  // What a run knows of one of its nodes beyond its Join: one record per node, by session (as
  // etcd raft's tracker keeps one Progress per peer). A node is connected (its stream open,
  // last_seen set) or a detached member (a restored run's member without a stream yet, its
  // placeholder session from kFirstDetachedSession up). The record goes when the node does.
  struct NodeState {
    std::optional<TimePoint> last_seen;  // connected: when last heard from
    // After a restart: until when this survivor holds the next round (kept once it is back in
    // `waiting`; cleared when the round closes). A connected node may be in none of members,
    // waiting and expected: a survivor that was not back in time, until it joins again.
    std::optional<TimePoint> expected_until;
    // Told Restart then, until it joins again: how long it took (survivor_back: none).
    std::optional<TimePoint> restarted_at;
    // How long it took to come back when that was longer than its shutdown timeout: it is
    // held that long next time, so that two nodes slower than they say cannot take turns
    // closing the round without each other (a livelock of late rejoins).
    std::optional<std::chrono::milliseconds> rejoin_took;
    // Its last progress report in the running round (--hang_timeout), with when it came.
    std::optional<std::pair<TimePoint, v1::Progress>> progress;
    bool succeeded = false;  // it reported success in the running round
    // Excluded as a straggler (state_machine_exclusion.cc): connected, in no round, until it
    // joins again after its cool-down.
    bool excluded = false;
  };
  // A run's node records and the counts the rules ask for at every event (kept as records
  // change, so that no rule scans every node to learn them). machine/node_table.cc.
  class NodeTable {
   public:
    using Map = std::map<SessionId, NodeState>;
    const Map& all() const { return nodes_; }
    const NodeState* find(SessionId s) const;
    bool connected(SessionId s) const;
    bool detached(SessionId s) const;
    std::size_t connected_count() const { return connected_; }
    std::size_t detached_count() const { return detached_; }
    std::size_t expected_count() const { return expected_; }
    std::size_t succeeded_count() const { return succeeded_; }

    // Heard from `s` now: connects it (a new record, or a detached one's) or refreshes it.
    void seen(SessionId s, TimePoint now);
    // Only a connected node's time moves (a message from one that is not is not a sign).
    void refresh(SessionId s, TimePoint now);
    void add_detached(SessionId s);
    void set_expected(SessionId s, TimePoint until);
    void clear_expected(SessionId s);
    void clear_all_expected();
    void set_restarted(SessionId s, TimePoint at);
    // Its restart time, now cleared (none when it was not told Restart).
    std::optional<TimePoint> take_restarted(SessionId s);
    void set_rejoin_took(SessionId s, std::optional<std::chrono::milliseconds> took);
    void set_progress(SessionId s, TimePoint at, v1::Progress p);
    void clear_all_progress();
    void set_succeeded(SessionId s, bool succeeded);
    void clear_all_succeeded();
    void set_excluded(SessionId s, bool excluded);
    // Takes the record out (the node left, or its placeholder was re-attached); what it held.
    NodeState erase(SessionId s);
    void clear();

   private:
    void count(const NodeState& n, int sign);
    Map nodes_;
    std::size_t connected_ = 0, detached_ = 0, expected_ = 0, succeeded_ = 0;
  };
  struct Run {
    std::string id;
    // What the first Join (or a restored record) set, and every later Join must match (the
    // restart budget's and the straggler watch's own settings are in their records below).
    struct Config {
      RendezvousTimeouts timeouts;  // the server's defaults, overridden by the first Join
      int min_nodes = 1;
      int max_nodes = 1;
      int max_restarts = 0;
    } config;
    Phase phase = Phase::kJoining;
    int round = 0;  // number of the last round that closed; 0 before the first
    int restart_count = 0;
    std::vector<Node> waiting;  // joined for the next round, in join order (spares included)
    std::vector<Node> members;  // the running round, by group rank
    // Where each node of the last round that closed was, by node id: its group rank (kept
    // for the next round: ranks stay stable; durable), and its global ranks (first, how
    // many), for the lost ranks a Restart names (in-place recovery, docs/in_place.md). Those
    // are named once (a Restart sets `ranks` to 0) and are not durable: a restored run's
    // first Restart names none.
    struct Place {
      int group_rank = 0;
      int first_rank = 0;
      int ranks = 0;
    };
    std::map<std::string, Place> places;
    NodeTable nodes;  // every node of the run that is connected, and detached members
    std::optional<TimePoint> keep_alive_check;
    std::optional<TimePoint> join_deadline;
    std::optional<TimePoint> last_call_deadline;
    std::optional<TimePoint> expires_at;  // when a finished run's state is dropped
    bool stall_sent = false;  // one Stalled per round
    // The rule runs over every rank, so at most once per quarter of the timeout, not on every
    // node's report (1,000 nodes would make that quadratic).
    std::optional<TimePoint> next_stall_check;
    // The restart budget that knows progress (docs/hangs.md).
    struct ProgressBudget {
      int max_restarts_without_progress = 0;  // set by the first Join
      std::int64_t reset_steps = 0;           // set by the first Join
      // Each rank's first and last reported step in the running round.
      std::map<int, std::pair<std::uint64_t, std::uint64_t>> round_steps;
      int restarts_without_progress = 0;  // in a row, after rounds without a step
      // Where the budget counts from (restart_count only grows: it is the workers'
      // TORCHELASTIC_RESTART_COUNT).
      int from = 0;
      // A round closes: its steps are counted afresh.
      void new_round() { round_steps.clear(); }
    } budget;
    // Since the last restart, until the next round closes (its kRoundFormed's `took`).
    std::optional<TimePoint> restarted_since;
    // A restored run: when the places of its detached members go; a joining run held for
    // its nodes.
    std::optional<TimePoint> reattach_until;
    std::optional<TimePoint> held_until;
    std::optional<v1::ServerMsg> result;  // finished: the Done or Fail every member was told
    // For status(): since when the run is in its phase; its last worker failure (one per
    // run, not a history: the event log keeps that), with when it was reported; how it ended.
    TimePoint phase_since;
    std::optional<v1::FailureStatus> last_failure;
    TimePoint last_failure_at;
    // In-place recovery (docs/in_place.md; machine/state_machine_in_place.cc), for status()
    // and events, not durable.
    struct InPlace {
      std::string restart_cause;  // the last restart's
      // The recovery that the round after it is: formed, then each in-place node's resumed
      // report.
      struct Recovery {
        v1::RecoveryStatus status;  // age_ms filled in by status()
        TimePoint formed;
        std::set<SessionId> resumed;
      };
      std::optional<Recovery> recovery;
      int recoveries = 0;
      int fallbacks = 0;
    } in_place;
    // The straggler watch (docs/stragglers.md; machine/state_machine_stragglers.cc) and
    // exclusion (machine/state_machine_exclusion.cc). Not durable.
    struct Stragglers {
      bool watch = false;    // set by the first Join
      bool exclude = false;  // set by the first Join
      // limits::kDefaultStragglerCooldown when the first Join does not ask for one.
      std::chrono::milliseconds cooldown = limits::kDefaultStragglerCooldown;
      // The running round's: the ranks' scores and the slow links (by node id), evaluated at
      // most every limits::kStragglerSampling; when each named rank was named; why each
      // named rank is kept for now.
      StragglerWatch ranks;
      LinkJudge links;
      std::optional<TimePoint> next_check;
      std::map<int, TimePoint> named_at;
      std::map<int, std::string> kept;
      // The nodes excluded, by node id (at most limits::kMaxExcludedNodes), kept across
      // rounds.
      struct Excluded {
        std::string host;
        int times = 0;
        std::chrono::milliseconds cooldown{0};
        TimePoint until;
        double slowdown = 0;
        std::string cause;
      };
      std::map<std::string, Excluded> excluded;
      // A round ends: its ranks are scored afresh (a rank number may be another process).
      void new_round() {
        ranks.reset();
        links.reset();
        next_check.reset();
        named_at.clear();
        kept.clear();
      }
    } stragglers;
  };

  // The decision of the input just handled: `out`, and the events and touched runs it made.
  Decision decided(std::vector<Outgoing> out);
  std::vector<Outgoing> handle_message(SessionId session, const v1::AgentMsg& msg,
                                       TimePoint now);
  std::vector<Outgoing> on_join(SessionId session, const v1::Join& join, TimePoint now);
  std::vector<Outgoing> on_reattach(SessionId session, const v1::Join& join, TimePoint now);
  // on_join's steps: a new run from its first Join; whether a Join fits its run (finished,
  // configured otherwise); a place held for re-attach that its node gave up (true: it was a
  // member); the node among the next round's waiters.
  std::map<std::string, Run>::iterator create_run(const v1::Join& join, TimePoint now);
  absl::Status join_fits(const Run& run, const v1::Join& join) const;
  bool give_up_held_place(Run& run, const v1::Join& join, TimePoint now);
  void add_waiting(Run& run, SessionId session, const v1::Join& join, bool was_member,
                   TimePoint now);
  // Takes every detached member out of the run (kNodeLost, `cause`); their node ids.
  std::vector<std::string> drop_detached(Run& run, TimePoint now, std::string_view cause);
  v1::RunRecord record_of(const Run& run) const;
  void touch(const std::string& run_id) {
    if (!recording_) return;
    touched_.insert(run_id);
    unrecorded_.insert(run_id);
  }
  void on_failure(Run& run, SessionId session, const v1::ReportFailure& f, TimePoint now,
                  std::vector<Outgoing>& out);
  void on_success(Run& run, SessionId session, const v1::ReportSuccess& s, TimePoint now,
                  std::vector<Outgoing>& out);
  void on_progress(Run& run, SessionId session, const v1::Progress& p, TimePoint now,
                   std::vector<Outgoing>& out);
  // In-place recovery, machine/state_machine_in_place.cc: the round after a restart formed
  // (the recovery it starts; how many members came in place); a member's resumed report; a
  // member's failure report that says its in-place recovery fell back.
  int recovery_formed(Run& run, TimePoint now);
  // The straggler watch, machine/state_machine_stragglers.cc: a node's progress scored (after
  // on_progress checked it); the round's named ranks cleared as it ends; the status's part.
  // True when the watch excluded a node (the round was restarted).
  bool watch_stragglers(Run& run, SessionId session, const v1::Progress& p, TimePoint now,
                        std::vector<Outgoing>& out);
  void end_straggler_round(Run& run, TimePoint now);
  // Every straggler named now: the ranks (StragglerWatch) and the nodes with a slow link
  // (LinkJudge; as the node's first rank, cause "network").
  std::vector<Straggler> named_stragglers(const Run& run) const;
  // Exclusion, machine/state_machine_exclusion.cc: after an evaluation, whether a named
  // straggler's node leaves the world (true: it was told, and the others restarted); a Join
  // from a node still in its cool-down (refused); the status's part.
  bool consider_exclusion(Run& run, TimePoint now, std::vector<Outgoing>& out);
  absl::Status excluded_join(const Run& run, const v1::Join& join, TimePoint now) const;
  void exclusion_status(const Run& run, v1::RunStatus& s, std::optional<TimePoint> now) const;
  void straggler_status(const Run& run, v1::RunStatus& s, std::optional<TimePoint> now) const;
  void on_resumed(Run& run, SessionId session, const v1::ReportResumed& r, TimePoint now,
                  std::vector<Outgoing>& out);
  void on_in_place_fallback(Run& run, SessionId session, const v1::ReportFailure& f,
                            TimePoint now);
  void maybe_close_round(Run& run, TimePoint now, std::vector<Outgoing>& out);
  void close_round(Run& run, TimePoint now, std::vector<Outgoing>& out);
  void restart(Run& run, const std::string& reason, std::string_view cause, bool counts,
               TimePoint now, std::vector<Outgoing>& out);
  // Records an event of `run` (kind, round, at = now); the caller fills in the rest.
  RunEvent& emit(RunEvent::Kind kind, const Run& run, TimePoint now);
  void finish(Run& run, const v1::ServerMsg& last, TimePoint now, std::vector<Outgoing>& out);
  Run* run_of(SessionId session);
  // Takes `session` out of its run (as its stream ending would) and drops the run if nobody
  // holds it any more.
  void leave(SessionId session, TimePoint now, std::vector<Outgoing>& out);
  // Closes `session` with `status` and takes it out of its run.
  void refuse(SessionId session, absl::Status status, TimePoint now, std::vector<Outgoing>& out);
  void drop_session(Run& run, SessionId session, TimePoint now, std::vector<Outgoing>& out);
  // Takes `session` out of the run's tables; the node id when it was a running member.
  // A node of the run that goes gets a kNodeLost event with `cause`.
  std::optional<std::string> remove_session(Run& run, SessionId session, TimePoint now,
                                            std::string_view cause);
  // After nodes left: restart when members were lost, else see whether the round can close.
  void after_loss(Run& run, const std::vector<std::string>& lost_members, TimePoint now,
                  std::vector<Outgoing>& out);
  // How long after a restart the survivor `node` holds the next round.
  std::chrono::milliseconds hold_of(const Run& run, const Node& node) const;
  // Drops `run` if it is not finished and no connected node holds it; true if dropped.
  bool drop_if_unheld(const std::string& run_id);
  void check_keep_alive(Run& run, TimePoint now, std::vector<Outgoing>& out);
  void tick_run(const std::string& run_id, TimePoint now, std::vector<Outgoing>& out);

  RendezvousTimeouts timeouts_;
  std::map<std::string, Run> runs_;
  std::map<SessionId, std::string> session_run_;
  std::vector<RunEvent> events_;
  // Records (enable_records): runs touched by the input being decided, runs touched and not
  // yet given to records() (the invariants' view), and each run's record as last given.
  bool recording_ = false;
  std::set<std::string> touched_;
  std::set<std::string> unrecorded_;
  std::map<std::string, std::string> recorded_;
  SessionId next_detached_ = kFirstDetachedSession;
};

}  // namespace muster::rendezvous
