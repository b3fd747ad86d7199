// The straggler watch (docs/stragglers.md): which rank, if any, is slowing a synchronous job
// down, and why. Pure: the caller hands in what each rank's progress page said; no clock.
//
// In synchronous data parallel training every rank's step takes the same time (the
// collective waits for the slowest), so step rates cannot name the straggler. What names it is
// each rank's own work (data, compute, optimizer: every phase kind but the collective wait)
// per step, against the median of the other ranks': the slow rank works longest and waits
// least. The cause is "data" when only its data phases are slower (an input pipeline), else
// "compute" (a slow or busy host slows every phase, its data loading too).
//
// A window closes when every rank with phase times went `window_steps` steps past the last
// close. A rank is slow in a window when its own work per step is at least `ratio` times the
// others' median. It is named when it was slow in a majority of its last `windows` windows
// (a pause, or a data stall that moves from rank to rank, is one window or two), and cleared
// when it was slow in at most one of them.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "muster/rendezvous/limits.h"

namespace muster::rendezvous {

struct StragglerOptions {
  double ratio = limits::kStragglerRatio;
  int window_steps = limits::kStragglerWindowSteps;
  int windows = limits::kStragglerWindows;
};

struct Straggler {
  int rank = 0;
  std::string node;   // its node's host
  std::string cause;  // "compute", "data" or "network" (LinkJudge)
  double slowdown =
      0;  // own work per step over the others' median (the median of its slow windows)
  std::uint64_t step = 0;  // the step it stood at when named
  // cause "network" (a slow link, LinkJudge): its node's best rate and the nodes' median, MB/s.
  double link_mbps = 0, link_median = 0;
  // "rank 3 on host n2: 2.1x the others' own work per step (compute), named at step 40";
  // "rank 4 on host n3: its node's link moved 10.2 MB/s, the nodes' median 51.6 MB/s (network)"
  std::string describe() const;
};

// What changed in one evaluate(): ranks newly named, ranks cleared.
struct StragglerChange {
  std::vector<Straggler> named;
  std::vector<Straggler> cleared;
};

class StragglerWatch {
 public:
  explicit StragglerWatch(StragglerOptions o = {}) : o_(o) {}
  // A new round: every rank and window forgotten (the named ones too).
  void reset();
  // Rank `rank`'s page now: its step and its time per phase kind (data, compute, comm,
  // optimizer, other; cumulative). A rank without phase times (empty) is not watched.
  void update(int rank, const std::string& node, std::uint64_t step,
              const std::vector<std::uint64_t>& kind_ns);
  // Closes every window that is due and says who was named or cleared by them.
  StragglerChange evaluate();
  // The ranks named now, by rank.
  const std::map<int, Straggler>& named() const { return named_; }
  int windows_closed() const { return closed_; }

 private:
  struct Sample {
    std::uint64_t step = 0;
    std::vector<std::uint64_t> kind_ns;
  };
  struct Rank {
    std::string node;
    Sample start, latest;
    bool started = false;
    std::vector<double> ratios;  // the last `windows` windows' ratios, oldest first
    std::vector<bool> data;      // per window: its excess was in data
  };
  StragglerOptions o_;
  std::map<int, Rank> ranks_;
  std::map<int, Straggler> named_;
  int closed_ = 0;
};

// Slow links (docs/stragglers.md, "Slow links"): a synchronous job's ranks all wait alike for
// a slow link, so per-rank phase times cannot name it; the links' own rates can. Each node
// reports, per pair of addresses, how fast its workers' connections to other hosts took data
// while they had data to send (agent/link_watch.h). A node's link is the best rate of any
// connection that touches it: the ones it sends on, and the others' connections to its
// addresses (a node's local addresses are those it reports from). A capped node's connections
// are all slow, both ways; each of its peers has a fast connection with another peer. A node
// is slow in an evaluation when its best over its last kLinkReports reports is below
// `ratio` x the median of the nodes' bests (three nodes with rates at least); named when
// slow in a majority of its last `windows` evaluations, cleared when slow in at most one.
struct SlowLink {
  std::string node;   // the reporting node's key (its node id)
  double mbps = 0;    // its best rate
  double median = 0;  // the nodes' median best
  double slowdown() const { return mbps > 0 ? median / mbps : 0; }
};

class LinkJudge {
 public:
  struct Link {
    std::string local, remote;
    double mbps = 0;
  };
  struct Change {
    std::vector<SlowLink> named, cleared;
  };
  explicit LinkJudge(double ratio = limits::kSlowLinkRatio, int windows = limits::kStragglerWindows)
      : ratio_(ratio), windows_(windows) {}
  void reset();
  // Node `node`'s report (empty reports are not kept: a pause moved nothing).
  void update(const std::string& node, std::vector<Link> links);
  Change evaluate();
  const std::map<std::string, SlowLink>& named() const { return named_; }

 private:
  double ratio_;
  int windows_;
  std::map<std::string, std::deque<std::vector<Link>>> reports_;
  std::map<std::string, std::deque<bool>> slow_;
  std::map<std::string, SlowLink> named_;
};

// Exclusion (launch --exclude_stragglers; docs/stragglers.md, "Exclusion"): whether a named
// straggler's node leaves the world now. Leaving costs a re-form, and without a spare to take
// its place a world of N nodes that loses one does (N-1)/N of the work per step; keeping it
// costs the slowdown on every step. So a node leaves when the run keeps its workers in place,
// its cause is not data loading (an input pipeline's stall moves from rank to rank), the run
// stays at MIN nodes or more (or a spare takes its place), its slowdown is beyond N/(N-1)
// (beyond 1 with a spare), and the time it has cost since it was named,
// named_for x (1 - 1/slowdown), is beyond what a re-form costs.
struct ExclusionCase {
  int nodes = 0;  // members of the running round
  int min_nodes = 1;
  bool spare = false;     // a node waits beyond MAX and takes the place
  bool in_place = false;  // every member joined in place
  std::string cause;
  double slowdown = 0;
  std::chrono::milliseconds named_for{0};
  std::chrono::milliseconds reform_cost{0};
};
// "" when the node leaves; else why it is kept, in a few words ("at MIN nodes (2)").
std::string exclusion_kept(const ExclusionCase& c);

}  // namespace muster::rendezvous
