#include "muster/launcher/event_log.h"

#include "muster/ops/json.h"
#include "muster/status/status_format.h"

namespace muster::launcher {
namespace {

using agent::AgentEvent;

long long ms_between(std::chrono::steady_clock::time_point a,
                     std::chrono::steady_clock::time_point b) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(b - a).count();
}

}  // namespace

std::string event_log_line(const AgentEvent& e, const EventLogSource& source) {
  using Kind = AgentEvent::Kind;
  ops::JsonObject j;
  j.add("event", agent::event_name(e.kind));
  j.add("time", muster::status::iso8601_ms(e.wall));
  j.add("unix_ms", static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                              e.wall.time_since_epoch())
                                              .count()));
  j.add("source", "agent");
  j.add("run", source.run_id);
  j.add("node", source.node_id);
  j.add("host", source.host);
  j.add("round", e.round);
  j.add("restart_count", e.restart_count);
  if (e.group_rank >= 0) j.add("group_rank", e.group_rank);
  switch (e.kind) {
    case Kind::kRoundFormed:
      j.add("world_size", e.world_size);
      break;
    case Kind::kWorkersStarted:
    case Kind::kWorkersStopped:
    case Kind::kInPlaceResumed:
      j.add("workers", e.workers);
      break;
    case Kind::kWorkerFailed:
      j.add("rank", e.rank);
      j.add("local_rank", e.local_rank);
      j.add("pid", e.pid);
      if (e.signal > 0) {
        j.add("signal", e.signal);
      } else {
        j.add("exit_code", e.exit_code);
      }
      break;
    case Kind::kFailed:
      if (e.rank >= 0) j.add("rank", e.rank);
      break;
    case Kind::kReattached:
      j.add("took_ms", static_cast<long long>(e.took.count()));
      break;
    default:
      break;
  }
  if (!e.reason.empty()) j.add("reason", e.reason);
  if (e.recovery) {
    const agent::Recovery& r = *e.recovery;
    ops::JsonObject rec;
    rec.add("cause", r.cause);
    if (r.in_place) {
      // noticed -> survivors aborted -> round formed -> every worker resumed
      rec.add("in_place", true);
      rec.add("noticed_to_aborted_ms", ms_between(r.noticed, r.stopped));
      rec.add("aborted_to_formed_ms", ms_between(r.stopped, r.formed));
      rec.add("formed_to_resumed_ms", ms_between(r.formed, r.started));
    } else {
      rec.add("noticed_to_stopped_ms", ms_between(r.noticed, r.stopped));
      rec.add("stopped_to_formed_ms", ms_between(r.stopped, r.formed));
      rec.add("formed_to_started_ms", ms_between(r.formed, r.started));
    }
    rec.add("total_ms", ms_between(r.noticed, r.started));
    j.add_raw("recovery", rec.str());
  }
  return j.str();
}

}  // namespace muster::launcher
