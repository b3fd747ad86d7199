// The probe (session_machine.h, "The probe"): fresh connections, one endpoint after the other,
// that ask for this node's place back while its workers run and its old stream stays open.
#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"
#include "muster/agent/session_machine.h"
#include "session_step.h"

namespace muster::agent::session {

bool SessionMachine::can_probe() const {
  if (probe_after_ >= window_ || !attached_ || reattach_deadline_ || rejoin_deadline_ ||
      assignment_.round() == 0) {
    return false;
  }
  return phase_ == Phase::kRunning || phase_ == Phase::kAwaitingDone ||
         (phase_ == Phase::kStopping && after_ == After::kNone);
}

void SessionMachine::start_probe(Step& s) {
  probing_ = true;
  probe_k_ = 0;
  probe_open_ = false;
  standby_heard_ = false;
  probe_since_ = s.now;
  s.log(Level::kWarn,
        absl::StrFormat("rendezvous: nothing heard from the server at %s for %g s; probing on "
                        "new connections while the workers keep running (out after %g s of "
                        "silence)",
                        endpoints_.current().name, seconds(s.now - last_heard_), seconds(window_)));
  arm_silence(s);  // the window's end
  open_probe(s);
}

// One attempt: a fresh connection to the next endpoint, for at most a tenth of a keep-alive
// interval (a blip's end is met by a new connection, a new SYN, within that, not by TCP's
// back-off), a re-attach Join and a keep-alive on it.
void SessionMachine::open_probe(Step& s) {
  const Time end = last_heard_ + window_;
  if (s.now >= end) return;  // the window's end decides
  OpenProbe p;
  p.endpoint = endpoints_.after(probe_k_);
  p.connect_timeout =
      std::min(std::chrono::duration_cast<std::chrono::milliseconds>(end - s.now),
               std::max(config_.keep_alive_interval / kProbeAttemptsPerInterval,
                        kMinProbeAttempt));
  p.msgs.push_back(join_message(true));
  p.msgs.emplace_back().mutable_keep_alive();
  probe_open_ = true;
  s.add(std::move(p));
}

void SessionMachine::end_probe(Step& s) {
  if (!probing_) return;
  probing_ = false;
  probe_settling_ = false;
  old_closed_.reset();
  if (std::exchange(probe_open_, false)) s.add(CloseProbe{});
  s.add(CancelTimer{Timer::kProbe});
}

// The old stream was heard while an attempt is open (session_machine.h, "The probe"): no new
// attempt; the open one is let finish, for at most one interval from the first word heard.
void SessionMachine::settle_probe(Step& s) {
  if (!probe_settling_) {
    probe_settling_ = true;
    settle_since_ = s.now;
    s.add(CancelTimer{Timer::kProbe});
    return;
  }
  if (s.now - settle_since_ >= config_.keep_alive_interval) end_probe(s);
}

// A let-finish attempt did not move the node: the old stream decides, as if there had been no
// probe (its end, if the server closed it meanwhile, is handled now).
void SessionMachine::end_settled_probe(Step& s) {
  std::optional<absl::Status> old = std::exchange(old_closed_, std::nullopt);
  end_probe(s);
  if (old) stream_closed(s, *old);
}

// The probe's server holds this node's round (it answered the re-attach): it is the stream
// now, and the answer is handled as any re-attach's.
void SessionMachine::adopt_probe(Step& s) {
  probe_settling_ = false;
  old_closed_.reset();
  s.add(AdoptProbe{});
  for (std::size_t k = 0; k < probe_k_ % endpoints_.size(); ++k) endpoints_.next();
  probing_ = false;
  probe_open_ = false;
  standby_heard_ = false;
  s.add(CancelTimer{Timer::kProbe});
  attached_ = false;
  reattach_deadline_ = last_heard_ + window_;
  reattach_since_ = probe_since_;
}

Actions SessionMachine::on_probe_message(const v1::ServerMsg& m, Time now) {
  Step s(now);
  if (!probing_ || !probe_open_ || phase_ == Phase::kExiting) return {};
  if (m.has_attached() && m.attached().round() == assignment_.round()) {
    adopt_probe(s);
    handle(s, m);
  } else if (m.has_keep_alive()) {
    if (probe_settling_) {
      end_settled_probe(s);  // not moved there: the old stream decides
      return std::move(s.out);
    }
    // Answered without Attached: a standby holds the Join. The others get their turn.
    standby_heard_ = true;
    s.add(CloseProbe{});
    probe_open_ = false;
    ++probe_k_;
    s.add(ArmTimer{Timer::kProbe, now});
  }
  return std::move(s.out);
}

Actions SessionMachine::on_probe_closed(const absl::Status& status, Time now) {
  Step s(now);
  if (!probing_ || !probe_open_) return {};
  probe_open_ = false;
  s.log(Level::kDebug, absl::StrFormat("rendezvous: probe of %s: %s",
                                       endpoints_.after(probe_k_).name, status.message()));
  if (probe_settling_) {
    end_settled_probe(s);  // the attempt that might have moved the node did not
    return std::move(s.out);
  }
  ++probe_k_;
  s.add(ArmTimer{Timer::kProbe, now});  // the next endpoint, on the loop's next turn
  return std::move(s.out);
}

}  // namespace muster::agent::session
