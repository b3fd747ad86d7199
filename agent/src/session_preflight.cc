// SessionMachine: the pre-flight (session_machine.h, on_preflight_done; docs/stragglers.md,
// "Pre-flight"). With --preflight, the first round's workers of a run of several nodes start
// only once this node has measured its compute and its links to the others (RunPreflight,
// carried out by agent.cc on a thread through the run's store): a node it names leaves, the
// others wait for the round without it.
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "muster/agent/session_machine.h"
#include "session_step.h"

namespace muster::agent::session {

// The round's workers start, or first the pre-flight: once a run, for its first round, when
// the round has other nodes to measure.
void SessionMachine::start_workers(Step& s) {
  if (config_.preflight && !preflight_started_ && assignment_.round() == 1 &&
      assignment_.group_world_size() > 1) {
    preflight_started_ = true;
    s.add(RunPreflight{assignment_});
    return;
  }
  s.add(StartWorkers{assignment_});
}

Actions SessionMachine::on_preflight_done(int round, const PreflightVerdict& v, Time now) {
  Step s(now);
  if (phase_ != Phase::kRunning || after_ != After::kNone || assignment_.round() != round) {
    return {};  // the round is over already: the machine has moved on
  }
  if (!v.ran) {
    s.log(Level::kWarn, absl::StrCat("pre-flight could not run (", v.error, "); the workers start"));
    s.add(StartWorkers{assignment_});
  } else if (!v.named_me.empty()) {
    s.log(Level::kError, v.named_me);
    exit_with(s, 1);
  } else if (v.named_others.empty()) {
    s.add(StartWorkers{assignment_});
  } else {
    s.log(Level::kWarn, absl::StrCat("pre-flight: ", absl::StrJoin(v.named_others, ", "),
                                     " leaves the run; waiting for the round without it"));
    preflight_waiting_ = true;
    preflight_round_ = round;
    s.add(ArmTimer{Timer::kPreflight, now + config_.preflight_wait});
  }
  return std::move(s.out);
}

// The named node did not leave within preflight_wait: this node's workers start anyway.
void SessionMachine::preflight_due(Step& s) {
  if (!preflight_waiting_) return;
  preflight_waiting_ = false;
  if (phase_ != Phase::kRunning || after_ != After::kNone ||
      assignment_.round() != preflight_round_) {
    return;
  }
  s.log(Level::kWarn, "pre-flight: the named node did not leave; the workers start");
  s.add(StartWorkers{assignment_});
}

}  // namespace muster::agent::session
