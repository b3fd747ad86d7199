// The stall rule (rendezvous/stall.h) with a fake clock.
#include "muster/rendezvous/stall.h"

#include <catch2/catch.hpp>

using muster::rendezvous::find_stall;
using muster::rendezvous::ProgressTracker;
using muster::rendezvous::RankProgress;
using muster::rendezvous::StallClock;
using namespace std::chrono_literals;

namespace {

const StallClock::time_point t0{};  // the fake clock's round start

ProgressTracker tracker(int n) {
  std::vector<RankProgress> ranks;
  for (int r = 0; r < n; ++r) ranks.push_back(RankProgress{r, r, 100 + r, 0, 0, "", t0, {}});
  ProgressTracker t;
  t.reset(ranks, t0);
  return t;
}

// Every rank reports `step` at `at`.
void all_at(ProgressTracker& t, int n, std::uint64_t step, StallClock::time_point at) {
  for (int r = 0; r < n; ++r) t.update(r, step + 1, step, "train", at);
}

}  // namespace

TEST_CASE("stall: one rank behind while the others moved on is named, at the timeout", "[stall]") {
  ProgressTracker t = tracker(4);
  all_at(t, 4, 10, t0 + 1s);
  t.update(2, 11, 10, "data_loader", t0 + 1s);  // rank 2: the same step, new phase
  for (int r : {0, 1, 3}) t.update(r, 12, 11, "all_reduce", t0 + 2s);
  // Rank 2 last moved at 1 s: not yet at 2.9 s with a 2 s timeout, stalled at 3 s.
  CHECK_FALSE(find_stall(t.ranks(), t0 + 2900ms, 2s));
  auto s = find_stall(t.ranks(), t0 + 3s, 2s);
  REQUIRE(s);
  CHECK(s->rank.rank == 2);
  CHECK(s->rank.step == 10);
  CHECK(s->rank.phase == "data_loader");
  CHECK(s->rank.pid == 102);
  CHECK(s->ranks_ahead == 3);
  CHECK(s->furthest_step == 11);
  CHECK(s->still_for == 2s);
  CHECK(s->describe("n4") ==
        "rank 2 (host n4, local rank 2, pid 102) stuck at step 10 in phase 'data_loader' for "
        "2.0 s; 3 ranks got further (up to step 11)");
  // The others, blocked in the collective rank 2 never joined, are still too by 4 s: they
  // are not named, since nobody got further than them.
  s = find_stall(t.ranks(), t0 + 10s, 2s);
  REQUIRE(s);
  CHECK(s->rank.rank == 2);
}

TEST_CASE("stall: every rank stopped at the same step is not a stall", "[stall]") {
  ProgressTracker t = tracker(4);
  all_at(t, 4, 7, t0 + 1s);
  // A barrier, a checkpoint, a long evaluation: nobody moves for a minute.
  CHECK_FALSE(find_stall(t.ranks(), t0 + 61s, 2s));
  // And a round where nobody has reported yet (a slow start, or a program that never does).
  ProgressTracker quiet = tracker(3);
  CHECK_FALSE(find_stall(quiet.ranks(), t0 + 1h, 2s));
}

TEST_CASE("stall: a rank that never reported while the others did counts from the start",
          "[stall]") {
  ProgressTracker t = tracker(3);
  t.update(0, 1, 0, "train", t0 + 500ms);
  t.update(1, 1, 0, "train", t0 + 500ms);
  // Rank 2 never reported: stalled 2 s after the round began, though the others are at step 0.
  CHECK_FALSE(find_stall(t.ranks(), t0 + 1999ms, 2s));
  auto s = find_stall(t.ranks(), t0 + 2s, 2s);
  REQUIRE(s);
  CHECK(s->rank.rank == 2);
  CHECK(s->rank.reports == 0);
  CHECK(s->ranks_ahead == 2);
  CHECK(s->describe("h").find("stuck before its first step for 2.0 s") != std::string::npos);
}

TEST_CASE("stall: progress resets the clock, the furthest behind is named first", "[stall]") {
  ProgressTracker t = tracker(3);
  all_at(t, 3, 5, t0 + 1s);
  t.update(0, 7, 6, "", t0 + 2s);
  t.update(1, 7, 6, "", t0 + 2s);
  t.update(0, 8, 7, "", t0 + 2500ms);
  // Rank 2 (step 5) and rank 1 (step 6) are both behind rank 0 and still for >= 2 s at 4.5 s:
  // rank 2 is named.
  auto s = find_stall(t.ranks(), t0 + 4500ms, 2s);
  REQUIRE(s);
  CHECK(s->rank.rank == 2);
  CHECK(s->ranks_ahead == 2);
  CHECK(s->furthest_step == 7);
  // Rank 2 moves again (a report at the same step counts): it is no longer still; rank 1 is.
  t.update(2, 7, 5, "recovered", t0 + 4500ms);
  s = find_stall(t.ranks(), t0 + 4500ms, 2s);
  REQUIRE(s);
  CHECK(s->rank.rank == 1);
}

TEST_CASE("stall: at one step, the rank that made fewer reports is behind", "[stall]") {
  // Synchronous collectives: the others are at the same step, but inside its all_reduce
  // (one report more), waiting for the rank still loading its data.
  ProgressTracker t = tracker(4);
  for (int r = 0; r < 4; ++r) t.update(r, 30, 9, "optimizer", t0 + 1s);
  t.update(1, 31, 10, "data_loader", t0 + 2s);
  for (int r : {0, 2, 3}) {
    t.update(r, 31, 10, "forward_backward", t0 + 2s);
    t.update(r, 32, 10, "all_reduce", t0 + 2100ms);
  }
  CHECK_FALSE(find_stall(t.ranks(), t0 + 3900ms, 2s));
  auto s = find_stall(t.ranks(), t0 + 4s, 2s);
  REQUIRE(s);
  CHECK(s->rank.rank == 1);
  CHECK(s->rank.phase == "data_loader");
  CHECK(s->ranks_ahead == 3);
  CHECK(s->furthest_step == 10);
}
