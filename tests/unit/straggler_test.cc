// The straggler watch (rendezvous/straggler.h) over a simulated synchronous data-parallel job:
// every step each rank loads data and computes, waits in the all-reduce for the slowest, then
// steps its optimizer; the pages are sampled every few steps, as an agent's timer does.
#include "muster/rendezvous/straggler.h"

#include <array>
#include <catch2/catch.hpp>
#include <functional>
#include <random>

using muster::rendezvous::exclusion_kept;
using muster::rendezvous::ExclusionCase;
using muster::rendezvous::StragglerChange;
using muster::rendezvous::StragglerWatch;

namespace {

constexpr double kMs = 1e6;  // ns

// One rank's work in one step, ms: data, compute (forward/backward), optimizer.
struct Work {
  double data = 10, compute = 60, optimizer = 5;
};

class Job {
 public:
  explicit Job(int ranks, std::uint32_t seed = 1) : kinds_(ranks), rng_(seed) {}
  // Runs `steps` steps; `work(rank, step)` says each rank's work. Every `sample_every` steps
  // (1 to 3, at random per node: the agents' timers do not line up) the watch gets the rank's
  // page; a change is reported to `seen` with the step it came at.
  void run(int steps, StragglerWatch& w, const std::function<Work(int, int)>& work,
           const std::function<void(const StragglerChange&, int)>& seen) {
    const int n = static_cast<int>(kinds_.size());
    std::uniform_int_distribution<int> every(1, 3);
    for (int s = 0; s < steps; ++s, ++step_) {
      std::vector<Work> ws;
      double slowest = 0;
      for (int r = 0; r < n; ++r) {
        ws.push_back(work(r, step_));
        slowest = std::max(slowest, ws.back().data + ws.back().compute);
      }
      for (int r = 0; r < n; ++r) {
        auto& k = kinds_[static_cast<std::size_t>(r)];
        k[0] += ws[r].data * kMs;
        k[1] += ws[r].compute * kMs;
        k[2] += (slowest - ws[r].data - ws[r].compute + 2) * kMs;  // the wait, and the transfer
        k[3] += ws[r].optimizer * kMs;
      }
      for (int r = 0; r < n; ++r) {
        if (next_sample_.size() <= static_cast<std::size_t>(r)) next_sample_.push_back(0);
        if (step_ < next_sample_[r]) continue;
        next_sample_[r] = step_ + every(rng_);
        const auto& k = kinds_[static_cast<std::size_t>(r)];
        w.update(r, "host" + std::to_string(r), static_cast<std::uint64_t>(step_ + 1),
                 {static_cast<std::uint64_t>(k[0]), static_cast<std::uint64_t>(k[1]),
                  static_cast<std::uint64_t>(k[2]), static_cast<std::uint64_t>(k[3]), 0});
      }
      StragglerChange c = w.evaluate();
      if (!c.named.empty() || !c.cleared.empty()) seen(c, step_ + 1);
    }
  }
  std::mt19937& rng() { return rng_; }

 private:
  std::vector<std::array<double, 5>> kinds_;
  std::vector<int> next_sample_;
  int step_ = 0;
  std::mt19937 rng_;
};

Work jitter(std::mt19937& rng, double spread = 0.1) {
  std::uniform_real_distribution<double> j(1 - spread, 1 + spread);
  return Work{10 * j(rng), 60 * j(rng), 5 * j(rng)};
}

}  // namespace

TEST_CASE(
    "straggler: a rank whose own work is 2x is named within 30 steps, with its host and "
    "cause, and nobody else",
    "[straggler]") {
  for (std::uint32_t seed : {1u, 2u, 3u}) {
    StragglerWatch w;
    Job job(8, seed);
    int named_at = -1;
    std::vector<int> names;
    const int onset = 50;
    job.run(
        150, w,
        [&](int r, int step) {
          Work x = jitter(job.rng());
          if (r == 5 && step >= onset) x.compute *= 2, x.data *= 2, x.optimizer *= 2;
          return x;
        },
        [&](const StragglerChange& c, int step) {
          for (const auto& s : c.named) {
            names.push_back(s.rank);
            if (named_at < 0) named_at = step;
            CHECK(s.node == "host5");
            CHECK(s.cause == "compute");
            CHECK(s.slowdown > 1.6);
            CHECK(s.slowdown < 2.4);
          }
        });
    INFO("seed " << seed << ", named at step " << named_at);
    CHECK(names == std::vector<int>{5});
    CHECK(named_at > onset);
    CHECK(named_at - onset <= 30);
    CHECK(w.named().count(5) == 1);
  }
}

TEST_CASE("straggler: 1.5x is named within 60 steps, and slow data on one rank is named as data",
          "[straggler]") {
  StragglerWatch w;
  Job job(4, 7);
  int named_at = -1;
  std::string cause;
  job.run(
      160, w,
      [&](int r, int step) {
        Work x = jitter(job.rng(), 0.05);
        if (r == 2 && step >= 40) x.compute *= 1.5, x.data *= 1.5, x.optimizer *= 1.5;
        return x;
      },
      [&](const StragglerChange& c, int step) {
        for (const auto& s : c.named) {
          if (named_at < 0) named_at = step;
          cause = s.cause;
          CHECK(s.rank == 2);
        }
      });
  CHECK(named_at > 40);
  CHECK(named_at - 40 <= 60);
  CHECK(cause == "compute");

  StragglerWatch d;
  Job job2(4, 8);
  std::vector<std::string> causes;
  job2.run(
      100, d,
      [&](int r, int) {
        Work x = jitter(job2.rng(), 0.05);
        if (r == 1) x.data = 60;  // its input pipeline, not its compute
        return x;
      },
      [&](const StragglerChange& c, int) {
        for (const auto& s : c.named) causes.push_back(s.cause);
      });
  CHECK(causes == std::vector<std::string>{"data"});
}

TEST_CASE(
    "straggler: no false alarm in 3 x 2,000 healthy steps with 300 ms pauses, rotating "
    "data stalls and a busy host",
    "[straggler]") {
  for (std::uint32_t seed : {11u, 12u, 13u}) {
    // The same noise, seen by a watch that names on one slow window (windows 1): it does
    // name someone, so the noise is noise enough to test the majority of windows against.
    for (int windows : {5, 1}) {
      StragglerWatch w({muster::rendezvous::limits::kStragglerRatio,
                        muster::rendezvous::limits::kStragglerWindowSteps, windows});
      Job job(8, seed);
      std::uniform_int_distribution<int> pick(0, 7), gap(60, 140);
      int next_pause = gap(job.rng()), paused = -1;
      std::vector<int> names;
      job.run(
          2000, w,
          [&](int r, int step) {
            Work x = jitter(job.rng(), r == 3 ? 0.25 : 0.1);  // host 3 is busy: noisier
            if (r == 0 && step == next_pause) {               // every ~100 steps, a random rank
              paused = pick(job.rng());
              next_pause = step + gap(job.rng());
            }
            if (r == paused) {
              x.compute += 300;  // pauses 300 ms in this step
              paused = -1;
            }
            if ((step / 20) % 8 == r && step % 20 < 4) x.data += 40;  // data stalls that rotate
            return x;
          },
          [&](const StragglerChange& c, int) {
            for (const auto& s : c.named) names.push_back(s.rank);
          });
      INFO("seed " << seed << ", windows " << windows);
      if (windows == 1) {
        CHECK_FALSE(names.empty());
        continue;
      }
      CHECK(names.empty());
      CHECK(w.windows_closed() > 100);
    }
  }
}

TEST_CASE(
    "straggler: a rank that recovers is cleared, a new round forgets, ranks without phase "
    "times are not watched",
    "[straggler]") {
  StragglerWatch w;
  Job job(4, 5);
  std::vector<int> named, cleared;
  job.run(
      200, w,
      [&](int r, int step) {
        Work x = jitter(job.rng(), 0.05);
        if (r == 0 && step < 80) x.compute *= 2;
        return x;
      },
      [&](const StragglerChange& c, int) {
        for (const auto& s : c.named) named.push_back(s.rank);
        for (const auto& s : c.cleared) cleared.push_back(s.rank);
      });
  CHECK(named == std::vector<int>{0});
  CHECK(cleared == std::vector<int>{0});
  CHECK(w.named().empty());

  w.reset();
  CHECK(w.windows_closed() == 0);
  // Pages of a writer that keeps no phase times: nothing to compare, nothing closes.
  for (std::uint64_t step = 1; step < 50; ++step) {
    w.update(0, "a", step, {});
    w.update(1, "b", step, {});
    CHECK(w.evaluate().named.empty());
  }
  CHECK(w.windows_closed() == 0);
}

// Exclusion's rule (docs/stragglers.md, "Exclusion"): a node leaves when it runs in place, is
// not a data straggler, the run keeps MIN (or a spare takes its place), it is slower than
// N/(N-1), and it has cost more than a re-form since it was named.
TEST_CASE("exclusion: a straggler's node leaves only when leaving costs less than keeping it",
          "[straggler]") {
  using std::chrono::milliseconds;
  ExclusionCase c;
  c.nodes = 3;
  c.min_nodes = 2;
  c.in_place = true;
  c.cause = "compute";
  c.slowdown = 2.0;
  c.named_for = milliseconds(3000);
  c.reform_cost = milliseconds(1000);
  CHECK(exclusion_kept(c).empty());  // 1.5 s lost > 1 s, 2.0 > 3/2

  ExclusionCase x = c;
  x.in_place = false;
  CHECK(exclusion_kept(x) == "not every node runs in place");
  x = c;
  x.cause = "data";
  CHECK(exclusion_kept(x) == "its cause is data loading");
  x = c;
  x.min_nodes = 3;
  CHECK(exclusion_kept(x) == "at MIN nodes (3) with no spare");
  x.spare = true;  // a spare takes its place: MIN is kept
  CHECK(exclusion_kept(x).empty());
  x = c;
  x.slowdown = 1.45;  // below 3/2: the smaller world would be slower than keeping it
  CHECK(exclusion_kept(x) == "1.45x is not beyond N/(N-1) = 1.50x");
  x.spare = true;  // ... unless a spare takes its place
  x.named_for = milliseconds(10'000);
  CHECK(exclusion_kept(x).empty());
  x = c;
  x.named_for = milliseconds(1500);  // cost 0.75 s so far, a re-form 1 s
  CHECK(exclusion_kept(x) == "it has cost 0.8 s, a re-form costs 1.0 s");
  x.named_for = milliseconds(2100);
  CHECK(exclusion_kept(x).empty());
  x = c;
  x.nodes = 2;
  x.min_nodes = 1;
  x.slowdown = 1.9;  // a world of 2 halves its work without it: worth it only beyond 2x
  x.named_for = milliseconds(60'000);
  CHECK_FALSE(exclusion_kept(x).empty());
  x.slowdown = 2.5;
  CHECK(exclusion_kept(x).empty());
}

// Slow links (docs/stragglers.md, "Slow links"): nodes report their connections' rates; a node
// whose every connection is slow, both ways, is named; its peers, each with one fast
// connection, are not; two nodes name nobody; a node back to speed is cleared.
TEST_CASE("links: a node whose connections are all slow is named with cause network, its peers "
          "are not",
          "[straggler]") {
  using muster::rendezvous::LinkJudge;
  LinkJudge j;
  // A ring all-reduce of three: a -> b fast, b -> c and c -> a through c's capped link.
  auto report = [&](double c_rate) {
    j.update("a", {{"10.0.0.1", "10.0.0.2", 50}});
    j.update("b", {{"10.0.0.2", "10.0.0.3", c_rate}});
    j.update("c", {{"10.0.0.3", "10.0.0.1", c_rate}});
  };
  std::vector<std::string> named;
  for (int i = 0; i < 5; ++i) {
    report(10);
    for (const auto& s : j.evaluate().named) named.push_back(s.node);
  }
  CHECK(named == std::vector<std::string>{"c"});
  REQUIRE(j.named().count("c") == 1);
  CHECK(j.named().at("c").mbps == Approx(10));
  CHECK(j.named().at("c").median == Approx(50));
  CHECK(j.named().at("c").slowdown() == Approx(5));
  // Back to speed: cleared once most recent evaluations are fast, and reports age out.
  std::vector<std::string> cleared;
  for (int i = 0; i < 8; ++i) {
    report(50);
    for (const auto& s : j.evaluate().cleared) cleared.push_back(s.node);
  }
  CHECK(cleared == std::vector<std::string>{"c"});
  CHECK(j.named().empty());

  // Two nodes: one connection cannot say which end is slow.
  LinkJudge two;
  for (int i = 0; i < 5; ++i) {
    two.update("a", {{"10.0.0.1", "10.0.0.2", 50}});
    two.update("b", {{"10.0.0.2", "10.0.0.1", 10}});
    CHECK(two.evaluate().named.empty());
  }
  // Noise within half of the median, and one slow report, name nobody.
  LinkJudge noisy;
  for (int i = 0; i < 20; ++i) {
    const double dip = i == 7 ? 5 : 30;
    noisy.update("a", {{"10.0.0.1", "10.0.0.2", 50}});
    noisy.update("b", {{"10.0.0.2", "10.0.0.3", dip}});
    noisy.update("c", {{"10.0.0.3", "10.0.0.1", 40}});
    CHECK(noisy.evaluate().named.empty());
  }
}
