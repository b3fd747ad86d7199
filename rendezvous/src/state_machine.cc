#include "muster/rendezvous/state_machine.h"

#include "muster/rendezvous/stall.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace muster::rendezvous {
namespace {

using std::chrono::milliseconds;

Outgoing send(SessionId s, v1::ServerMsg msg) {
  Outgoing o;
  o.session = s;
  o.msg = std::move(msg);
  return o;
}

Outgoing close_with(SessionId s, absl::Status status) {
  Outgoing o;
  o.session = s;
  o.close = true;
  o.status = std::move(status);
  return o;
}

// --- Saturating time arithmetic ----------------------------------------------------------
// Client durations are clamped, but the operator's defaults are not, and a steady_clock
// duration (ns) holds only ~292 years: nothing here may wrap.

Clock::duration to_clock(milliseconds d) {
  constexpr auto cap = std::chrono::duration_cast<milliseconds>(Clock::duration::max());
  if (d <= milliseconds::zero()) return Clock::duration::zero();
  if (d >= cap) return Clock::duration::max();
  return std::chrono::duration_cast<Clock::duration>(d);
}

// t + d, or TimePoint::max() ("never") where that does not fit.
TimePoint after(TimePoint t, milliseconds d) {
  const Clock::duration c = to_clock(d);
  if (t.time_since_epoch() > Clock::duration::max() - c) return TimePoint::max();
  return t + c;
}

// A deadline at least 1 ms after `now`: a zero timeout from the operator must not make a
// timer that is always due (after on_tick(now), no deadline is at or before now).
TimePoint deadline(TimePoint now, milliseconds d) {
  return after(now, std::max(d, milliseconds(1)));
}

milliseconds times(milliseconds d, int n) {
  if (n <= 0 || d <= milliseconds::zero()) return milliseconds::zero();
  if (d.count() > std::numeric_limits<milliseconds::rep>::max() / n) return milliseconds::max();
  return d * n;
}

// A client-supplied duration: 0 or less is `fallback`, more than `max` is `max`.
milliseconds client_duration(std::int64_t ms, milliseconds fallback, milliseconds max) {
  if (ms <= 0) return fallback;
  return ms >= max.count() ? max : milliseconds(ms);
}

milliseconds shutdown_timeout_of(const v1::Join& j) {
  return client_duration(j.shutdown_timeout_ms(), limits::kDefaultShutdownTimeout,
                         limits::kMaxShutdownTimeout);
}

// --- UTF-8 -------------------------------------------------------------------------------

// Room kept for the note a cut adds, so that text plus note stays within the bound:
// "\n[... cut " + up to 20 digits + " bytes]".
constexpr std::size_t kCutNoteRoom = 40;
static_assert(limits::kMaxFailureMessageBytes > kCutNoteRoom);
static_assert(limits::kMaxFailureTracebackBytes > kCutNoteRoom);

bool is_continuation(char c) { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; }

// A message: its start is what the user reads first; the note goes at the end.
std::string cut_keep_start(const std::string& s, std::size_t max) {
  if (s.size() <= max) return s;
  std::size_t keep = max - kCutNoteRoom;
  while (keep > 0 && is_continuation(s[keep])) --keep;  // not inside a character
  return absl::StrCat(s.substr(0, keep), "\n[... cut ", s.size() - keep, " bytes]");
}

// A traceback: Python puts the exception last, so its end is kept and the note goes first.
std::string cut_keep_end(const std::string& s, std::size_t max) {
  if (s.size() <= max) return s;
  std::size_t start = s.size() - (max - kCutNoteRoom);
  while (start < s.size() && is_continuation(s[start])) ++start;
  return absl::StrCat("[... cut ", start, " bytes]\n", s.substr(start));
}

absl::Status check_text(const std::string& what, const std::string& s) {
  if (s.size() > limits::kMaxIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("join: ", what, " is ", s.size(),
                                                   " bytes, longer than ", limits::kMaxIdBytes));
  }
  if (!is_valid_utf8(s)) {
    return absl::InvalidArgumentError(absl::StrCat("join: ", what, " is not valid UTF-8"));
  }
  return absl::OkStatus();
}

absl::Status validate(const v1::Join& j) {
  if (j.run_id().empty()) return absl::InvalidArgumentError("join: empty run id");
  for (const auto& [what, text] : {std::pair<std::string, const std::string*>{"run id", &j.run_id()},
                                   {"node id", &j.node_id()},
                                   {"host", &j.host()}}) {
    if (absl::Status st = check_text(what, *text); !st.ok()) return st;
  }
  if (j.local_world_size() < 1 || j.local_world_size() > kMaxLocalWorldSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("join: local_world_size ", j.local_world_size(), " out of range"));
  }
  if (j.min_nodes() < 1 || j.max_nodes() < j.min_nodes() || j.max_nodes() > kMaxNodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("join: bad node range ", j.min_nodes(), ":", j.max_nodes()));
  }
  // WORLD_SIZE is the sum of every member's local_world_size, at most max_nodes of them:
  // bounding each node's share keeps the sum an int32 (ranks are int32 on the wire).
  if (static_cast<std::int64_t>(j.local_world_size()) * j.max_nodes() >
      std::numeric_limits<std::int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "join: local_world_size ", j.local_world_size(), " x max nodes ", j.max_nodes(),
        " could make a world larger than 2^31-1 ranks"));
  }
  if (j.max_restarts() < 0) return absl::InvalidArgumentError("join: negative max_restarts");
  if (j.master_port_candidate() < 0 || j.master_port_candidate() > 65535) {
    return absl::InvalidArgumentError("join: master port out of range");
  }
  if (j.reattach_round() < 0 ||
      (j.reattach_round() > 0 &&
       (j.reattach_group_rank() < 0 || j.reattach_group_rank() >= j.max_nodes()))) {
    return absl::InvalidArgumentError(absl::StrCat("join: re-attach to round ", j.reattach_round(),
                                                   " as group rank ", j.reattach_group_rank(),
                                                   " is out of range"));
  }
  if (j.requested_rank() >= j.max_nodes()) {
    return absl::InvalidArgumentError(absl::StrCat("join: node rank ", j.requested_rank(),
                                                   " is not below max nodes ", j.max_nodes()));
  }
  return absl::OkStatus();
}

template <typename Nodes>
auto find_session(Nodes& nodes, SessionId session) {
  return std::find_if(nodes.begin(), nodes.end(),
                      [session](const auto& n) { return n.session == session; });
}

// Whether an expected survivor has joined again since the restart (it is then waiting):
// restarted_at holds it from the restart until its Join, or until it goes. O(log n), where
// a scan of `waiting` would cost O(n) per survivor on every event (check_invariants checks
// that the two agree).
template <typename Run>
bool survivor_back(const Run& run, SessionId session) {
  return run.restarted_at.count(session) == 0;
}

}  // namespace

namespace detail {
TimePoint deadline_after(TimePoint now, std::chrono::milliseconds d) { return deadline(now, d); }
std::chrono::milliseconds client_duration_of(std::int64_t ms, std::chrono::milliseconds fallback,
                                             std::chrono::milliseconds max) {
  return client_duration(ms, fallback, max);
}
absl::Status validate_join(const v1::Join& j) { return validate(j); }
}  // namespace detail

v1::WorkerFailure cap_failure(const v1::WorkerFailure& f) {
  v1::WorkerFailure r = f;
  r.DiscardUnknownFields();
  if (r.message().size() > limits::kMaxFailureMessageBytes) {
    r.set_message(cut_keep_start(r.message(), limits::kMaxFailureMessageBytes));
  }
  if (r.traceback().size() > limits::kMaxFailureTracebackBytes) {
    r.set_traceback(cut_keep_end(r.traceback(), limits::kMaxFailureTracebackBytes));
  }
  return r;
}

std::string_view event_name(RunEvent::Kind kind) {
  switch (kind) {
    case RunEvent::Kind::kNodeJoined: return "node_joined";
    case RunEvent::Kind::kRoundFormed: return "round_formed";
    case RunEvent::Kind::kWorkerFailed: return "worker_failed";
    case RunEvent::Kind::kRestart: return "restart";
    case RunEvent::Kind::kNodeLost: return "node_lost";
    case RunEvent::Kind::kSucceeded: return "succeeded";
    case RunEvent::Kind::kFailed: return "failed";
    case RunEvent::Kind::kRunRestored: return "run_restored";
    case RunEvent::Kind::kNodeReattached: return "node_reattached";
  }
  return "unknown";
}

RunEvent& StateMachine::emit(RunEvent::Kind kind, const Run& run, TimePoint now) {
  touch(run.id);  // every change to a run's durable state comes with one of its events
  if (events_.size() >= limits::kMaxPendingEvents) events_.erase(events_.begin());
  RunEvent& e = events_.emplace_back();
  e.kind = kind;
  e.run_id = run.id;
  e.round = run.round;
  e.at = now;
  e.restart_count = run.restart_count;
  return e;
}

std::vector<RunEvent> StateMachine::take_events() {
  std::vector<RunEvent> out;
  out.swap(events_);
  return out;
}

StateMachine::Counts StateMachine::counts() const {
  Counts c;
  for (const auto& [id, run] : runs_) {
    switch (run.phase) {
      case Phase::kJoining: ++c.joining; break;
      case Phase::kRunning:
        ++c.running;
        c.members += static_cast<std::int64_t>(run.members.size());
        break;
      case Phase::kFinished: ++c.finished; break;
    }
    if (run.phase != Phase::kFinished) c.waiting += static_cast<std::int64_t>(run.waiting.size());
  }
  return c;
}

std::size_t StateMachine::num_active_runs() const {
  return std::count_if(runs_.begin(), runs_.end(),
                       [](const auto& kv) { return kv.second.phase != Phase::kFinished; });
}

StateMachine::Run* StateMachine::run_of(SessionId session) {
  auto it = session_run_.find(session);
  if (it == session_run_.end()) return nullptr;
  auto r = runs_.find(it->second);
  return r == runs_.end() ? nullptr : &r->second;
}

std::vector<Outgoing> StateMachine::on_message(SessionId session, const v1::AgentMsg& msg,
                                               TimePoint now) {
  std::vector<Outgoing> out;
  // The server refuses larger messages before they get here; this is the second edge, so
  // that nothing larger is ever kept or forwarded whoever drives the machine.
  if (const std::size_t size = msg.ByteSizeLong(); size > limits::kMaxAgentMessageBytes) {
    refuse(session,
           absl::ResourceExhaustedError(absl::StrCat("message of ", size,
                                                     " bytes is larger than the limit of ",
                                                     limits::kMaxAgentMessageBytes)),
           now, out);
    return out;
  }
  if (msg.has_join()) return on_join(session, msg.join(), now);
  Run* run = run_of(session);
  if (run == nullptr) {
    // A node whose re-attach was refused is in no run until its plain Join, while it stops
    // its workers: its keep-alives are answered and its progress reports ignored.
    if (msg.has_keep_alive()) {
      v1::ServerMsg ack;
      ack.mutable_keep_alive();
      out.push_back(send(session, std::move(ack)));
      return out;
    }
    if (msg.has_progress()) return out;
    out.push_back(
        close_with(session, absl::FailedPreconditionError("protocol error: message before join")));
    return out;
  }
  if (auto seen = run->last_seen.find(session); seen != run->last_seen.end()) seen->second = now;
  if (msg.has_failure()) {
    on_failure(*run, session, msg.failure(), now, out);
  } else if (msg.has_success()) {
    on_success(*run, session, msg.success(), now, out);
  } else if (msg.has_progress()) {
    on_progress(*run, session, msg.progress(), now, out);
  } else if (msg.has_keep_alive()) {
    // Being heard from (above), and an answer: the agent's proof that the server hears it.
    v1::ServerMsg ack;
    ack.mutable_keep_alive();
    out.push_back(Outgoing{session, std::move(ack), false, absl::OkStatus()});
  }
  return out;
}

std::vector<Outgoing> StateMachine::on_join(SessionId session, const v1::Join& join,
                                            TimePoint now) {
  std::vector<Outgoing> out;
  if (absl::Status st = validate(join); !st.ok()) {
    refuse(session, st, now, out);
    return out;
  }
  if (join.reattach_round() > 0) return on_reattach(session, join, now);
  // A session serves one run: a stream that could join a second run would stay a member
  // (a ghost) of the first, holding it up.
  if (auto cur = session_run_.find(session);
      cur != session_run_.end() && cur->second != join.run_id()) {
    refuse(session,
           absl::InvalidArgumentError(absl::StrCat(
               "this stream is in run '", cur->second, "' and cannot join run '",
               join.run_id(), "': a stream serves one run (it has been taken out of '",
               cur->second, "')")),
           now, out);
    return out;
  }
  auto it = runs_.find(join.run_id());
  if (it == runs_.end()) {
    if (runs_.size() >= limits::kMaxRuns) {
      refuse(session,
             absl::ResourceExhaustedError(absl::StrCat(
                 "the rendezvous server holds ", runs_.size(), " runs, its limit; run '",
                 join.run_id(), "' cannot be created now")),
             now, out);
      return out;
    }
    it = runs_.try_emplace(join.run_id()).first;
    Run& run = it->second;
    run.id = join.run_id();
    run.phase_since = now;
    run.min_nodes = join.min_nodes();
    run.max_nodes = join.max_nodes();
    run.max_restarts = join.max_restarts();
    run.max_restarts_without_progress =
        std::clamp(join.max_restarts_without_progress(), 0, limits::kMaxRestartsWithoutProgress);
    run.budget_reset_steps = std::max<std::int64_t>(0, join.restart_budget_reset_after_steps());
    run.timeouts = timeouts_;
    // The first node sets the run's timing, within bounds: one client must not be able to
    // make a run (or its nodes) wait for ever, nor make a deadline wrap.
    RendezvousTimeouts& t = run.timeouts;
    t.join_timeout =
        client_duration(join.join_timeout_ms(), t.join_timeout, limits::kMaxJoinTimeout);
    t.last_call_timeout = client_duration(join.last_call_timeout_ms(), t.last_call_timeout,
                                          limits::kMaxLastCallTimeout);
    t.keep_alive_interval = client_duration(join.keep_alive_interval_ms(),
                                            t.keep_alive_interval, limits::kMaxKeepAliveInterval);
    t.hang_timeout =
        client_duration(join.hang_timeout_ms(), t.hang_timeout, limits::kMaxHangTimeout);
    t.reattach_timeout = client_duration(join.reattach_timeout_ms(), t.reattach_timeout,
                                         limits::kMaxReattachTimeout);
    if (join.keep_alive_max_attempt() > 0) {
      t.keep_alive_max_attempt = std::min(join.keep_alive_max_attempt(),
                                          limits::kMaxKeepAliveAttempts);
    }
    // A window the Join set (interval x attempts) within its bound: fewer attempts, at
    // least one. The operator's defaults are theirs.
    const bool client_window = join.keep_alive_interval_ms() > 0 || join.keep_alive_max_attempt() > 0;
    if (client_window &&
        times(t.keep_alive_interval, t.keep_alive_max_attempt) > limits::kMaxLivenessWindow) {
      t.keep_alive_max_attempt = static_cast<int>(std::max<std::int64_t>(
          1, limits::kMaxLivenessWindow / t.keep_alive_interval));
    }
  }
  Run& run = it->second;
  if (run.phase == Phase::kFinished) {
    refuse(session,
           absl::FailedPreconditionError(absl::StrCat("run '", run.id, "' has already finished")),
           now, out);
    return out;
  }
  if (join.min_nodes() != run.min_nodes || join.max_nodes() != run.max_nodes ||
      join.max_restarts() != run.max_restarts) {
    refuse(session,
           absl::InvalidArgumentError(absl::StrCat(
               "run '", run.id, "' is configured with nnodes=", run.min_nodes, ":",
               run.max_nodes, " max_restarts=", run.max_restarts, ", this node asked for ",
               join.min_nodes(), ":", join.max_nodes(), " max_restarts=", join.max_restarts())),
           now, out);
    return out;
  }
  // Keep only what the node needs: not the credential, not fields this server does not know.
  v1::Join kept = join;
  kept.clear_token();
  kept.DiscardUnknownFields();

  // The node of a place held for its re-attach joins afresh: it gave the place up (its
  // agent stopped its workers), so the round has lost it.
  bool gave_up = false;
  if (run.phase == Phase::kRunning && !run.detached.empty()) {
    auto m = std::find_if(run.members.begin(), run.members.end(), [&](const Node& n) {
      return run.detached.count(n.session) > 0 && n.join.node_id() == join.node_id();
    });
    if (m != run.members.end()) {
      RunEvent& e = emit(RunEvent::Kind::kNodeLost, run, now);
      e.cause = "rejoined";
      e.nodes = 1;
      e.node_id = m->join.node_id();
      e.host = m->join.host();
      run.detached.erase(m->session);
      run.members.erase(m);
      if (run.detached.empty()) run.reattach_until.reset();
      gave_up = true;
    }
  }

  // A member that joins again while its round runs has left the round (its agent restarted
  // on its own): it must not be member and waiter at once.
  bool was_member = gave_up;
  if (run.phase == Phase::kRunning) {
    if (auto m = find_session(run.members, session); m != run.members.end()) {
      run.members.erase(m);
      run.succeeded.erase(session);
      was_member = true;
    }
  }
  const bool newcomer = !was_member && run.restarted_at.count(session) == 0 &&
                        find_session(run.waiting, session) == run.waiting.end();
  if (newcomer) {
    RunEvent& e = emit(RunEvent::Kind::kNodeJoined, run, now);
    e.node_id = kept.node_id();
    e.host = kept.host();
  }
  // A survivor back after a restart: learn how long it takes, if longer than it says.
  if (auto r = run.restarted_at.find(session); r != run.restarted_at.end()) {
    const auto took = std::chrono::duration_cast<milliseconds>(now - r->second);
    if (took > shutdown_timeout_of(join)) {
      run.rejoin_took[session] = took;
    } else {
      run.rejoin_took.erase(session);
    }
    run.restarted_at.erase(r);
  }
  // A rejoin on the same stream (after a Restart) replaces any earlier entry.
  if (auto w = find_session(run.waiting, session); w != run.waiting.end()) run.waiting.erase(w);
  run.waiting.push_back(Node{session, std::move(kept)});
  session_run_[session] = run.id;
  run.last_seen[session] = now;
  if (!run.keep_alive_check) {
    run.keep_alive_check = deadline(now, run.timeouts.keep_alive_interval);
  }

  if (run.phase == Phase::kRunning) {
    if (was_member) {
      restart(run, absl::StrCat("node ", join.node_id(), " joined again; restarting"), "rejoin",
              false, now, out);
    } else if (static_cast<int>(run.members.size()) < run.max_nodes) {
      // A newcomer while a round runs: scale up if there is room, else it waits as a spare.
      restart(run, absl::StrCat("node ", join.node_id(), " joined; scaling up"), "node_joined",
              false, now, out);
    }
    return out;
  }
  maybe_close_round(run, now, out);
  return out;
}

std::vector<Outgoing> StateMachine::on_reattach(SessionId session, const v1::Join& join,
                                                TimePoint now) {
  std::vector<Outgoing> out;
  if (session_run_.count(session) > 0) {
    refuse(session,
           absl::InvalidArgumentError(
               "a re-attach must be the first message of its stream (this one is in a run)"),
           now, out);
    return out;
  }
  const int round = join.reattach_round();
  const int g = join.reattach_group_rank();
  auto answer = [&](bool ok, std::string reason, const Run* run) {
    v1::ServerMsg msg;
    v1::Attached* a = msg.mutable_attached();
    a->set_round(round);
    a->set_ok(ok);
    a->set_reason(std::move(reason));
    if (run != nullptr) a->set_restart_count(run->restart_count);
    out.push_back(send(session, std::move(msg)));
  };
  auto it = runs_.find(join.run_id());
  if (it == runs_.end()) {
    answer(false, absl::StrCat("the server does not hold run '", join.run_id(), "'"), nullptr);
    return out;
  }
  Run& run = it->second;
  if (run.phase == Phase::kFinished) {
    // A member that missed the end (the server stopped before it was told): tell it now.
    auto r = run.last_rank.find(join.node_id());
    if (run.result && run.round == round && r != run.last_rank.end() && r->second == g) {
      out.push_back(send(session, *run.result));
      out.push_back(close_with(session, absl::OkStatus()));
      return out;
    }
    answer(false, absl::StrCat("run '", run.id, "' has already finished"), &run);
    return out;
  }
  if (run.phase != Phase::kRunning || run.round != round) {
    answer(false,
           run.phase == Phase::kRunning
               ? absl::StrCat("run '", run.id, "' is in round ", run.round, ", not ", round)
               : absl::StrCat("run '", run.id, "' is forming round ", run.round + 1),
           &run);
    return out;
  }
  if (g >= static_cast<int>(run.members.size()) ||
      run.members[g].join.node_id() != join.node_id()) {
    answer(false,
           absl::StrCat("node ", join.node_id(), " is not group rank ", g, " of round ", round,
                        " of run '", run.id, "'"),
           &run);
    return out;
  }
  Node& member = run.members[g];
  const SessionId old = member.session;
  if (run.detached.erase(old) == 0) {
    // Its old stream is still open here (its end not seen yet): the newer one takes over.
    out.push_back(close_with(old, absl::AbortedError("replaced by a newer stream of the same "
                                                     "node (it re-attached)")));
    session_run_.erase(old);
    run.last_seen.erase(old);
    run.progress.erase(old);
  }
  if (run.detached.empty()) run.reattach_until.reset();
  if (run.succeeded.erase(old) > 0) run.succeeded.insert(session);
  member.session = session;
  session_run_[session] = run.id;
  run.last_seen[session] = now;  // its liveness counts from here
  if (!run.keep_alive_check || *run.keep_alive_check > deadline(now, run.timeouts.keep_alive_interval)) {
    run.keep_alive_check = deadline(now, run.timeouts.keep_alive_interval);
  }
  {
    RunEvent& e = emit(RunEvent::Kind::kNodeReattached, run, now);
    e.node_id = member.join.node_id();
    e.host = member.join.host();
    e.nodes = static_cast<int>(run.detached.size());  // places still waiting
  }
  answer(true, "", &run);
  return out;
}

std::vector<std::string> StateMachine::drop_detached(Run& run, TimePoint now,
                                                     std::string_view cause) {
  std::vector<std::string> lost;
  if (run.detached.empty()) return lost;
  for (auto m = run.members.begin(); m != run.members.end();) {
    if (run.detached.count(m->session) == 0) {
      ++m;
      continue;
    }
    RunEvent& e = emit(RunEvent::Kind::kNodeLost, run, now);
    e.cause = std::string(cause);
    e.nodes = 1;
    e.node_id = m->join.node_id();
    e.host = m->join.host();
    lost.push_back(m->join.node_id());
    run.succeeded.erase(m->session);
    m = run.members.erase(m);
  }
  run.detached.clear();
  run.reattach_until.reset();
  return lost;
}

void StateMachine::maybe_close_round(Run& run, TimePoint now, std::vector<Outgoing>& out) {
  if (run.phase != Phase::kJoining) return;
  const int n = static_cast<int>(run.waiting.size());
  if (n < run.min_nodes) {
    run.last_call_deadline.reset();
    if (!run.join_deadline) run.join_deadline = deadline(now, run.timeouts.join_timeout);
    return;
  }
  // After a restart the round waits for every survivor still expected (each for a bounded
  // time): a round closed without them is restarted again by their Join, and with workers
  // slower to stop than the last call that repeats for ever.
  bool pending = false;
  for (const auto& [session, until] : run.expected) {
    if (!survivor_back(run, session)) pending = true;
  }
  if (pending) {
    run.last_call_deadline.reset();
    return;
  }
  // Full, or every survivor is back: nobody else is worth waiting for.
  if (n >= run.max_nodes || !run.expected.empty()) {
    close_round(run, now, out);
    return;
  }
  if (!run.last_call_deadline) {
    run.last_call_deadline = deadline(now, run.timeouts.last_call_timeout);
  }
  if (now >= *run.last_call_deadline) close_round(run, now, out);
}

void StateMachine::on_progress(Run& run, SessionId session, const v1::Progress& p,
                               TimePoint now, std::vector<Outgoing>& out) {
  if (run.phase != Phase::kRunning || p.round() != run.round) return;  // a late report
  const Node* node = nullptr;
  for (const Node& n : run.members) {
    if (n.session == session) node = &n;
  }
  if (node == nullptr) return;
  if (p.ranks_size() > node->join.local_world_size()) {
    refuse(session,
           absl::InvalidArgumentError(absl::StrCat("progress: ", p.ranks_size(),
                                                   " ranks from a node of ",
                                                   node->join.local_world_size())),
           now, out);
    return;
  }
  for (const v1::RankProgress& r : p.ranks()) {
    if (r.phase().size() > limits::kMaxProgressPhaseBytes) {
      refuse(session,
             absl::InvalidArgumentError(absl::StrCat("progress: a phase of ", r.phase().size(),
                                                     " bytes (the limit is ",
                                                     limits::kMaxProgressPhaseBytes, ")")),
             now, out);
      return;
    }
  }
  for (const v1::RankProgress& r : p.ranks()) {
    if (r.reports() == 0) continue;
    auto [it, fresh] = run.round_steps.try_emplace(r.rank(), r.step(), r.step());
    if (!fresh) it->second.second = std::max(it->second.second, r.step());
  }
  if (run.timeouts.hang_timeout.count() == 0 || run.stall_sent) return;  // nobody asked, or told
  run.progress[session] = {now, p};
  if (run.next_stall_check && now < *run.next_stall_check) return;
  run.next_stall_check = after(now, std::clamp(run.timeouts.hang_timeout / 4,
                                               std::chrono::milliseconds(50),
                                               std::chrono::milliseconds(1000)));
  // The rule over every node's ranks, each as its node last saw it.
  std::vector<RankProgress> ranks;
  std::map<int, const Node*> holder;
  for (const Node& n : run.members) {
    auto it = run.progress.find(n.session);
    if (it == run.progress.end()) continue;
    const auto& [at, prog] = it->second;
    for (const v1::RankProgress& r : prog.ranks()) {
      RankProgress x;
      x.rank = r.rank();
      x.local_rank = r.local_rank();
      x.pid = static_cast<pid_t>(r.pid());
      x.step = r.step();
      x.reports = r.reports();
      x.phase = r.phase();
      const auto still = std::chrono::milliseconds(
          std::clamp<std::int64_t>(r.still_ms(), 0, limits::kMaxHangTimeout.count()));
      x.changed = at - still;
      ranks.push_back(std::move(x));
      holder[r.rank()] = &n;
    }
  }
  auto stall = find_stall(ranks, now, run.timeouts.hang_timeout);
  if (!stall) return;
  run.stall_sent = true;
  const Node& n = *holder[stall->rank.rank];
  v1::ServerMsg msg;
  v1::Stalled* s = msg.mutable_stalled();
  s->set_round(run.round);
  s->set_rank(stall->rank.rank);
  s->set_description(stall->describe(n.join.host()));
  out.push_back(send(n.session, std::move(msg)));
}

void StateMachine::close_round(Run& run, TimePoint now, std::vector<Outgoing>& out) {
  run.progress.clear();
  run.stall_sent = false;
  run.next_stall_check.reset();
  run.round_steps.clear();
  const int count = std::min<int>(run.max_nodes, run.waiting.size());
  // Who gets in: requested ranks and previous members first, then join order.
  std::stable_partition(run.waiting.begin(), run.waiting.end(), [&](const Node& n) {
    return n.join.requested_rank() >= 0 || run.last_rank.count(n.join.node_id()) > 0;
  });
  std::vector<Node> members(run.waiting.begin(), run.waiting.begin() + count);
  run.waiting.erase(run.waiting.begin(), run.waiting.begin() + count);

  // Stable group ranks: requested rank, else the previous one if still in range, else the
  // lowest free one.
  std::vector<int> rank(count, -1);
  std::vector<bool> taken(count, false);
  auto claim = [&](int i, int r) {
    if (r >= 0 && r < count && !taken[r]) {
      rank[i] = r;
      taken[r] = true;
    }
  };
  for (int i = 0; i < count; ++i) claim(i, members[i].join.requested_rank());
  for (int i = 0; i < count; ++i) {
    auto prev = run.last_rank.find(members[i].join.node_id());
    if (rank[i] < 0 && prev != run.last_rank.end()) claim(i, prev->second);
  }
  int next_free = 0;
  for (int i = 0; i < count; ++i) {
    if (rank[i] >= 0) continue;
    while (taken[next_free]) ++next_free;
    claim(i, next_free);
  }
  std::vector<Node> ordered(count);
  for (int i = 0; i < count; ++i) ordered[rank[i]] = std::move(members[i]);

  ++run.round;
  run.members = std::move(ordered);
  run.succeeded.clear();
  run.last_rank.clear();
  run.phase = Phase::kRunning;
  run.phase_since = now;
  run.expected.clear();
  run.join_deadline.reset();
  run.last_call_deadline.reset();

  int world_size = 0;
  for (const Node& n : run.members) world_size += n.join.local_world_size();
  const v1::Join& master = run.members.front().join;
  int offset = 0;
  for (int r = 0; r < count; ++r) {
    const Node& n = run.members[r];
    run.last_rank[n.join.node_id()] = r;
    v1::ServerMsg msg;
    v1::Assignment* a = msg.mutable_assignment();
    a->set_round(run.round);
    a->set_group_rank(r);
    a->set_group_world_size(count);
    a->set_rank_offset(offset);
    a->set_world_size(world_size);
    a->set_master_addr(master.host());
    a->set_master_port(master.master_port_candidate());
    a->set_store_prefix(absl::StrCat("/", run.id, "/", run.round, "/"));
    a->set_restart_count(run.restart_count);
    a->set_hang_timeout_ms(run.timeouts.hang_timeout.count());
    a->set_wants_progress(run.timeouts.hang_timeout.count() > 0 ||
                          run.max_restarts_without_progress > 0 || run.budget_reset_steps > 0);
    // Only a server that keeps its runs can take a node back whose stream ended.
    if (recording_) a->set_reattach_timeout_ms(run.timeouts.reattach_timeout.count());
    out.push_back(send(n.session, std::move(msg)));
    offset += n.join.local_world_size();
  }
  RunEvent& e = emit(RunEvent::Kind::kRoundFormed, run, now);
  e.nodes = count;
  e.world_size = world_size;
  e.spares = static_cast<int>(run.waiting.size());
  if (run.restarted_since) {
    e.took = std::chrono::duration_cast<milliseconds>(now - *run.restarted_since);
    run.restarted_since.reset();
  }
  // Spares left over keep waiting for the next round (max_nodes is met: no join deadline).
}

void StateMachine::restart(Run& run, const std::string& reason, std::string_view cause,
                           bool counts, TimePoint now, std::vector<Outgoing>& out) {
  if (counts) ++run.restart_count;
  // Members still detached cannot be told: their places go (they re-attach in vain, then
  // join again).
  drop_detached(run, now, "not_reattached");
  {
    RunEvent& e = emit(RunEvent::Kind::kRestart, run, now);
    e.cause = std::string(cause);
    e.reason = reason;
    e.counts = counts;
  }
  run.restarted_since = now;
  run.expected.clear();
  for (const Node& n : run.members) {
    // Each survivor holds the next round for as long as its agent may take to stop its
    // workers, plus a margin: bounded, so a node that never comes back cannot stall the run.
    run.expected[n.session] = after(after(now, hold_of(run, n)), limits::kRejoinMargin);
    run.restarted_at[n.session] = now;
    v1::ServerMsg msg;
    msg.mutable_restart()->set_reason(reason);
    msg.mutable_restart()->set_restart_count(run.restart_count);
    out.push_back(send(n.session, std::move(msg)));
  }
  run.members.clear();
  run.succeeded.clear();
  run.phase = Phase::kJoining;
  run.phase_since = now;
  run.join_deadline.reset();  // a fresh one, from now, while below min
  run.last_call_deadline.reset();
  maybe_close_round(run, now, out);  // spares may already make a round
}

std::chrono::milliseconds StateMachine::hold_of(const Run& run, const Node& node) const {
  milliseconds hold = shutdown_timeout_of(node.join);
  if (auto took = run.rejoin_took.find(node.session); took != run.rejoin_took.end()) {
    hold = std::max(hold, took->second);
  }
  return std::min(hold, limits::kMaxShutdownTimeout);
}

void StateMachine::finish(Run& run, const v1::ServerMsg& last, TimePoint now,
                          std::vector<Outgoing>& out) {
  if (last.has_fail()) {
    RunEvent& e = emit(RunEvent::Kind::kFailed, run, now);
    e.cause = last.fail().do_not_requeue() ? "no_progress" : "budget_spent";
    e.reason = last.fail().reason();
  } else {
    emit(RunEvent::Kind::kSucceeded, run, now);
  }
  // Every connected node hears the end: members, spares, and a survivor that was not back
  // in time for the round.
  for (const auto& [session, seen] : run.last_seen) {
    out.push_back(send(session, last));
    out.push_back(close_with(session, absl::OkStatus()));
    session_run_.erase(session);
  }
  run.members.clear();
  run.waiting.clear();
  run.succeeded.clear();
  run.expected.clear();
  run.restarted_at.clear();
  run.rejoin_took.clear();
  run.last_seen.clear();
  run.phase = Phase::kFinished;
  run.result = last;
  run.detached.clear();
  run.reattach_until.reset();
  run.held_until.reset();
  run.phase_since = now;
  run.join_deadline.reset();
  run.last_call_deadline.reset();
  run.keep_alive_check.reset();
  run.expires_at = deadline(now, run.timeouts.finished_run_grace);
}

void StateMachine::on_failure(Run& run, SessionId session, const v1::ReportFailure& f,
                              TimePoint now, std::vector<Outgoing>& out) {
  // Only the running round's members count; a report for an older round is stale.
  if (run.phase != Phase::kRunning || find_session(run.members, session) == run.members.end() ||
      f.round() != run.round) {
    return;
  }
  // Cut before anything is kept or forwarded: a Fail goes to every node of the run.
  const v1::WorkerFailure rc = cap_failure(f.root_cause());
  {
    RunEvent& e = emit(RunEvent::Kind::kWorkerFailed, run, now);
    e.host = printable_utf8(rc.host(), limits::kMaxIdBytes);
    e.rank = rc.rank();
    e.exit_code = rc.exit_code();
    e.signal = rc.signal();
    if (auto m = find_session(run.members, session); m != run.members.end()) {
      e.node_id = m->join.node_id();
    }
    v1::FailureStatus& last = run.last_failure.emplace();
    last.set_round(run.round);
    last.set_rank(e.rank);
    last.set_host(e.host);
    last.set_node_id(e.node_id);
    last.set_exit_code(e.exit_code);
    last.set_signal(e.signal);
    last.set_timestamp_ms(rc.timestamp_ms());
    run.last_failure_at = now;
  }
  // The budget that knows progress: the most steps a rank made in this round.
  std::uint64_t steps = 0;
  for (const auto& [rank, span] : run.round_steps) steps = std::max(steps, span.second - span.first);
  std::string note;
  if (run.budget_reset_steps > 0 && steps >= static_cast<std::uint64_t>(run.budget_reset_steps) &&
      run.restart_count > run.budget_from) {
    run.budget_from = run.restart_count;  // long progress: the whole budget is back
    note = absl::StrCat(" (", steps, " steps made: the restart budget is back)");
  }
  bool no_progress_stop = false;
  if (run.max_restarts_without_progress > 0) {
    run.restarts_without_progress = steps > 0 ? 0 : run.restarts_without_progress + 1;
    no_progress_stop = run.restarts_without_progress > run.max_restarts_without_progress;
  }
  const int spent = run.restart_count - run.budget_from;
  if (spent < run.max_restarts && !no_progress_stop) {
    const std::string reason = absl::StrCat(
        "worker rank ", rc.rank(), " on ", printable_utf8(rc.host(), limits::kMaxIdBytes),
        " failed; restart ", spent + 1, " of ", run.max_restarts, note);
    run.last_failure->set_reason(reason);
    restart(run, reason, "worker_failure", true, now, out);
    return;
  }
  v1::ServerMsg msg;
  v1::Fail* fail = msg.mutable_fail();
  if (no_progress_stop) {
    fail->set_do_not_requeue(true);
    fail->set_reason(absl::StrCat("a worker failed in ", run.restarts_without_progress,
                                  " rounds in a row before any rank made a step "
                                  "(max_restarts_without_progress ",
                                  run.max_restarts_without_progress, "); do not requeue"));
  } else {
    fail->set_reason(run.max_restarts == 0 ? std::string("a worker failed and max_restarts is 0")
                                           : absl::StrCat("a worker failed and all ",
                                                          run.max_restarts, " restarts are spent"));
  }
  *fail->mutable_root_cause() = rc;
  run.last_failure->set_reason(fail->reason());
  const int others = std::min<int>(f.others_size(), limits::kMaxFailureOthers);
  for (int i = 0; i < others; ++i) *fail->add_others() = cap_failure(f.others(i));
  finish(run, msg, now, out);
}

void StateMachine::on_success(Run& run, SessionId session, const v1::ReportSuccess& s,
                              TimePoint now, std::vector<Outgoing>& out) {
  if (run.phase != Phase::kRunning || find_session(run.members, session) == run.members.end() ||
      s.round() != run.round) {
    return;
  }
  run.succeeded.insert(session);
  if (run.succeeded.size() == run.members.size()) {
    v1::ServerMsg msg;
    msg.mutable_done();
    finish(run, msg, now, out);
  }
}

std::vector<Outgoing> StateMachine::on_stream_closed(SessionId session, TimePoint now) {
  std::vector<Outgoing> out;
  leave(session, now, out);
  return out;
}

void StateMachine::leave(SessionId session, TimePoint now, std::vector<Outgoing>& out) {
  Run* run = run_of(session);
  if (run == nullptr) {
    session_run_.erase(session);
    return;
  }
  const std::string id = run->id;
  drop_session(*run, session, now, out);
  drop_if_unheld(id);
}

void StateMachine::refuse(SessionId session, absl::Status status, TimePoint now,
                          std::vector<Outgoing>& out) {
  out.push_back(close_with(session, std::move(status)));
  // The stream is ending: the session is out of its run now, not when the close is seen.
  leave(session, now, out);
}

bool StateMachine::drop_if_unheld(const std::string& run_id) {
  auto it = runs_.find(run_id);
  if (it == runs_.end() || it->second.phase == Phase::kFinished ||
      !it->second.last_seen.empty() || !it->second.detached.empty() || it->second.held_until) {
    return false;
  }
  // Nobody holds the run: whatever its round, nobody can finish it or be told about it.
  runs_.erase(it);
  touch(run_id);
  return true;
}

std::optional<std::string> StateMachine::remove_session(Run& run, SessionId session,
                                                       TimePoint now, std::string_view cause) {
  if (run.phase != Phase::kFinished && run.last_seen.count(session) > 0) {
    const Node* node = nullptr;
    if (auto m = find_session(run.members, session); m != run.members.end()) node = &*m;
    if (auto w = find_session(run.waiting, session); w != run.waiting.end()) node = &*w;
    RunEvent& e = emit(RunEvent::Kind::kNodeLost, run, now);
    e.cause = std::string(cause);
    e.nodes = run.phase == Phase::kRunning &&
              find_session(run.members, session) != run.members.end();  // 1: a member
    if (node != nullptr) {
      e.node_id = node->join.node_id();
      e.host = node->join.host();
    }
  }
  session_run_.erase(session);
  run.last_seen.erase(session);
  // A survivor that dies before it rejoins is no longer waited for.
  run.expected.erase(session);
  run.restarted_at.erase(session);
  run.rejoin_took.erase(session);
  run.succeeded.erase(session);
  run.progress.erase(session);
  if (auto w = find_session(run.waiting, session); w != run.waiting.end()) run.waiting.erase(w);
  auto member = find_session(run.members, session);
  if (run.phase != Phase::kRunning || member == run.members.end()) return std::nullopt;
  std::string node = member->join.node_id();
  run.members.erase(member);
  return node;
}

void StateMachine::after_loss(Run& run, const std::vector<std::string>& lost_members,
                              TimePoint now, std::vector<Outgoing>& out) {
  if (run.phase == Phase::kRunning && !lost_members.empty()) {
    restart(run,
            absl::StrCat(lost_members.size() == 1 ? "node " : "nodes ",
                         absl::StrJoin(lost_members, ", "), " left the run"),
            "node_lost", false, now, out);
  } else if (run.phase == Phase::kJoining) {
    maybe_close_round(run, now, out);
  }
}

void StateMachine::drop_session(Run& run, SessionId session, TimePoint now,
                                std::vector<Outgoing>& out) {
  std::vector<std::string> lost;
  if (auto node = remove_session(run, session, now, "stream_closed")) lost.push_back(std::move(*node));
  after_loss(run, lost, now, out);
}

void StateMachine::check_keep_alive(Run& run, TimePoint now, std::vector<Outgoing>& out) {
  const milliseconds limit =
      times(run.timeouts.keep_alive_interval, run.timeouts.keep_alive_max_attempt);
  std::vector<SessionId> silent;
  for (const auto& [session, seen] : run.last_seen) {
    if (after(seen, limit) <= now) silent.push_back(session);
  }
  // All of them first, then one restart: dropping them one by one could close a round
  // with a silent node that the next step drops again.
  std::vector<std::string> lost;
  for (SessionId s : silent) {
    out.push_back(close_with(
        s, absl::UnavailableError(absl::StrCat("no keep-alive from this node for ", limit.count(),
                                               " ms: it was dropped from run '", run.id, "'"))));
    if (auto node = remove_session(run, s, now, "silent")) lost.push_back(std::move(*node));
  }
  if (!silent.empty()) after_loss(run, lost, now, out);
  // The next check is when the node heard from longest ago would become silent, so a
  // silent node is dropped exactly at the end of the window, not up to an interval later.
  std::optional<TimePoint> next;
  for (const auto& [session, seen] : run.last_seen) {
    const TimePoint due = after(seen, limit);
    if (!next || due < *next) next = due;
  }
  run.keep_alive_check = next ? next : deadline(now, run.timeouts.keep_alive_interval);
}

std::vector<v1::RunStatus> StateMachine::status(const std::string& run_id,
                                                std::optional<TimePoint> now) const {
  auto age_ms = [&now](TimePoint since) -> std::int64_t {
    if (!now || *now < since) return 0;
    return std::chrono::duration_cast<milliseconds>(*now - since).count();
  };
  std::vector<v1::RunStatus> out;
  for (const auto& [id, run] : runs_) {
    if (!run_id.empty() && id != run_id) continue;
    v1::RunStatus s;
    s.set_run_id(id);
    s.set_phase(run.phase == Phase::kJoining   ? "joining"
                : run.phase == Phase::kRunning ? "running"
                                               : "finished");
    s.set_round(run.round);
    s.set_restart_count(run.restart_count);
    s.set_max_restarts(run.max_restarts);
    s.set_min_nodes(run.min_nodes);
    s.set_max_nodes(run.max_nodes);
    int world = 0;
    for (const Node& n : run.members) {
      s.add_members(n.join.node_id());
      v1::NodeStatus* m = s.add_member_nodes();
      m->set_node_id(n.join.node_id());
      m->set_host(n.join.host());
      m->set_local_world_size(n.join.local_world_size());
      m->set_group_rank(s.member_nodes_size() - 1);
      m->set_first_rank(world);  // ranks are contiguous per node, by group rank
      world += n.join.local_world_size();
    }
    s.set_world_size(world);
    s.set_waiting(static_cast<int>(run.waiting.size()));
    for (const Node& n : run.waiting) {
      v1::NodeStatus* w = s.add_waiting_nodes();
      w->set_node_id(n.join.node_id());
      w->set_host(n.join.host());
      w->set_local_world_size(n.join.local_world_size());
      w->set_group_rank(-1);
      w->set_first_rank(-1);
    }
    if (run.last_failure) {
      *s.mutable_last_failure() = *run.last_failure;
      s.mutable_last_failure()->set_age_ms(age_ms(run.last_failure_at));
    }
    s.set_phase_age_ms(age_ms(run.phase_since));
    if (run.phase == Phase::kFinished) {
      s.set_result(run.result && run.result->has_fail() ? "failed" : "succeeded");
    }
    out.push_back(std::move(s));
  }
  return out;
}

void StateMachine::tick_run(const std::string& run_id, TimePoint now,
                            std::vector<Outgoing>& out) {
  auto it = runs_.find(run_id);
  if (it == runs_.end()) return;
  Run& run = it->second;
  if (run.phase == Phase::kFinished) {
    if (run.expires_at && now >= *run.expires_at) {
      runs_.erase(it);
      touch(run_id);
    }
    return;
  }
  // A restored run: places not re-attached in time are lost; a hold nobody came for ends.
  if (run.reattach_until && now >= *run.reattach_until) {
    run.reattach_until.reset();
    std::vector<std::string> lost = drop_detached(run, now, "not_reattached");
    after_loss(run, lost, now, out);
    if (drop_if_unheld(run_id)) return;
  }
  if (run.held_until && now >= *run.held_until) {
    run.held_until.reset();
    if (drop_if_unheld(run_id)) return;
  }
  if (run.keep_alive_check && now >= *run.keep_alive_check) {
    check_keep_alive(run, now, out);
    if (drop_if_unheld(run_id)) return;
  }
  if (run.phase != Phase::kJoining) return;
  // Survivors past their hold no longer hold the round.
  std::optional<TimePoint> latest_hold;
  for (auto e = run.expected.begin(); e != run.expected.end();) {
    const bool back = survivor_back(run, e->first);
    if (!back && now >= e->second) {
      e = run.expected.erase(e);
      continue;
    }
    if (!back && (!latest_hold || e->second > *latest_hold)) latest_hold = e->second;
    ++e;
  }
  maybe_close_round(run, now, out);  // the last call, or survivors given up on
  if (run.phase != Phase::kJoining || !run.join_deadline || now < *run.join_deadline) return;
  if (static_cast<int>(run.waiting.size()) >= run.min_nodes) {
    run.join_deadline.reset();  // min was reached: the join timeout no longer applies
    return;
  }
  if (latest_hold) {
    // Below min, but survivors may still come back: give them their time first.
    run.join_deadline = latest_hold;
    return;
  }
  absl::Status st = absl::DeadlineExceededError(
      absl::StrCat("rendezvous for run '", run.id, "' timed out: ", run.waiting.size(),
                   " of at least ", run.min_nodes, " nodes joined within the join timeout"));
  {
    RunEvent& e = emit(RunEvent::Kind::kFailed, run, now);
    e.cause = "join_timeout";
    e.reason = std::string(st.message());
  }
  for (const auto& [session, seen] : run.last_seen) {
    out.push_back(close_with(session, st));
    session_run_.erase(session);
  }
  runs_.erase(it);
  touch(run_id);
}

std::vector<Outgoing> StateMachine::on_tick(TimePoint now) {
  std::vector<Outgoing> out;
  // By id, not by iterator: a run's tick may drop it.
  std::vector<std::string> ids;
  ids.reserve(runs_.size());
  for (const auto& [id, run] : runs_) ids.push_back(id);
  for (const std::string& id : ids) tick_run(id, now, out);
  return out;
}

std::optional<TimePoint> StateMachine::next_deadline() const {
  std::optional<TimePoint> best;
  auto consider = [&best](const std::optional<TimePoint>& t) {
    if (t && (!best || *t < *best)) best = t;
  };
  for (const auto& [id, run] : runs_) {
    consider(run.join_deadline);
    consider(run.last_call_deadline);
    consider(run.expires_at);
    consider(run.keep_alive_check);
    consider(run.reattach_until);
    consider(run.held_until);
    if (run.phase == Phase::kJoining) {
      for (const auto& [session, until] : run.expected) {
        if (!survivor_back(run, session)) consider(until);
      }
    }
  }
  return best;
}

absl::Status StateMachine::check_invariants() const {
  auto broken = [](auto&&... what) { return absl::InternalError(absl::StrCat(what...)); };
  if (runs_.size() > limits::kMaxRuns) return broken(runs_.size(), " runs held");
  for (const auto& [session, id] : session_run_) {
    auto r = runs_.find(id);
    if (r == runs_.end()) return broken("session ", session, " is in run '", id, "' not held");
    if (r->second.phase == Phase::kFinished) {
      return broken("session ", session, " is in finished run '", id, "'");
    }
    if (r->second.last_seen.count(session) == 0) {
      return broken("session ", session, " of run '", id, "' is not seen as connected");
    }
  }
  for (const auto& [id, run] : runs_) {
    if (run.id != id) return broken("run '", id, "' names itself '", run.id, "'");
    for (const auto& [session, seen] : run.last_seen) {
      auto s = session_run_.find(session);
      if (s == session_run_.end() || s->second != id) {
        return broken("session ", session, " is connected to run '", id, "' but not in it");
      }
    }
    std::set<SessionId> in_round;
    for (const std::vector<Node>* group : {&run.members, &run.waiting}) {
      for (const Node& n : *group) {
        if (!in_round.insert(n.session).second) {
          return broken("session ", n.session, " is twice in run '", id, "' (member/waiting)");
        }
        if (run.detached.count(n.session) > 0) {
          if (n.session < kFirstDetachedSession || session_run_.count(n.session) > 0 ||
              run.last_seen.count(n.session) > 0) {
            return broken("detached member ", n.session, " of run '", id, "' has a stream");
          }
        } else if (run.last_seen.count(n.session) == 0) {
          return broken("session ", n.session, " of run '", id, "' is not connected");
        }
        if (!n.join.token().empty() || !n.join.GetReflection()->GetUnknownFields(n.join).empty()) {
          return broken("run '", id, "' keeps a token or unknown fields");
        }
        if (!is_valid_utf8(n.join.node_id()) || !is_valid_utf8(n.join.host())) {
          return broken("run '", id, "' keeps text that is not UTF-8");
        }
      }
    }
    for (SessionId s : run.detached) {
      if (find_session(run.members, s) == run.members.end()) {
        return broken("detached session ", s, " of run '", id, "' is no member");
      }
    }
    if (!run.detached.empty() != run.reattach_until.has_value()) {
      return broken("run '", id, "' has detached members without a hold, or a hold without");
    }
    for (const auto& [session, until] : run.expected) {
      if (run.last_seen.count(session) == 0) {
        return broken("expected session ", session, " of run '", id, "' is not connected");
      }
    }
    for (const auto& [session, t] : run.restarted_at) {
      if (run.last_seen.count(session) == 0) {
        return broken("restarted session ", session, " of run '", id, "' is not connected");
      }
    }
    for (const auto& [session, took] : run.rejoin_took) {
      if (run.last_seen.count(session) == 0) {
        return broken("session ", session, " of run '", id, "' has a rejoin time, not connected");
      }
    }
    for (SessionId s : run.succeeded) {
      if (find_session(run.members, s) == run.members.end()) {
        return broken("session ", s, " succeeded in run '", id, "' but is no member");
      }
    }
    if (run.restart_count - run.budget_from > run.max_restarts ||
        run.budget_from > run.restart_count) {
      return broken("run '", id, "' over its budget");
    }
    const int members = static_cast<int>(run.members.size());
    const int waiting = static_cast<int>(run.waiting.size());
    switch (run.phase) {
      case Phase::kFinished:
        if (members || waiting || !run.last_seen.empty() || !run.expected.empty() ||
            !run.expires_at || !run.result) {
          return broken("finished run '", id, "' holds nodes or has no expiry");
        }
        break;
      case Phase::kRunning:
        if (members < run.min_nodes || members > run.max_nodes) {
          return broken("run '", id, "' runs with ", members, " members");
        }
        if (members < run.max_nodes && waiting > 0) {
          return broken("run '", id, "' has room but leaves ", waiting, " waiting");
        }
        if (!run.expected.empty() || run.join_deadline || run.last_call_deadline) {
          return broken("running run '", id, "' has joining state");
        }
        break;
      case Phase::kJoining: {
        if (members) return broken("joining run '", id, "' has members");
        if (run.last_seen.empty() && !run.held_until) {
          return broken("run '", id, "' is held by nobody");
        }
        bool pending = false;
        for (const auto& [session, until] : run.expected) {
          const bool waits = find_session(run.waiting, session) != run.waiting.end();
          if (waits != survivor_back(run, session)) {
            return broken("survivor ", session, " of run '", id, "': waiting ", waits,
                          ", rejoined ", survivor_back(run, session));
          }
          pending |= !waits;
        }
        if (!pending && waiting >= run.min_nodes && (waiting >= run.max_nodes ||
                                                     !run.expected.empty())) {
          return broken("run '", id, "' should have closed its round");
        }
        if (waiting < run.min_nodes && !run.join_deadline) {
          return broken("run '", id, "' is below min without a join deadline");
        }
        if (pending && run.last_call_deadline) {
          return broken("run '", id, "' runs a last call while survivors are expected");
        }
        break;
      }
    }
    if (run.phase == Phase::kRunning && run.last_seen.empty() && run.detached.empty()) {
      return broken("running run '", id, "' is held by nobody");
    }
    if (recording_) {
      auto rec = recorded_.find(id);
      if (touched_.count(id) == 0 &&
          (rec == recorded_.end() || rec->second != record_of(run).SerializeAsString())) {
        return broken("run '", id, "' changed its record without an event");
      }
    }
    if (run.phase != Phase::kFinished && !run.keep_alive_check) {
      return broken("run '", id, "' has no keep-alive check");
    }
  }
  return absl::OkStatus();
}

}  // namespace muster::rendezvous
