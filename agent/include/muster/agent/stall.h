// The stall rule (docs/hangs.md): which rank, if any, is hung. Pure: the caller gives the
// time (a fake clock in tests) and what each rank's progress page said.
//
// A rank is stalled when its progress (the step counter, or the number of reports) has not
// moved for `timeout` while another rank has got further: a higher step, or any report when
// this rank never made one. Ranks that all stop at the same step (a barrier, a checkpoint, a
// long evaluation) are not stalled: nobody moved on. A rank that never reported counts from
// the start of the round. When several ranks are stalled, the one furthest behind (lowest
// step, then longest still, then lowest rank) is named.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace muster::agent {

using StallClock = std::chrono::steady_clock;

struct RankProgress {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = -1;
  std::uint64_t reports = 0;  // 0: never reported
  std::uint64_t step = 0;
  std::string phase;
  StallClock::time_point changed;  // when step or reports last moved (or the round began)
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
              StallClock::time_point now);
  const std::vector<RankProgress>& ranks() const { return ranks_; }

 private:
  std::vector<RankProgress> ranks_;
};

std::optional<Stall> find_stall(const std::vector<RankProgress>& ranks, StallClock::time_point now,
                                std::chrono::milliseconds timeout);

}  // namespace muster::agent
