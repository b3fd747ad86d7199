#include "muster/rendezvous/stall.h"

#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace muster::rendezvous {

std::string Stall::describe(const std::string& host) const {
  const std::string at = rank.reports == 0 ? std::string("before its first step")
                                           : absl::StrCat("at step ", rank.step);
  const std::string phase = rank.phase.empty() ? "" : absl::StrCat(" in phase '", rank.phase, "'");
  return absl::StrFormat(
      "rank %d (host %s, local rank %d, pid %d) stuck %s%s for %.1f s; %d rank%s got further "
      "(up to step %d)",
      rank.rank, host, rank.local_rank, rank.pid, at, phase, still_for.count() / 1000.0,
      ranks_ahead, ranks_ahead == 1 ? "" : "s", furthest_step);
}

void ProgressTracker::reset(const std::vector<RankProgress>& ranks, StallClock::time_point start) {
  ranks_ = ranks;
  for (RankProgress& r : ranks_) r.changed = start;
}

void ProgressTracker::update(int rank, std::uint64_t reports, std::uint64_t step,
                             const std::string& phase, StallClock::time_point now,
                             std::vector<std::uint64_t> kind_ns) {
  for (RankProgress& r : ranks_) {
    if (r.rank != rank) continue;
    if (r.reports != reports || r.step != step) r.changed = now;
    r.reports = reports;
    r.step = step;
    r.phase = phase;
    r.kind_ns = std::move(kind_ns);
    return;
  }
}

std::optional<Stall> find_stall(const std::vector<RankProgress>& ranks, StallClock::time_point now,
                                std::chrono::milliseconds timeout) {
  // Every reported position (step, reports), sorted: a rank that never reported is behind all
  // of them; one that did is behind those strictly greater. O(R log R) over the job's ranks.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> positions;
  for (const RankProgress& r : ranks) {
    if (r.reports != 0) positions.emplace_back(r.step, r.reports);
  }
  std::sort(positions.begin(), positions.end());
  std::optional<Stall> best;
  for (const RankProgress& r : ranks) {
    const auto still = std::chrono::duration_cast<std::chrono::milliseconds>(now - r.changed);
    if (still < timeout) continue;
    Stall s;
    s.rank = r;
    s.still_for = still;
    const auto first_ahead =
        r.reports == 0 ? positions.begin()
                       : std::upper_bound(positions.begin(), positions.end(),
                                          std::make_pair(r.step, r.reports));
    s.ranks_ahead = static_cast<int>(positions.end() - first_ahead);
    if (s.ranks_ahead == 0) continue;
    // The furthest position is among those ahead, and has the highest step of all.
    s.furthest_step = positions.back().first;
    // Furthest behind first: never reported, then the lowest step; then the longest still.
    auto key = [](const Stall& x) {
      return std::make_tuple(x.rank.reports != 0, x.rank.step, x.rank.reports, -x.still_for.count(),
                             x.rank.rank);
    };
    if (!best || key(s) < key(*best)) best = s;
  }
  return best;
}

}  // namespace muster::rendezvous
