#include "muster/agent/agent_metrics.h"

#include <algorithm>
#include <memory>

namespace muster::agent {
namespace {

double seconds(std::chrono::steady_clock::duration d) {
  return std::max(0.0, std::chrono::duration<double>(d).count());
}

struct AgentMetrics {
  explicit AgentMetrics(ops::Registry& r)
      : rounds(r.counter("muster_agent_rounds_total", "Rounds this node took part in").get()),
        restarts(r.counter("muster_agent_restarts_total",
                           "Restarts the rendezvous server told this node of")
                     .get()),
        worker_failures(
            r.counter("muster_agent_worker_failures_total", "This node's workers that failed")
                .get()),
        lost_server(r.counter("muster_agent_lost_server_total",
                              "Times this node lost the rendezvous server (stream ended or silent)")
                        .get()),
        recoveries(r.counter("muster_agent_recoveries_total",
                             "Recoveries completed (workers running again), by what this node "
                             "noticed first: worker_failure, restart, lost_server",
                             {"cause"})),
        recovery(r.histogram("muster_agent_recovery_seconds",
                             "A recovery's time, in seconds, by phase: stop (noticed -> workers "
                             "stopped), rendezvous (-> round formed), start (-> workers started), "
                             "total (noticed -> workers started)",
                             {"phase"}, ops::kRecoveryBucketsSeconds)),
        reattached(r.counter("muster_agent_reattached_total",
                             "Times this node got its place back after a lost stream (rdzvd "
                             "restarted with --state_dir): the workers kept running")
                       .get()),
        reattach(r.histogram("muster_agent_reattach_seconds",
                             "From a lost stream to the place back, in seconds",
                             {}, ops::kRecoveryBucketsSeconds)
                     .get()),
        in_place(r.counter("muster_agent_in_place_recoveries_total",
                           "In-place recoveries completed (every worker of this node stepped "
                           "again in the new world), by what this node noticed first",
                           {"cause"})),
        in_place_fallbacks(r.counter("muster_agent_in_place_fallbacks_total",
                                     "In-place recoveries that did not complete in time and fell "
                                     "back to a full restart")
                               .get()),
        in_place_phase(r.histogram("muster_agent_in_place_recovery_seconds",
                                   "An in-place recovery's time, in seconds, by phase: abort "
                                   "(noticed -> survivors told to abort), rendezvous (-> round "
                                   "formed), reform (-> every worker resumed), total",
                                   {"phase"}, ops::kRecoveryBucketsSeconds)),
        finished(r.counter("muster_agent_runs_finished_total",
                           "Runs this node finished, by result (succeeded, failed)", {"result"})),
        workers(r.gauge("muster_agent_workers_running",
                        "Workers of the current round started and not failed or stopped")
                    .get()),
        round(r.gauge("muster_agent_round", "The current round (0 before the first)").get()),
        world_size(r.gauge("muster_agent_world_size", "Workers in the current round, all nodes")
                       .get()),
        restart_count(r.gauge("muster_agent_restart_count",
                              "The run's restart count (TORCHELASTIC_RESTART_COUNT)")
                          .get()) {
    for (const char* c : {"worker_failure", "restart", "lost_server"}) recoveries.with({c});
    for (const char* p : {"stop", "rendezvous", "start", "total"}) recovery.with({p});
    for (const char* res : {"succeeded", "failed"}) finished.with({res});
    for (const char* c : {"worker_failure", "restart"}) in_place.with({c});
    for (const char* p : {"abort", "rendezvous", "reform", "total"}) in_place_phase.with({p});
  }

  void on(const AgentEvent& e) {
    switch (e.kind) {
      case AgentEvent::Kind::kRoundFormed:
        rounds.inc();
        round.set(e.round);
        world_size.set(e.world_size);
        restart_count.set(e.restart_count);
        break;
      case AgentEvent::Kind::kWorkersStarted:
        workers.set(e.workers);
        if (e.recovery) {
          const Recovery& r = *e.recovery;
          recoveries.with({r.cause}).inc();
          recovery.with({"stop"}).observe(seconds(r.stopped - r.noticed));
          recovery.with({"rendezvous"}).observe(seconds(r.formed - r.stopped));
          recovery.with({"start"}).observe(seconds(r.started - r.formed));
          recovery.with({"total"}).observe(seconds(r.started - r.noticed));
        }
        break;
      case AgentEvent::Kind::kWorkerFailed:
        worker_failures.inc();
        if (workers.value() > 0) workers.dec();
        break;
      case AgentEvent::Kind::kRestart:
        restarts.inc();
        break;
      case AgentEvent::Kind::kLostServer:
        lost_server.inc();
        break;
      case AgentEvent::Kind::kWorkersStopped:
        workers.set(0);
        break;
      case AgentEvent::Kind::kSucceeded:
        workers.set(0);
        finished.with({"succeeded"}).inc();
        break;
      case AgentEvent::Kind::kFailed:
        workers.set(0);
        finished.with({"failed"}).inc();
        break;
      case AgentEvent::Kind::kReattached:
        reattached.inc();
        reattach.observe(seconds(e.took));
        break;
      case AgentEvent::Kind::kInPlaceResumed:
        workers.set(e.workers);
        if (e.recovery) {
          const Recovery& r = *e.recovery;
          in_place.with({r.cause}).inc();
          in_place_phase.with({"abort"}).observe(seconds(r.stopped - r.noticed));
          in_place_phase.with({"rendezvous"}).observe(seconds(r.formed - r.stopped));
          in_place_phase.with({"reform"}).observe(seconds(r.started - r.formed));
          in_place_phase.with({"total"}).observe(seconds(r.started - r.noticed));
        }
        break;
      case AgentEvent::Kind::kInPlaceFallback:
        in_place_fallbacks.inc();
        break;
    }
  }

  ops::Counter &rounds, &restarts, &worker_failures, &lost_server;
  ops::Family<ops::Counter>& recoveries;
  ops::Family<ops::Histogram>& recovery;
  ops::Counter& reattached;
  ops::Histogram& reattach;
  ops::Family<ops::Counter>& in_place;
  ops::Counter& in_place_fallbacks;
  ops::Family<ops::Histogram>& in_place_phase;
  ops::Family<ops::Counter>& finished;
  ops::Gauge &workers, &round, &world_size, &restart_count;
};

}  // namespace

std::function<void(const AgentEvent&)> agent_metrics_sink(ops::Registry& registry) {
  auto m = std::make_shared<AgentMetrics>(registry);
  return [m](const AgentEvent& e) { m->on(e); };
}

}  // namespace muster::agent
