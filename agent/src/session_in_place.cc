// SessionMachine: in-place recovery (session_machine.h, "In-place recovery"; docs/in_place.md).
// The survivors of a failure keep running; the node rejoins at once, tells them the new world
// and replaces only its dead workers; a round that does not report resumed in time falls
// back to the full restart.
#include <algorithm>
#include <csignal>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "muster/agent/session_machine.h"
#include "session_step.h"

namespace muster::agent::session {

// Every worker of the node either declared support or is dead (to be replaced), and the
// program is known to support it: a node whose workers never said so restarts in full.
bool SessionMachine::in_place_ready() const {
  if (!config_.in_place || in_place_off_ || !supports_) return false;
  for (std::size_t lr = 0; lr < declared_.size(); ++lr) {
    if (!declared_[lr] && !dead_[lr] && !fresh_[lr]) return false;
  }
  return true;
}

void SessionMachine::reset_in_place() {
  const std::size_t n = static_cast<std::size_t>(std::max(config_.nproc_per_node, 0));
  declared_.assign(n, false);
  dead_.assign(n, false);
  resumed_.assign(n, false);
  fresh_.assign(n, false);
  reform_pending_ = false;
}

// The round is over and this node can keep its survivors: they abort their collectives now.
// `cause` "worker_failure": one of ours failed (reported already); the server's Restart
// follows. "restart": that Restart came; the node joins the next round at once.
bool SessionMachine::recover_in_place(Step& s, const char* cause) {
  if (!in_place_ready()) return false;
  if (reform_pending_) {
    reform_pending_ = false;  // a failure while re-forming: this recovery starts over
    s.add(CancelTimer{Timer::kInPlace});
    recovery_.reset();
  }
  if (!recovery_) {
    recovery_.emplace();
    recovery_->cause = cause;
    recovery_->noticed = s.now;
  }
  if (!recovery_->in_place) {
    recovery_->in_place = true;
    recovery_->stopped = s.now;  // aborted: the message goes out now
  }
  s.add(AbortWorkers{0});
  if (std::string(cause) == "worker_failure") {
    phase_ = Phase::kRecovering;
    return true;
  }
  phase_ = Phase::kReforming;
  s.add(Send{join_message(false, true)});  // the server counts this node as in place
  return true;
}

void SessionMachine::on_reform(Step& s, const v1::Assignment& a) {
  enter_round(s, a);
  std::vector<int> replace;
  for (std::size_t lr = 0; lr < dead_.size(); ++lr) {
    // A replacement still starting (not declared yet) is replaced too: it holds no state.
    const bool starting = !dead_[lr] && fresh_[lr];
    if (starting) replace.push_back(static_cast<int>(lr));
    if (dead_[lr] || starting) {
      declared_[lr] = false;  // a new process: it declares for itself
      fresh_[lr] = true;
    }
  }
  dead_.assign(dead_.size(), false);
  resumed_.assign(resumed_.size(), false);
  reform_pending_ = true;
  std::sort(lost_ranks_.begin(), lost_ranks_.end());
  lost_ranks_.erase(std::unique(lost_ranks_.begin(), lost_ranks_.end()), lost_ranks_.end());
  s.add(ReformWorkers{a, std::exchange(lost_ranks_, {}), std::move(replace)});
  reform_due_ = s.now + config_.in_place_timeout;
  s.add(ArmTimer{Timer::kInPlace, reform_due_});
  arm_silence(s);
}

Actions SessionMachine::on_workers_reformed(int replaced, Time now) {
  Step s(now);
  const v1::Assignment& a = assignment_;
  s.log(Level::kInfo,
        absl::StrFormat("round %d: re-formed in place: group rank %d/%d, ranks %d..%d of %d, "
                        "restart %d, %d worker(s) replaced",
                        a.round(), a.group_rank(), a.group_world_size(), a.rank_offset(),
                        a.rank_offset() + config_.nproc_per_node - 1, a.world_size(),
                        a.restart_count(), replaced));
  return std::move(s.out);
}

Actions SessionMachine::on_worker_declared(int local_rank, Time now) {
  if (local_rank < 0 || local_rank >= static_cast<int>(declared_.size())) return {};
  declared_[local_rank] = true;
  fresh_[local_rank] = false;
  supports_ = true;
  (void)now;
  return {};
}

Actions SessionMachine::on_worker_resumed(int local_rank, int round, Time now) {
  Step s(now);
  if (!reform_pending_ || phase_ != Phase::kRunning || local_rank < 0 ||
      local_rank >= static_cast<int>(resumed_.size())) {
    return {};
  }
  // An answer for an earlier round is late, not wrong: a worker that finished its first step
  // of that round as this re-form's abort was on its way answered for it (its check and its
  // send are not one step with the agent's abort). It answers for this round once it has
  // re-formed; the in-place timer bounds that wait.
  if (round < assignment_.round()) return {};
  if (round != assignment_.round()) {
    fall_back(s, absl::StrFormat("local rank %d reported resumed for round %d, not round %d",
                                 local_rank, round, assignment_.round()));
    return std::move(s.out);
  }
  resumed_[local_rank] = true;
  if (std::find(resumed_.begin(), resumed_.end(), false) != resumed_.end()) return {};
  reform_pending_ = false;
  s.add(CancelTimer{Timer::kInPlace});
  AgentEvent e = event(AgentEvent::Kind::kInPlaceResumed, now);
  e.world_size = assignment_.world_size();
  e.workers = static_cast<int>(resumed_.size());
  // The server's view of the recovery (its status and live page): this node is back, with
  // its phases. Not a report kept for a re-attach: a restored server knows no recovery.
  v1::AgentMsg msg;
  v1::ReportResumed* r = msg.mutable_resumed();
  r->set_round(assignment_.round());
  r->set_workers(e.workers);
  if (recovery_) {
    auto ms = [](Time::duration d) {
      return std::max<std::int64_t>(
          0, std::chrono::duration_cast<std::chrono::milliseconds>(d).count());
    };
    r->set_abort_ms(ms(recovery_->stopped - recovery_->noticed));
    r->set_rendezvous_ms(ms(recovery_->formed - recovery_->stopped));
    r->set_reform_ms(ms(now - recovery_->formed));
  }
  if (attached_) s.add(Send{std::move(msg)});
  if (recovery_) {
    recovery_->started = now;
    s.log(Level::kInfo,
          absl::StrFormat("round %d: in-place recovery done in %d ms (noticed -> every worker "
                          "of this node stepped again)",
                          assignment_.round(),
                          std::chrono::duration_cast<std::chrono::milliseconds>(
                              now - recovery_->noticed)
                              .count()));
    e.recovery = std::move(recovery_);
    recovery_.reset();
  }
  s.add(Emit{std::move(e)});
  return std::move(s.out);
}

// The in-place round did not come back in time: this node's restart is the full one. Its
// failure report makes the server restart the run (counted); this node stops its workers.
void SessionMachine::fall_back(Step& s, const std::string& why) {
  reform_pending_ = false;
  in_place_off_ = true;
  s.add(CancelTimer{Timer::kInPlace});
  const std::string reason =
      absl::StrCat("in-place recovery of round ", assignment_.round(), " failed: ", why,
                   "; falling back to a full restart");
  s.log(Level::kWarn, reason);
  AgentEvent e = event(AgentEvent::Kind::kInPlaceFallback, s.now);
  e.reason = reason;
  s.add(Emit{std::move(e)});
  recovery_.reset();
  noticed(s, "worker_failure");
  v1::WorkerFailure f;
  int lr = 0;
  while (lr + 1 < static_cast<int>(resumed_.size()) && resumed_[lr]) ++lr;
  f.set_rank(assignment_.rank_offset() + lr);
  f.set_local_rank(lr);
  f.set_group_rank(assignment_.group_rank());
  f.set_exit_code(1);
  f.set_message(reason);
  report_failure(s, f, true);
  stop(s, SIGTERM);
}

// Timer::kInPlace: the wait for `resumed` is over.
void SessionMachine::in_place_due(Step& s) {
  if (!reform_pending_ || phase_ != Phase::kRunning || s.now < reform_due_) return;
  std::vector<int> missing;
  for (std::size_t lr = 0; lr < resumed_.size(); ++lr) {
    if (!resumed_[lr]) missing.push_back(static_cast<int>(lr));
  }
  fall_back(s, absl::StrFormat("local rank(s) %s did not report resumed within %g s",
                               absl::StrJoin(missing, ","), seconds(config_.in_place_timeout)));
}

}  // namespace muster::agent::session
