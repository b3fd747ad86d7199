#include "server/server_metrics.h"

#include <boost/asio/post.hpp>
#include <cctype>
#include <string>

#include "absl/time/time.h"
#include "muster/v1/rendezvous.pb.h"

namespace muster::rendezvous {
namespace {

// "MULTI_GET" -> "multi_get"; an unknown or unset op is "invalid".
std::string op_label(int op) {
  if (op == v1::StoreRequest::OP_UNSPECIFIED || !v1::StoreRequest::Op_IsValid(op)) {
    return "invalid";
  }
  std::string name = v1::StoreRequest::Op_Name(static_cast<v1::StoreRequest::Op>(op));
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name;
}

}  // namespace

struct ServerMetrics::Series {
  explicit Series(ops::Registry& r)
      : runs(r.gauge("muster_runs", "Runs the server holds, by phase", {"phase"})),
        nodes_connected(
            r.gauge("muster_nodes_connected", "Nodes that joined a run and are connected").get()),
        nodes_members(r.gauge("muster_nodes_members", "Nodes in a running round").get()),
        nodes_waiting(
            r.gauge("muster_nodes_waiting", "Nodes waiting for the next round (spares included)")
                .get()),
        agent_streams(
            r.gauge("muster_agent_streams", "Agents' rendezvous streams open (joined or not)")
                .get()),
        rounds(r.counter("muster_rounds_formed_total", "Rounds formed, over all runs").get()),
        restarts(r.counter("muster_restarts_total",
                           "Restarts of a run, by cause (worker_failure, node_lost, node_joined, "
                           "rejoin)",
                           {"cause"})),
        node_losses(r.counter("muster_node_losses_total",
                              "Nodes that left a run, by cause (stream_closed, silent)",
                              {"cause"})),
        worker_failures(
            r.counter("muster_worker_failures_total", "Worker failures reported by agents").get()),
        runs_finished(r.counter("muster_runs_finished_total",
                                "Runs finished: succeeded, or the cause of the failure "
                                "(budget_spent, no_progress, join_timeout)",
                                {"result"})),
        recovery(r.histogram("muster_round_recovery_seconds",
                             "From a restart to the run's next round formed, in seconds", {},
                             ops::kRecoveryBucketsSeconds)
                     .get()),
        runs_restored(r.counter("muster_runs_restored_total",
                                "Runs loaded from --state_dir by a restarted server")
                          .get()),
        reattaches(r.counter("muster_node_reattaches_total",
                             "Members that got their place back after a server restart (no "
                             "restart of the run)")
                       .get()),
        in_place(r.counter("muster_in_place_recoveries_total",
                           "Restarts that every in-place node of the next round came back from "
                           "(docs/in_place.md)")
                     .get()),
        in_place_fallbacks(r.counter("muster_in_place_fallbacks_total",
                                     "In-place recoveries of a node that fell back to a full "
                                     "restart")
                               .get()),
        in_place_resumed(r.histogram("muster_in_place_resumed_seconds",
                                     "From a restart to every in-place node of the next round "
                                     "resumed, in seconds",
                                     {}, ops::kRecoveryBucketsSeconds)
                             .get()),
        stragglers_named(r.counter("muster_stragglers_named_total",
                                   "Ranks named as stragglers (docs/stragglers.md), by cause "
                                   "(compute, data, network)",
                                   {"cause"})),
        straggler_slowdown(r.gauge("muster_straggler_slowdown",
                                   "A rank named as a straggler: its own work per step over the "
                                   "others' median while named, 0 once cleared",
                                   {"run", "rank", "host", "cause"})),
        stragglers_excluded(r.counter("muster_stragglers_excluded_total",
                                      "Nodes excluded from their run as stragglers "
                                      "(docs/stragglers.md, \"Exclusion\"), by cause",
                                      {"cause"})),
        store_waits(r.gauge("muster_store_waits_parked",
                            "Store requests (get, wait, multi_get) waiting for keys")
                        .get()) {
    auto& ops = r.counter("muster_store_operations_total", "Store requests served, by op", {"op"});
    for (int op = 0; op < StoreServer::kNumOps; ++op) store_ops[op] = &ops.with({op_label(op)});
    // The known label values are there from the start, at 0, so that a first increase shows
    // in rate() and a query finds the series before anything happened (others still appear
    // as they come).
    for (const char* c :
         {"worker_failure", "node_lost", "node_joined", "rejoin", "straggler_excluded"}) {
      restarts.with({c});
    }
    for (const char* c : {"stream_closed", "silent", "not_reattached", "rejoined"}) {
      node_losses.with({c});
    }
    for (const char* c : {"succeeded", "budget_spent", "no_progress", "join_timeout"}) {
      runs_finished.with({c});
    }
    for (const char* c : {"compute", "data", "network"}) stragglers_named.with({c});
    stragglers_excluded.with({"compute"});
    set(ServerSample{});
  }

  void set(const ServerSample& s) {
    runs.with({"joining"}).set(static_cast<double>(s.runs_joining));
    runs.with({"running"}).set(static_cast<double>(s.runs_running));
    runs.with({"finished"}).set(static_cast<double>(s.runs_finished));
    nodes_connected.set(static_cast<double>(s.nodes_connected));
    nodes_members.set(static_cast<double>(s.nodes_members));
    nodes_waiting.set(static_cast<double>(s.nodes_waiting));
    agent_streams.set(static_cast<double>(s.agent_streams));
  }

  ops::Family<ops::Gauge>& runs;
  ops::Gauge &nodes_connected, &nodes_members, &nodes_waiting, &agent_streams;
  ops::Counter& rounds;
  ops::Family<ops::Counter>& restarts;
  ops::Family<ops::Counter>& node_losses;
  ops::Counter& worker_failures;
  ops::Family<ops::Counter>& runs_finished;
  ops::Histogram& recovery;
  ops::Counter &runs_restored, &reattaches;
  ops::Counter &in_place, &in_place_fallbacks;
  ops::Histogram& in_place_resumed;
  ops::Family<ops::Counter>& stragglers_named;
  ops::Family<ops::Gauge>& straggler_slowdown;
  ops::Family<ops::Counter>& stragglers_excluded;
  ops::Gauge& store_waits;
  std::array<ops::Counter*, StoreServer::kNumOps> store_ops{};
};

ServerMetrics::ServerMetrics() = default;
ServerMetrics::~ServerMetrics() = default;

void ServerMetrics::attach(ops::Registry& registry) {
  auto series = std::make_unique<Series>(registry);
  absl::MutexLock lock(&mu_);
  series_ = std::move(series);
}

void ServerMetrics::on_event(const RunEvent& e) {
  absl::MutexLock lock(&mu_);
  if (!series_) return;
  Series& m = *series_;
  switch (e.kind) {
    case RunEvent::Kind::kRoundFormed:
      m.rounds.inc();
      // Every round after the first follows a restart; `took` runs from it.
      if (e.round > 1) m.recovery.observe(std::chrono::duration<double>(e.took).count());
      break;
    case RunEvent::Kind::kRestart:
      m.restarts.with({e.cause}).inc();
      break;
    case RunEvent::Kind::kNodeLost:
      m.node_losses.with({e.cause}).inc();
      break;
    case RunEvent::Kind::kWorkerFailed:
      m.worker_failures.inc();
      break;
    case RunEvent::Kind::kSucceeded:
      m.runs_finished.with({"succeeded"}).inc();
      break;
    case RunEvent::Kind::kFailed:
      m.runs_finished.with({e.cause.empty() ? "failed" : e.cause}).inc();
      break;
    case RunEvent::Kind::kRunRestored:
      m.runs_restored.inc();
      break;
    case RunEvent::Kind::kNodeReattached:
      m.reattaches.inc();
      break;
    case RunEvent::Kind::kInPlaceResumed:
      // The last in-place node of the round: the run's recovery is done.
      if (e.resumed == e.in_place) {
        m.in_place.inc();
        m.in_place_resumed.observe(std::chrono::duration<double>(e.took).count());
      }
      break;
    case RunEvent::Kind::kInPlaceFallback:
      m.in_place_fallbacks.inc();
      break;
    case RunEvent::Kind::kStragglerNamed:
      m.stragglers_named.with({e.cause}).inc();
      m.straggler_slowdown.with({e.run_id, std::to_string(e.rank), e.host, e.cause})
          .set(e.slowdown);
      break;
    case RunEvent::Kind::kStragglerExcluded:
      m.stragglers_excluded.with({e.cause}).inc();
      break;
    case RunEvent::Kind::kStragglerCleared:
      m.straggler_slowdown.with({e.run_id, std::to_string(e.rank), e.host, e.cause}).set(0);
      break;
    case RunEvent::Kind::kNodeJoined:
      break;
  }
}

void ServerMetrics::collect(boost::asio::io_context& io, std::function<ServerSample()> sample,
                            const StoreServer& store) {
  {
    absl::MutexLock lock(&mu_);
    if (!series_) return;
    const auto counts = store.op_counts();
    for (int op = 0; op < StoreServer::kNumOps; ++op) {
      series_->store_ops[op]->mirror(static_cast<double>(counts[op]));
    }
    series_->store_waits.set(static_cast<double>(store.parked_waits()));
  }

  // Shared with the posted call, which may run after this scrape gave up on it.
  struct Box {
    absl::Mutex mu;
    bool done ABSL_GUARDED_BY(mu) = false;
    ServerSample value ABSL_GUARDED_BY(mu);
  };
  auto box = std::make_shared<Box>();
  boost::asio::post(io, [box, sample = std::move(sample)] {
    ServerSample s = sample();
    absl::MutexLock lock(&box->mu);
    box->value = s;
    box->done = true;
  });
  ServerSample got;
  {
    absl::MutexLock lock(&box->mu);
    if (!box->mu.AwaitWithTimeout(absl::Condition(&box->done),
                                  absl::FromChrono(kMetricsSampleTimeout))) {
      return;
    }
    got = box->value;
  }
  absl::MutexLock lock(&mu_);
  series_->set(got);
}

}  // namespace muster::rendezvous
