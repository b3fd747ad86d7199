// The rendezvous server's Prometheus series (docs/operations.md, "Metrics"), private to the
// server: counters fed by the state machine's events (events.h) on the io thread, and gauges
// sampled at scrape time: the runs' state from the io thread (which alone may read it),
// the store's counts from any thread.
#pragma once

#include <array>
#include <boost/asio/io_context.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "muster/ops/metrics.h"
#include "muster/rendezvous/events.h"
#include "store_server.h"

namespace muster::rendezvous {

// A scrape waits this long for the io thread's sample of the runs; when it does not come
// (the loop is busy or has stopped), the gauges keep the last sample.
inline constexpr std::chrono::milliseconds kMetricsSampleTimeout{1000};

// The upper bounds of muster_round_recovery_seconds' buckets, in seconds.
inline const std::vector<double> kRecoverySecondsBuckets = {0.05, 0.1, 0.25, 0.5, 1,  2.5, 5,
                                                            10,   30,  60,   120, 300, 600};

// The runs as the io thread sees them.
struct ServerSample {
  std::int64_t runs_joining = 0, runs_running = 0, runs_finished = 0;
  std::int64_t nodes_connected = 0;  // joined a run, stream open
  std::int64_t nodes_members = 0;    // in a running round
  std::int64_t nodes_waiting = 0;    // waiting for the next round (spares included)
  std::int64_t agent_streams = 0;    // Session streams open, joined or not
};

class ServerMetrics {
 public:
  // Registers the server's families with `registry` (which must outlive this object).
  explicit ServerMetrics(ops::Registry& registry);

  // io thread: one event of the state machine.
  void on_event(const RunEvent& e);
  // Any thread: a scrape's refresh. Runs `sample` on `io` and waits for it at most
  // kMetricsSampleTimeout; reads the store directly. Not from the io thread.
  void collect(boost::asio::io_context& io, std::function<ServerSample()> sample,
               const StoreServer& store);

 private:
  void set(const ServerSample& s);

  ops::Family<ops::Gauge>& runs_;
  ops::Gauge &nodes_connected_, &nodes_members_, &nodes_waiting_, &agent_streams_;
  ops::Counter& rounds_;
  ops::Family<ops::Counter>& restarts_;
  ops::Family<ops::Counter>& node_losses_;
  ops::Counter& worker_failures_;
  ops::Family<ops::Counter>& runs_finished_;
  ops::Histogram& recovery_;
  std::array<ops::Counter*, StoreServer::kNumOps> store_ops_{};
  ops::Gauge& store_waits_;
};

}  // namespace muster::rendezvous
