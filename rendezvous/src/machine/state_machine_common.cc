// What the state machine's files share (state_machine_internal.h): replies, the saturating
// time arithmetic and the one rule for client durations, the checks of a Join, text cuts.
#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "machine/state_machine_internal.h"

namespace muster::rendezvous {
namespace internal {

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
  if (!ops::is_valid_utf8(s)) {
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

RendezvousTimeouts run_timing(const RendezvousTimeouts& defaults, const TimingRequest& a,
                              TimingSource source) {
  const bool record = source == TimingSource::kRecord;
  auto bounded = [record](std::int64_t ms, milliseconds fallback, milliseconds max) {
    return client_duration(ms, fallback, record ? std::max(max, fallback) : max);
  };
  RendezvousTimeouts t = defaults;
  t.join_timeout = bounded(a.join_timeout_ms, t.join_timeout, limits::kMaxJoinTimeout);
  t.last_call_timeout =
      bounded(a.last_call_timeout_ms, t.last_call_timeout, limits::kMaxLastCallTimeout);
  t.keep_alive_interval =
      bounded(a.keep_alive_interval_ms, t.keep_alive_interval, limits::kMaxKeepAliveInterval);
  t.hang_timeout = bounded(a.hang_timeout_ms, t.hang_timeout, limits::kMaxHangTimeout);
  t.reattach_timeout = bounded(a.reattach_timeout_ms, t.reattach_timeout, limits::kMaxReattachTimeout);
  if (record) {
    t.finished_run_grace =
        bounded(a.finished_run_grace_ms, t.finished_run_grace, limits::kMaxFinishedRunGrace);
  }
  if (a.keep_alive_max_attempt > 0) {
    const int cap = record ? std::max(limits::kMaxKeepAliveAttempts, defaults.keep_alive_max_attempt)
                           : limits::kMaxKeepAliveAttempts;
    t.keep_alive_max_attempt = std::min(a.keep_alive_max_attempt, cap);
  }
  // A window a Join set (interval x attempts) within its bound: fewer attempts, at least one.
  // The operator's defaults are theirs.
  const bool client_window = a.keep_alive_interval_ms > 0 || a.keep_alive_max_attempt > 0;
  if (!record && client_window &&
      times(t.keep_alive_interval, t.keep_alive_max_attempt) > limits::kMaxLivenessWindow) {
    t.keep_alive_max_attempt = static_cast<int>(
        std::max<std::int64_t>(1, limits::kMaxLivenessWindow / t.keep_alive_interval));
  }
  return t;
}

}  // namespace internal

using namespace internal;

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
    case RunEvent::Kind::kInPlaceResumed: return "in_place_resumed";
    case RunEvent::Kind::kInPlaceFallback: return "in_place_fallback";
    case RunEvent::Kind::kStragglerNamed: return "straggler_named";
    case RunEvent::Kind::kStragglerCleared: return "straggler_cleared";
    case RunEvent::Kind::kStragglerExcluded: return "straggler_excluded";
  }
  return "unknown";
}

}  // namespace muster::rendezvous
