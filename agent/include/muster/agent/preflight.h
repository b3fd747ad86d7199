// launch --preflight (docs/stragglers.md, "Pre-flight"): before the first round's workers
// start, every node measures its compute and its network, and a node far slower than the
// others is named and leaves before it slows a step.
//
// The network: the nodes form a ring by group rank and each probes its successor (a pair is as
// fast as the slower of its two links). A node's link is the best of its two probes; a node
// whose best is below `ratio` x the median of the nodes' bests is slow: both of its probes were
// slow, while each neighbour had a fast probe with its other neighbour. The probes run in
// rounds in which no node is in two probes (two rounds, three when the ring is odd), each round
// behind a barrier on the run's store. Two nodes cannot tell which of them is slow (one probe);
// nobody is named then. The compute: a short fixed floating-point kernel per node, slow below
// `ratio` x the median, with three nodes or more.
//
// Coordination goes through the run's store under the round's prefix (`preflight/...`): each
// node's probe address, one barrier per probe round, each probe's result and each node's
// compute score; every node then judges the same numbers and reaches the same verdict.
//
// The pure parts (schedule, judge) are separate from the transport (ProbeServer, probe) and the
// store's choreography (run), so that the unit tests drive the first with made-up numbers.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "muster/rendezvous/grpc_store.h"
#include "muster/rendezvous/store.h"

namespace muster::agent::preflight {

// Each probe sends for this long in each direction.
inline constexpr std::chrono::milliseconds kProbeTime{250};
// The compute kernel runs for this long.
inline constexpr std::chrono::milliseconds kComputeTime{150};
// A node below this share of the median (link or compute) is slow.
inline constexpr double kSlowRatio = 0.5;
// Every wait on the store (an address, a barrier, the results) at most this long; the whole
// pre-flight of a round of N nodes takes about 2-3 x (2 x kProbeTime) plus the barriers.
inline constexpr std::chrono::milliseconds kStoreWait{std::chrono::seconds(30)};
// The probe listener serves at most this many connections at once (a round gives each node at
// most one), at most kMaxProbeConnectionsServed in all (each node is probed once), and each
// for at most kConnectionLimit.
inline constexpr int kMaxProbeConnections = 4;
inline constexpr int kMaxProbeConnectionsServed = 64;
inline constexpr std::chrono::milliseconds kConnectionLimit{std::chrono::seconds(10)};

// One probe: node `from` connects to node `to`'s listener.
struct Edge {
  int from = 0;
  int to = 0;
  bool operator==(const Edge& o) const { return from == o.from && to == o.to; }
};

// The probe rounds over the ring of `n` nodes (i probes i+1 mod n); no node is in two probes
// of one round. n < 2: none; n == 2: one probe.
std::vector<std::vector<Edge>> schedule(int n);

struct Measured {
  Edge edge;
  double mbps = 0;  // MB/s, the slower direction
};

struct Verdict {
  std::vector<double> link;      // per node: the best of its probes (MB/s; 0: none)
  std::vector<double> compute;   // per node, as measured
  double link_median = 0, compute_median = 0;
  std::vector<int> slow_link;     // nodes named, ascending
  std::vector<int> slow_compute;
  bool named(int node) const;
  // One line for `node`: why it is named ("" when it is not).
  std::string why(int node) const;
};

// The verdict over `n` nodes' probes and compute scores (compute.size() == n).
Verdict judge(int n, const std::vector<Measured>& probes, const std::vector<double>& compute,
              double ratio = kSlowRatio);

// The compute kernel: a fixed multiply-add loop over a small array for `d`; its rate, in
// millions of multiply-adds per second.
double compute_score(std::chrono::milliseconds d = kComputeTime);

// The listener other nodes probe: on `host` (the address they reach this node at), an
// ephemeral port, one thread per connection (at most kMaxProbeConnections). A connection sends
// a header, then data for its time and closes its sending side; the server answers with what
// it received and how long that took, then sends for the same time and closes.
class ProbeServer {
 public:
  static absl::StatusOr<std::unique_ptr<ProbeServer>> start(const std::string& host);
  ~ProbeServer();
  int port() const { return port_; }

 private:
  ProbeServer() = default;
  void serve();
  int fd_ = -1;
  int wake_[2] = {-1, -1};
  int port_ = 0;
  std::thread accept_;
};

// Probes the listener at host:port: sends for `d`, reads the server's count, receives for `d`.
// The slower direction's MB/s.
absl::StatusOr<double> probe(const std::string& host, int port,
                             std::chrono::milliseconds d = kProbeTime);

struct Options {
  rendezvous::Store* store = nullptr;  // the run's store, under this round's prefix
  int node = 0;                        // group rank
  int nodes = 1;                       // group world size
  std::string host;                    // where the others reach this node
  std::chrono::milliseconds probe_time = kProbeTime;
  std::chrono::milliseconds compute_time = kComputeTime;
  std::chrono::milliseconds wait = kStoreWait;
  double ratio = kSlowRatio;
};

// The whole pre-flight of one node: its listener, its compute score, its probes round by
// round, and the verdict every node reaches. An error: the store or a probe failed (the node
// then goes on: a check that cannot run names nobody).
absl::StatusOr<Verdict> run(const Options& o);

// run() on a thread of its own, with a store client of its own (`store`, keys under
// `prefix`: the round's); `done` is called on that thread with the outcome. The destructor
// waits for the thread (every wait in run() is bounded).
class Background {
 public:
  Background(rendezvous::GrpcStoreOptions store, std::string prefix, Options o,
             std::function<void(absl::StatusOr<Verdict>)> done);
  ~Background();
  Background(const Background&) = delete;
  Background& operator=(const Background&) = delete;

 private:
  std::thread thread_;
};

}  // namespace muster::agent::preflight
