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
#include <memory>
#include <optional>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "muster/ops/metrics.h"
#include "muster/rendezvous/events.h"
#include "store/store_server.h"

namespace muster::rendezvous {

// A scrape waits this long for the io thread's sample of the runs; when it does not come
// (the loop is busy or has stopped), the gauges keep the last sample.
inline constexpr std::chrono::milliseconds kMetricsSampleTimeout{1000};

// The runs as the io thread sees them.
struct ServerSample {
  std::int64_t runs_joining = 0, runs_running = 0, runs_finished = 0;
  std::int64_t nodes_connected = 0;  // joined a run, stream open
  std::int64_t nodes_members = 0;    // in a running round
  std::int64_t nodes_waiting = 0;    // waiting for the next round (spares included)
  std::int64_t agent_streams = 0;    // Session streams open, joined or not
};

// Made before the server binds, so that its event sink is in place from the start; its
// series go into a registry only once attach()ed, when the server is up (a launch that tries
// to host the rendezvous and finds it hosted elsewhere adds nothing).
class ServerMetrics {
 public:
  ServerMetrics();
  ~ServerMetrics();

  // Registers the server's families with `registry` (which must outlive this object). Once.
  void attach(ops::Registry& registry);
  // io thread: one event of the state machine (ignored before attach).
  void on_event(const RunEvent& e);
  // Any thread: a scrape's refresh. Runs `sample` on `io` and waits for it at most
  // kMetricsSampleTimeout; reads the store directly. Not from the io thread.
  void collect(boost::asio::io_context& io, std::function<ServerSample()> sample,
               const StoreServer& store);

 private:
  struct Series;
  absl::Mutex mu_;
  std::unique_ptr<Series> series_ ABSL_GUARDED_BY(mu_);
};

}  // namespace muster::rendezvous
