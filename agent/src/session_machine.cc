#include "muster/agent/session_machine.h"

#include <csignal>
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "muster/agent/failure.h"
#include "session_step.h"

namespace muster::agent {

int keep_alives_per_interval(std::chrono::milliseconds interval, int nodes) {
  if (nodes <= 0) return kKeepAlivesPerInterval;
  const double fit = static_cast<double>(kKeepAliveBudgetPerSecond) *
                     std::chrono::duration<double>(interval).count() / nodes;
  if (fit >= kKeepAlivesPerInterval) return kKeepAlivesPerInterval;
  return std::max(1, static_cast<int>(fit));
}

}  // namespace muster::agent

namespace muster::agent::session {
namespace {

std::vector<RdzvEndpoint> named(std::vector<RdzvEndpoint> list) {
  for (RdzvEndpoint& e : list) {
    if (e.name.empty()) e.name = e.target;
  }
  return list;
}

std::chrono::milliseconds beat_for(std::chrono::milliseconds interval, int nodes) {
  return std::max(interval / keep_alives_per_interval(interval, nodes),
                  std::chrono::milliseconds(1));
}

}  // namespace

SessionMachine::SessionMachine(Config config)
    : config_(std::move(config)),
      window_(config_.keep_alive_interval * config_.keep_alive_max_attempt),
      probe_after_(config_.keep_alive_interval * kProbeAfterIntervals),
      beat_(beat_for(config_.keep_alive_interval, 0)),
      endpoints_(named(config_.endpoints)) {
  reset_in_place();
}

AgentEvent SessionMachine::event(AgentEvent::Kind kind, Time now) const {
  AgentEvent e;
  e.kind = kind;
  e.at = now;
  e.round = assignment_.round();
  e.restart_count = assignment_.restart_count();
  e.group_rank = assignment_.round() > 0 ? assignment_.group_rank() : -1;
  return e;
}

// The round is over for this node (the first sign of it): a recovery starts, timed until
// the next round's workers run.
void SessionMachine::noticed(Step& s, const char* cause) {
  if (recovery_ || phase_ != Phase::kRunning) return;
  recovery_.emplace();
  recovery_->cause = cause;
  recovery_->noticed = s.now;
}

// --- the stream ---------------------------------------------------------------------------

Actions SessionMachine::start(Time now) {
  Step s(now);
  if (config_.wait_for_server) {
    // The wait is the stream's own (its connect timeout): signals are still served meanwhile.
    s.log(Level::kInfo, absl::StrFormat("waiting for the rendezvous server at %s (up to %d ms)",
                                        endpoints_.current().name, config_.connect_timeout.count()));
    first_deadline_ = now + config_.connect_timeout;
  }
  open_stream(s, config_.wait_for_server, config_.connect_timeout);
  send_join(s);
  s.add(ArmTimer{Timer::kKeepAlive, now + beat_});
  return std::move(s.out);
}

void SessionMachine::send_join(Step& s) {
  phase_ = Phase::kJoining;
  s.add(Send{join_message(false)});  // a dead stream reports itself through on_stream_closed
}

// A Join; with `reattach`, one that asks for this node's place in the running round back;
// with `in_place`, one that says this node keeps its workers for the next round.
v1::AgentMsg SessionMachine::join_message(bool reattach, bool in_place) const {
  v1::AgentMsg msg;
  *msg.mutable_join() = config_.join;
  msg.mutable_join()->set_in_place(in_place);
  if (reattach) {
    msg.mutable_join()->set_reattach_round(assignment_.round());
    msg.mutable_join()->set_reattach_group_rank(assignment_.group_rank());
  }
  return msg;
}

// A new stream to the current endpoint (the first, or after the node lost one). Whatever the
// old stream still had to say is not heard: it was closed when it was given up.
void SessionMachine::open_stream(Step& s, bool wait_for_ready,
                                 std::chrono::milliseconds connect_timeout) {
  stop_silence(s);
  // With several endpoints each attempt is bounded, so the next gets its turn.
  s.add(OpenStream{endpoints_.current(), wait_for_ready,
                   endpoints_.attempt(connect_timeout, window_)});
}

// Opens a new stream on the loop's next turn (not from inside the old stream's callback),
// waiting for the server until *deadline (read then), and sends a Join (a re-attach or not);
// nothing when the agent is exiting or the deadline is gone by then.
void SessionMachine::reopen_soon(Step& s, std::optional<Time>* deadline, bool reattach) {
  reopen_deadline_ = deadline;
  reopen_reattach_ = reattach;
  s.add(ArmTimer{Timer::kReopen, s.now});
}

// The liveness rule, this side: the server answers every keep-alive, so hearing nothing from
// it for one window means this node is out of the run (the server, if it is there, drops a
// node silent for as long). Before that, a node in a round probes (see the header).
void SessionMachine::heard(Step& s) {
  last_heard_ = s.now;
  arm_silence(s);
}

// Arms the silence timer for silence_due(), unless it is armed for then or earlier already
// (a timer that fires before it is due is armed again by on_silence).
void SessionMachine::arm_silence(Step& s) {
  const Time due = silence_due();
  if (silence_armed_ && silence_at_ <= due) return;
  silence_armed_ = true;
  silence_at_ = due;
  s.add(ArmTimer{Timer::kSilence, due});
}

Time SessionMachine::silence_due() const {
  return last_heard_ + (can_probe() && !probing_ ? probe_after_ : window_);
}

void SessionMachine::stop_silence(Step& s) {
  silence_armed_ = false;
  s.add(CancelTimer{Timer::kSilence});
}

Actions SessionMachine::on_stream_ready(Time now) {
  Step s(now);
  if (phase_ != Phase::kExiting && !probing_) heard(s);
  return std::move(s.out);
}

Actions SessionMachine::on_timer(Timer timer, Time now) {
  Step s(now);
  switch (timer) {
    case Timer::kKeepAlive:
      if (phase_ == Phase::kExiting) break;
      {
        v1::AgentMsg msg;
        msg.mutable_keep_alive();
        s.add(Send{std::move(msg)});
      }
      s.add(ArmTimer{Timer::kKeepAlive, now + beat_});
      break;
    case Timer::kSilence:
      if (silence_armed_) on_silence(s);
      break;
    case Timer::kProbe:
      if (probing_ && !probe_open_ && !probe_settling_) open_probe(s);
      break;
    case Timer::kInPlace:
      in_place_due(s);
      break;
    case Timer::kPreflight:
      preflight_due(s);
      break;
    case Timer::kCooldown:
      if (cooling_ && phase_ == Phase::kJoining && after_ == After::kNone) {
        cooling_ = false;
        s.log(Level::kInfo, "the straggler cool-down is over: joining the run again");
        send_join(s);
      }
      break;
    case Timer::kReopen: {
      std::optional<Time>* deadline = std::exchange(reopen_deadline_, nullptr);
      if (deadline == nullptr || phase_ == Phase::kExiting || after_ == After::kExit ||
          !*deadline) {
        break;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(**deadline - now);
      open_stream(s, true, std::max(left, std::chrono::milliseconds(1)));
      if (reopen_reattach_) {
        s.add(Send{join_message(true)});
      } else {
        send_join(s);
      }
      break;
    }
  }
  return std::move(s.out);
}

void SessionMachine::on_silence(Step& s) {
  const Time due = silence_due();
  if (s.now < due) {
    silence_armed_ = false;
    arm_silence(s);  // heard from it since: the new end of the wait
    return;
  }
  silence_armed_ = false;
  if (phase_ == Phase::kExiting || after_ == After::kExit || after_ == After::kFail ||
      after_ == After::kReconnect) {
    end_probe(s);
    return;
  }
  if (can_probe() && !probing_) {
    start_probe(s);
    return;
  }
  end_probe(s);
  s.add(CloseStream{});  // give the stream up: whatever the server says now comes too late
  const std::string silence = absl::StrFormat(
      "nothing heard from it for %g s, the run's liveness window", seconds(window_));
  if (reattach_deadline_) {
    // A new stream that stays silent is one more failed attempt; the server holds this
    // node's place meanwhile. (Silence while attached keeps the rule below.)
    reattach(s, silence);
    return;
  }
  if (!reached_ && !rejoin_deadline_) {
    never_reached(s, absl::StrCat("connected, but ", silence));
    return;
  }
  // Not cut off from everyone: a standby answered the probe. Its leader may be what is gone;
  // the standby holds this node's re-attach until it leads.
  if (std::exchange(standby_heard_, false) && can_reattach()) {
    reattach(s, absl::StrCat(silence, "; another replica answered"));
    return;
  }
  lost_server(s, silence);
}

Actions SessionMachine::on_stream_closed(const absl::Status& status, Time now) {
  Step s(now);
  if (phase_ == Phase::kExiting || after_ == After::kExit || after_ == After::kFail) return {};
  // The probe and the window decide: the server may have closed the old stream because a
  // probe took the node's place (ABORTED), or the old connection broke at last.
  if (probing_) {
    if (probe_settling_) old_closed_ = status;
    return {};
  }
  stream_closed(s, status);
  return std::move(s.out);
}

void SessionMachine::stream_closed(Step& s, const absl::Status& status) {
  const Time now = s.now;
  stop_silence(s);
  // A refusal (token, bad config, timeout) carries its own message; a lost connection says
  // which server went away, or that it was never reached.
  const bool lost = status.ok() || status.code() == absl::StatusCode::kUnavailable ||
                    status.code() == absl::StatusCode::kCancelled;
  const std::string why =
      status.ok() ? std::string("it ended the session") : std::string(status.message());
  const bool timed_out = status.code() == absl::StatusCode::kDeadlineExceeded;
  // The server's process gone (its stream broke at once) while this node's workers run in a
  // round of a server that keeps its runs: keep them, reconnect and re-attach.
  if (reattach_deadline_ ? (lost || timed_out) : (lost && reached_ && can_reattach())) {
    reattach(s, why);
  } else if (!reached_ && endpoints_.size() > 1 && first_deadline_ && (lost || timed_out)) {
    if (now < *first_deadline_) {
      // Never reached yet: the next endpoint gets its turn, until the wait is over.
      endpoints_.next();
      reopen_soon(s, &first_deadline_, false);
    } else {
      s.log(Level::kError,
            absl::StrFormat("rendezvous: none of the servers at %s was reachable within %g s",
                            endpoints_.names(), seconds(config_.connect_timeout)));
      exit_with(s, 1);
    }
  } else if (rejoin_deadline_ && (lost || timed_out)) {
    endpoints_.next();  // this attempt failed: the next endpoint (the same one if it is alone)
    lost_server(s, why);  // tries again until the deadline, then says it could not
  } else if (lost && reached_) {
    lost_server(s, why);
  } else if (lost) {
    never_reached(s, why);
  } else {
    s.log(Level::kError, absl::StrCat("rendezvous: ", status.message()));
    exit_with(s, 1);
  }
}

void SessionMachine::never_reached(Step& s, const std::string& why) {
  s.log(Level::kError, absl::StrFormat("rendezvous: never reached the server at %s (%s)",
                                       endpoints_.names(), why));
  exit_with(s, 1);
}

// This node is out of its run (its stream ended, or the server went silent for the window):
// its workers stop at once; then it reconnects and joins the run again, if the run still
// wants it, for up to connect_timeout. Once its workers succeeded there is nothing to rejoin
// for: it exits 1, as the run's end was never confirmed.
void SessionMachine::lost_server(Step& s, const std::string& why) {
  const double secs = seconds(config_.connect_timeout);
  if (phase_ == Phase::kAwaitingDone) {
    s.log(Level::kError,
          absl::StrFormat("rendezvous: lost the server at %s (%s) before the run's end was "
                          "confirmed",
                          endpoints_.names(), why));
    exit_with(s, 1);
    return;
  }
  if (!rejoin_deadline_) {
    rejoin_deadline_ = s.now + config_.connect_timeout;
    s.log(Level::kError,
          absl::StrFormat("rendezvous: lost the server at %s (%s); stopping workers, then "
                          "joining again (for up to %g s)",
                          endpoints_.names(), why, secs));
  } else if (s.now >= *rejoin_deadline_) {
    s.log(Level::kError,
          absl::StrFormat("rendezvous: lost the server at %s and could not reach it again "
                          "within %g s (%s)",
                          endpoints_.names(), secs, why));
    exit_with(s, 1);
    return;
  }
  noticed(s, "lost_server");
  AgentEvent e = event(AgentEvent::Kind::kLostServer, s.now);
  e.reason = why;
  s.add(Emit{std::move(e)});
  after_ = After::kReconnect;
  stop(s, SIGTERM);
}

// --- messages -----------------------------------------------------------------------------

Actions SessionMachine::on_message(const v1::ServerMsg& m, Time now) {
  Step s(now);
  if (phase_ == Phase::kExiting) return {};
  // The stream was only slow: the probe ends, but an attempt open now is let finish.
  if (probing_ && probe_open_) {
    settle_probe(s);
  } else {
    end_probe(s);
  }
  handle(s, m);
  return std::move(s.out);
}

// A message of the current stream.
void SessionMachine::handle(Step& s, const v1::ServerMsg& m) {
  const Time now = s.now;
  reached_ = true;
  rejoin_deadline_.reset();
  heard(s);
  if (m.has_attached()) {
    on_attached(s, m.attached());
  } else if (m.has_assignment()) {
    if (phase_ == Phase::kJoining) on_assignment(s, m.assignment());
    if (phase_ == Phase::kReforming) on_reform(s, m.assignment());
  } else if (m.has_restart() && m.restart().excluded_ms() > 0) {
    excluded(s, m.restart());
  } else if (m.has_restart()) {
    const bool keep = (phase_ == Phase::kRunning || phase_ == Phase::kRecovering) &&
                      after_ == After::kNone && in_place_ready();
    s.log(Level::kWarn, absl::StrCat(keep ? "recovering in place: " : "restarting workers: ",
                                     m.restart().reason()));
    noticed(s, "restart");
    AgentEvent e = event(AgentEvent::Kind::kRestart, now);
    e.reason = m.restart().reason();
    e.restart_count = m.restart().restart_count();
    s.add(Emit{std::move(e)});
    if (keep) {
      lost_ranks_.insert(lost_ranks_.end(), m.restart().lost_ranks().begin(),
                         m.restart().lost_ranks().end());
      if (recover_in_place(s, "restart")) return;
    }
    if (after_ != After::kExit) after_ = After::kRejoin;
    stop(s, SIGTERM);
  } else if (m.has_fail()) {
    fail_ = m.fail();
    if (after_ != After::kExit) after_ = After::kFail;
    stop(s, SIGTERM);
  } else if (m.has_done()) {
    if (cooling_ && phase_ == Phase::kJoining) {
      // The run finished without this node: nothing of it is left to do.
      s.log(Level::kInfo, "the run finished while this node was excluded as a straggler");
      cooling_ = false;
      s.add(CancelTimer{Timer::kCooldown});
      finish(s, 0);
    } else if (phase_ == Phase::kAwaitingDone) {
      s.add(Emit{event(AgentEvent::Kind::kSucceeded, now)});
      finish(s, 0);
    }
  } else if (m.has_stalled()) {
    if (phase_ == Phase::kRunning && m.stalled().round() == assignment_.round()) {
      s.add(DumpStalled{m.stalled().rank(), m.stalled().description()});
    }
  }
}

// The round `a` formed for this node: it runs from now on (the caller starts or re-forms
// its workers).
void SessionMachine::enter_round(Step& s, const v1::Assignment& a) {
  attached_ = true;
  assignment_ = a;
  // The next keep-alive is armed already; those after it go at the round's rate.
  beat_ = beat_for(config_.keep_alive_interval, a.group_world_size());
  AgentEvent e = event(AgentEvent::Kind::kRoundFormed, s.now);
  e.world_size = a.world_size();
  if (recovery_) recovery_->formed = s.now;
  s.add(Emit{std::move(e)});
  phase_ = Phase::kRunning;
  after_ = After::kNone;
  failure_reported_ = false;
  last_report_.reset();
  stopped_emitted_ = false;
}

void SessionMachine::on_assignment(Step& s, const v1::Assignment& a) {
  enter_round(s, a);
  reset_in_place();  // new processes: each declares for itself
  in_place_off_ = false;
  start_workers(s);
  arm_silence(s);  // a round can be probed for: maybe sooner than the armed window
}

Actions SessionMachine::on_workers_started(int workers, Time now) {
  Step s(now);
  const v1::Assignment& a = assignment_;
  AgentEvent e = event(AgentEvent::Kind::kWorkersStarted, now);
  e.world_size = a.world_size();
  e.workers = workers;
  if (recovery_) {
    recovery_->started = now;
    // Stopped before the round formed, unless nothing was running to stop.
    if (recovery_->stopped.time_since_epoch().count() == 0) recovery_->stopped = recovery_->formed;
    e.recovery = std::move(recovery_);
    recovery_.reset();
  }
  s.add(Emit{std::move(e)});
  s.log(Level::kInfo,
        absl::StrFormat("round %d: group rank %d/%d, ranks %d..%d of %d, restart %d", a.round(),
                        a.group_rank(), a.group_world_size(), a.rank_offset(),
                        a.rank_offset() + config_.nproc_per_node - 1, a.world_size(),
                        a.restart_count()));
  return std::move(s.out);
}

// --- re-attach (docs/rendezvous.md, "Restarting the server without restarting workers") ----

// Whether this node may keep its workers through the loss of its stream: it is in a round of
// a server that keeps its runs, and the round is not over for it yet (its workers run, or
// they succeeded or failed and it waits for the server's word).
bool SessionMachine::can_reattach() const {
  if (assignment_.round() == 0 || assignment_.reattach_timeout_ms() <= 0) return false;
  return phase_ == Phase::kRunning || phase_ == Phase::kAwaitingDone ||
         (phase_ == Phase::kStopping && after_ == After::kNone);
}

// One attempt to re-attach (the first after the loss, or the next after a failed one): a new
// stream to the current endpoint (the next one after a failure) and a Join asking for this
// node's place back. The workers go on. When the run's re-attach window is over, the node is
// out as before: it stops its workers and joins again.
void SessionMachine::reattach(Step& s, const std::string& why) {
  const auto window = std::chrono::milliseconds(assignment_.reattach_timeout_ms());
  if (!reattach_deadline_) {
    reattach_deadline_ = s.now + window;
    reattach_since_ = s.now;
    s.log(Level::kWarn,
          absl::StrFormat("rendezvous: lost the stream to the server at %s (%s); the workers "
                          "keep running while this node re-attaches to run %s (for up to %g s)",
                          endpoints_.current().name, why, config_.run_id, seconds(window)));
    AgentEvent e = event(AgentEvent::Kind::kLostServer, s.now);
    e.reason = absl::StrCat("re-attaching: ", why);
    s.add(Emit{std::move(e)});
    // With several endpoints the one whose stream just ended is the least likely to serve
    // next (replicas: the leader died; a standby takes over): the next one first.
    endpoints_.next();
  } else if (s.now >= *reattach_deadline_) {
    reattach_deadline_.reset();
    attached_ = true;
    s.log(Level::kError, absl::StrFormat("rendezvous: could not re-attach to run %s within %g s (%s)",
                                         config_.run_id, seconds(window), why));
    lost_server(s, why);
    return;
  } else {
    endpoints_.next();
  }
  attached_ = false;
  reopen_soon(s, &reattach_deadline_, true);
}

void SessionMachine::on_attached(Step& s, const v1::Attached& a) {
  if (!reattach_deadline_ || a.round() != assignment_.round()) return;  // not asked for
  reattach_deadline_.reset();
  attached_ = true;
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(s.now - reattach_since_);
  if (a.ok()) {
    // At warning level, as the loss was: the default log shows both or neither.
    s.log(Level::kWarn,
          absl::StrFormat("rendezvous: re-attached to run %s round %d at %s after %d ms; the "
                          "workers kept running",
                          config_.run_id, a.round(), endpoints_.current().name, took.count()));
    AgentEvent e = event(AgentEvent::Kind::kReattached, s.now);
    e.reason = endpoints_.current().name;
    e.took = took;
    s.add(Emit{std::move(e)});
    // What this node last reported may have died with the old stream or the old server.
    if (last_report_) s.add(Send{*last_report_});
    arm_silence(s);
    return;
  }
  if (phase_ == Phase::kAwaitingDone) {
    s.log(Level::kError,
          absl::StrFormat("rendezvous: could not re-attach to run %s (%s) before the run's end "
                          "was confirmed",
                          config_.run_id, a.reason()));
    exit_with(s, 1);
    return;
  }
  s.log(Level::kWarn, absl::StrFormat("rendezvous: could not re-attach to run %s (%s); stopping "
                                      "workers and joining again",
                                      config_.run_id, a.reason()));
  noticed(s, "lost_server");
  if (after_ != After::kExit) after_ = After::kRejoin;
  stop(s, SIGTERM);
}

// --- the workers --------------------------------------------------------------------------

// A failure or success report of this round: kept, to be sent again after a re-attach, and
// sent now unless the node is between streams.
void SessionMachine::send_report(Step& s, const v1::AgentMsg& msg) {
  last_report_ = msg;
  if (attached_) s.add(Send{msg});
}

void SessionMachine::report_failure(Step& s, const v1::WorkerFailure& f, bool in_place_fallback) {
  if (failure_reported_) return;
  failure_reported_ = true;
  v1::AgentMsg msg;
  msg.mutable_failure()->set_round(assignment_.round());
  msg.mutable_failure()->set_in_place_fallback(in_place_fallback);
  *msg.mutable_failure()->mutable_root_cause() = f;
  send_report(s, msg);
}

Actions SessionMachine::on_spawn_failed(const v1::WorkerFailure& failure, Time now) {
  Step s(now);
  if (phase_ != Phase::kRunning) return {};
  report_failure(s, failure);
  stop(s, SIGTERM);
  return std::move(s.out);
}

Actions SessionMachine::on_worker_failed(const v1::WorkerFailure& f, Time now) {
  Step s(now);
  const bool in_place_phase = phase_ == Phase::kRecovering || phase_ == Phase::kReforming;
  if (phase_ != Phase::kRunning && !in_place_phase) return {};
  if (f.local_rank() >= 0 && f.local_rank() < static_cast<int>(dead_.size())) {
    dead_[f.local_rank()] = true;
  }
  s.log(Level::kWarn,
        absl::StrFormat("worker rank %d (local rank %d, pid %d) failed: %s", f.rank(),
                        f.local_rank(), f.pid(),
                        f.signal() > 0 ? signal_name(f.signal())
                                       : absl::StrCat("exit code ", f.exit_code())));
  noticed(s, "worker_failure");
  AgentEvent e = event(AgentEvent::Kind::kWorkerFailed, now);
  e.rank = f.rank();
  e.local_rank = f.local_rank();
  e.pid = f.pid();
  e.exit_code = f.exit_code();
  e.signal = f.signal();
  e.reason = f.message();
  s.add(Emit{std::move(e)});
  // In place, a failure during a recovery is one more worker to replace in the next round.
  if (in_place_phase) return std::move(s.out);
  report_failure(s, f);
  if (recover_in_place(s, "worker_failure")) return std::move(s.out);
  stop(s, SIGTERM);
  return std::move(s.out);
}

Actions SessionMachine::on_hang_dumped(const v1::WorkerFailure& failure, Time now) {
  Step s(now);
  if (phase_ == Phase::kExiting) return {};
  if (phase_ == Phase::kRunning) report_failure(s, failure);
  stop(s, SIGTERM);
  return std::move(s.out);
}

Actions SessionMachine::on_progress(v1::AgentMsg msg, Time now) {
  if (phase_ != Phase::kRunning || !attached_) return {};
  msg.mutable_progress()->set_round(assignment_.round());
  Actions out;
  out.emplace_back(Send{std::move(msg)});
  return out;
}

// Stops the workers; what follows once they are gone is after_'s.
void SessionMachine::stop(Step& s, int sig) {
  if (phase_ == Phase::kJoining) {
    phase_ = Phase::kStopping;  // nothing runs: straight on
    after_group_gone(s, 0);
    return;
  }
  if (phase_ == Phase::kExiting) return;
  phase_ = Phase::kStopping;
  s.add(StopWorkers{sig});
}

// Stops the workers, then exits with `code`.
void SessionMachine::exit_with(Step& s, int code) {
  exit_code_ = code;
  after_ = After::kExit;
  stop(s, SIGTERM);
}

Actions SessionMachine::on_group_gone(int workers, Time now) {
  Step s(now);
  if (phase_ == Phase::kRunning) {
    phase_ = Phase::kAwaitingDone;
    v1::AgentMsg msg;
    msg.mutable_success()->set_round(assignment_.round());
    send_report(s, msg);
  } else if (phase_ == Phase::kStopping) {
    after_group_gone(s, workers);
  }
  return std::move(s.out);
}

// The stopping group has fully exited: what after_ says.
void SessionMachine::after_group_gone(Step& s, int workers) {
  if (!stopped_emitted_) {
    stopped_emitted_ = true;
    if (recovery_) recovery_->stopped = s.now;
    AgentEvent e = event(AgentEvent::Kind::kWorkersStopped, s.now);
    e.workers = workers;
    s.add(Emit{std::move(e)});
  }
  switch (after_) {
    case After::kNone:
      return;  // the server decides: Restart or Fail
    case After::kRejoin:
      s.add(ReleaseWorkers{});
      send_join(s);
      return;
    case After::kReconnect:
      s.add(ReleaseWorkers{});
      after_ = After::kNone;
      reopen_soon(s, &rejoin_deadline_, false);
      return;
    case After::kFail: {
      AgentEvent e = event(AgentEvent::Kind::kFailed, s.now);
      e.reason = fail_.reason();
      e.rank = fail_.root_cause().rank();
      e.exit_code = fail_.root_cause().exit_code();
      e.signal = fail_.root_cause().signal();
      s.add(Emit{std::move(e)});
      s.add(PrintFailure{fail_});
      if (fail_.do_not_requeue()) {
        s.log(Level::kError, absl::StrFormat("%s; exit code %d (do not requeue)", fail_.reason(),
                                             kExitDoNotRequeue));
      }
      finish(s, fail_.do_not_requeue() ? kExitDoNotRequeue : 1);
      return;
    }
    case After::kExit:
      finish(s, exit_code_);
      return;
    case After::kCooldown:
      s.add(ReleaseWorkers{});
      after_ = After::kNone;
      phase_ = Phase::kJoining;
      cooling_ = true;
      s.add(ArmTimer{Timer::kCooldown, s.now + cooldown_});
      return;
  }
}

// The server excluded this node as a straggler (docs/stragglers.md, "Exclusion"): its
// workers stop (the others re-form without them), and it joins again after `r.excluded_ms`.
void SessionMachine::excluded(Step& s, const v1::Restart& r) {
  s.log(Level::kWarn, absl::StrFormat("%s; this node stops its workers and joins again in %g s",
                                      r.reason(), r.excluded_ms() / 1000.0));
  AgentEvent e = event(AgentEvent::Kind::kRestart, s.now);
  e.reason = r.reason();
  e.restart_count = r.restart_count();
  s.add(Emit{std::move(e)});
  if (after_ == After::kExit || after_ == After::kFail) return;  // leaving anyway
  s.add(CancelTimer{Timer::kInPlace});
  reset_in_place();
  cooldown_ = std::chrono::milliseconds(r.excluded_ms());
  after_ = After::kCooldown;
  stop(s, SIGTERM);
}

void SessionMachine::finish(Step& s, int code) {
  exit_code_ = code;
  end_probe(s);
  phase_ = Phase::kExiting;
  silence_armed_ = false;
  s.add(CancelTimer{Timer::kKeepAlive});
  s.add(CancelTimer{Timer::kSilence});
  s.add(CancelTimer{Timer::kReopen});
  s.add(CancelTimer{Timer::kProbe});
  s.add(Exit{code, after_ == After::kExit ? signal_ : 0});
}

// --- signals ------------------------------------------------------------------------------

Actions SessionMachine::on_signal(int sig, Time now) {
  Step s(now);
  if (phase_ == Phase::kExiting) return {};
  if (signal_ != 0) {  // a second signal: no more grace
    s.add(KillWorkers{});
    return std::move(s.out);
  }
  signal_ = sig;
  exit_code_ = 128 + sig;
  s.log(Level::kWarn, absl::StrCat("received ", signal_name(sig), "; stopping workers"));
  after_ = After::kExit;
  s.add(CloseStream{});  // leave the run (or the wait for the server) at once
  end_probe(s);
  stop_silence(s);
  stop(s, sig);
  return std::move(s.out);
}

}  // namespace muster::agent::session
