// launch's own Prometheus series (--metrics_port; docs/operations.md, "Metrics"), fed by the
// agent's events (agent_events.h): rounds, restarts, failures, recoveries and their phases,
// the workers running.
#pragma once

#include <functional>

#include "muster/agent/agent_events.h"
#include "muster/ops/metrics.h"

namespace muster::agent {

// Registers the agent's series with `registry` (which must outlive the sink) and returns the
// sink to add to AgentOptions::event_sinks. One per registry.
std::function<void(const AgentEvent&)> agent_metrics_sink(ops::Registry& registry);

}  // namespace muster::agent
