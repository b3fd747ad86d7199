// The stall rule (docs/hangs.md): which rank, if any, is hung. Pure: the caller gives the
// time (a fake clock in tests) and what each rank's progress page said.
//
// A rank's position is (step, reports): its last step and how many reports it has made. Ranks
// of one SPMD program make the same reports in the same order (what only some ranks do is
// reported as a phase alone, which moves nothing), so a rank whose position is lower is behind:
// the others got past the point it is at, e.g. into the collective of the step it is still
// loading data for. A rank is stalled when its position has not moved for `timeout` while
// another rank's is higher. Ranks that all stop at one position (a barrier, a checkpoint, a long
// evaluation) are not stalled: nobody got further. A rank that never reported counts from the
// start of the round. When several ranks are stalled, the one furthest behind (lowest
// position, then longest still, then lowest rank) is named.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace muster::rendezvous {

using StallClock = std::chrono::steady_clock;

struct RankProgress {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  std::uint64_t reports = 0;  // 0: never reported
  std::uint64_t step = 0;
  std::string phase;
  StallClock::time_point changed;  // when step or reports last moved (or the round began)
  // Nanoseconds the rank has spent in each kind of phase (data, compute, comm, optimizer,
  // other: ops/progress_page.h's PhaseKind), for the straggler watch; empty when not known.
  std::vector<std::uint64_t> kind_ns;
};

struct Stall {
  RankProgress rank;
  std::chrono::milliseconds still_for{0};  // since its progress last moved
  int ranks_ahead = 0;                     // ranks that got further
  std::uint64_t furthest_step = 0;         // the highest step among them
  // "rank 3 (local rank 1, pid 812) stuck at step 40 in phase 'data_loader' for 2.0 s; 3
  //  ranks got further (up to step 41)"
  std::string describe(const std::string& host) const;
};

// Keeps each rank's last progress and when it last moved. One per round.
class ProgressTracker {
 public:
  // A round's ranks (rank, local rank, pid), all "moved" at `start`.
  void reset(const std::vector<RankProgress>& ranks, StallClock::time_point start);
  // What rank `rank`'s page says now. Moves `changed` when step or reports differ.
  void update(int rank, std::uint64_t reports, std::uint64_t step, const std::string& phase,
              StallClock::time_point now, std::vector<std::uint64_t> kind_ns = {});
  const std::vector<RankProgress>& ranks() const { return ranks_; }

 private:
  std::vector<RankProgress> ranks_;
};

std::optional<Stall> find_stall(const std::vector<RankProgress>& ranks, StallClock::time_point now,
                                std::chrono::milliseconds timeout);

}  // namespace muster::rendezvous
