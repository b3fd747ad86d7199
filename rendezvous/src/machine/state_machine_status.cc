// What the state machine tells operators: counts for metrics, each run's status.
#include <algorithm>

#include "muster/rendezvous/state_machine.h"
#include "machine/state_machine_internal.h"

namespace muster::rendezvous {

using std::chrono::milliseconds;

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
    s.set_max_restarts(run.config.max_restarts);
    s.set_min_nodes(run.config.min_nodes);
    s.set_max_nodes(run.config.max_nodes);
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
    s.set_in_place_recoveries(run.in_place.recoveries);
    s.set_in_place_fallbacks(run.in_place.fallbacks);
    if (run.in_place.recovery) {
      *s.mutable_last_recovery() = run.in_place.recovery->status;
      s.mutable_last_recovery()->set_age_ms(age_ms(run.in_place.recovery->formed));
    }
    straggler_status(run, s, now);
    if (run.phase == Phase::kFinished) {
      s.set_result(run.result && run.result->has_fail() ? "failed" : "succeeded");
    }
    out.push_back(std::move(s));
  }
  return out;
}
}  // namespace muster::rendezvous
