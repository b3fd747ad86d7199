#include "server_metrics.h"

#include <boost/asio/post.hpp>
#include <cctype>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
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

ServerMetrics::ServerMetrics(ops::Registry& r)
    : runs_(r.gauge("muster_runs", "Runs the server holds, by phase", {"phase"})),
      nodes_connected_(
          r.gauge("muster_nodes_connected", "Nodes that joined a run and are connected").get()),
      nodes_members_(r.gauge("muster_nodes_members", "Nodes in a running round").get()),
      nodes_waiting_(
          r.gauge("muster_nodes_waiting", "Nodes waiting for the next round (spares included)")
              .get()),
      agent_streams_(
          r.gauge("muster_agent_streams", "Agents' rendezvous streams open (joined or not)").get()),
      rounds_(r.counter("muster_rounds_formed_total", "Rounds formed, over all runs").get()),
      restarts_(r.counter("muster_restarts_total",
                          "Restarts of a run, by cause (worker_failure, node_lost, node_joined, "
                          "rejoin)",
                          {"cause"})),
      node_losses_(r.counter("muster_node_losses_total",
                             "Nodes that left a run, by cause (stream_closed, silent)", {"cause"})),
      worker_failures_(
          r.counter("muster_worker_failures_total", "Worker failures reported by agents").get()),
      runs_finished_(r.counter("muster_runs_finished_total",
                               "Runs finished: succeeded, or the cause of the failure "
                               "(budget_spent, no_progress, join_timeout)",
                               {"result"})),
      recovery_(r.histogram("muster_round_recovery_seconds",
                            "From a restart to the run's next round formed, in seconds", {},
                            kRecoverySecondsBuckets)
                    .get()),
      store_waits_(r.gauge("muster_store_waits_parked",
                           "Store requests (get, wait, multi_get) waiting for keys")
                       .get()) {
  for (int op = 0; op < StoreServer::kNumOps; ++op) {
    store_ops_[op] = &r.counter("muster_store_operations_total", "Store requests served, by op",
                                {"op"})
                          .with({op_label(op)});
  }
  // The known label values are there from the start, at 0, so that a first increase shows
  // in rate() and a query finds the series before anything happened (others still appear
  // as they come).
  for (const char* c : {"worker_failure", "node_lost", "node_joined", "rejoin"}) {
    restarts_.with({c});
  }
  for (const char* c : {"stream_closed", "silent"}) node_losses_.with({c});
  for (const char* c : {"succeeded", "budget_spent", "no_progress", "join_timeout"}) {
    runs_finished_.with({c});
  }
  set(ServerSample{});
}

void ServerMetrics::on_event(const RunEvent& e) {
  switch (e.kind) {
    case RunEvent::Kind::kRoundFormed:
      rounds_.inc();
      // Every round after the first follows a restart; `took` runs from it.
      if (e.round > 1) recovery_.observe(std::chrono::duration<double>(e.took).count());
      break;
    case RunEvent::Kind::kRestart:
      restarts_.with({e.cause}).inc();
      break;
    case RunEvent::Kind::kNodeLost:
      node_losses_.with({e.cause}).inc();
      break;
    case RunEvent::Kind::kWorkerFailed:
      worker_failures_.inc();
      break;
    case RunEvent::Kind::kSucceeded:
      runs_finished_.with({"succeeded"}).inc();
      break;
    case RunEvent::Kind::kFailed:
      runs_finished_.with({e.cause.empty() ? "failed" : e.cause}).inc();
      break;
    case RunEvent::Kind::kNodeJoined:
      break;
  }
}

void ServerMetrics::set(const ServerSample& s) {
  runs_.with({"joining"}).set(static_cast<double>(s.runs_joining));
  runs_.with({"running"}).set(static_cast<double>(s.runs_running));
  runs_.with({"finished"}).set(static_cast<double>(s.runs_finished));
  nodes_connected_.set(static_cast<double>(s.nodes_connected));
  nodes_members_.set(static_cast<double>(s.nodes_members));
  nodes_waiting_.set(static_cast<double>(s.nodes_waiting));
  agent_streams_.set(static_cast<double>(s.agent_streams));
}

void ServerMetrics::collect(boost::asio::io_context& io, std::function<ServerSample()> sample,
                            const StoreServer& store) {
  const auto counts = store.op_counts();
  for (int op = 0; op < StoreServer::kNumOps; ++op) {
    store_ops_[op]->mirror(static_cast<double>(counts[op]));
  }
  store_waits_.set(static_cast<double>(store.parked_waits()));

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
  absl::MutexLock lock(&box->mu);
  if (box->mu.AwaitWithTimeout(absl::Condition(&box->done),
                               absl::FromChrono(kMetricsSampleTimeout))) {
    set(box->value);
  }
}

}  // namespace muster::rendezvous
