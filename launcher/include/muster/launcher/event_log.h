// launch --event_log FILE: one JSON object per line for every event of this node
// (agent_events.h), with a recovery's timings per phase, and, when this launch hosts the
// rendezvous, the server's events too (the same lines as rdzvd's --event_log)
// (docs/operations.md, "Event log").
#pragma once

#include <string>

#include "muster/agent/agent_events.h"

namespace muster::launcher {

// Who wrote the line: the same on every line of one launch.
struct EventLogSource {
  std::string run_id;
  std::string node_id;
  std::string host;
};

// One agent event as a JSON object (no newline).
std::string event_log_line(const agent::AgentEvent& e, const EventLogSource& source);

}  // namespace muster::launcher
