#include "muster/agent/agent_events.h"

namespace muster::agent {

std::string_view event_name(AgentEvent::Kind kind) {
  switch (kind) {
    case AgentEvent::Kind::kRoundFormed: return "round_formed";
    case AgentEvent::Kind::kWorkersStarted: return "workers_started";
    case AgentEvent::Kind::kWorkerFailed: return "worker_failed";
    case AgentEvent::Kind::kRestart: return "restart";
    case AgentEvent::Kind::kLostServer: return "lost_server";
    case AgentEvent::Kind::kWorkersStopped: return "workers_stopped";
    case AgentEvent::Kind::kSucceeded: return "succeeded";
    case AgentEvent::Kind::kFailed: return "failed";
    case AgentEvent::Kind::kReattached: return "reattached";
    case AgentEvent::Kind::kInPlaceResumed: return "in_place_resumed";
    case AgentEvent::Kind::kInPlaceFallback: return "in_place_fallback";
  }
  return "unknown";
}

}  // namespace muster::agent
