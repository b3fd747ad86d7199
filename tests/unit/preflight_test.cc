// launch --preflight's pure parts (agent/preflight.h): the probe rounds over the ring and the
// verdict over made-up measurements.
#include "muster/agent/preflight.h"

#include <catch2/catch.hpp>
#include <map>
#include <set>

namespace pf = muster::agent::preflight;

TEST_CASE("preflight: the probe rounds cover the ring once, no node twice in a round",
          "[preflight]") {
  CHECK(pf::schedule(0).empty());
  CHECK(pf::schedule(1).empty());
  REQUIRE(pf::schedule(2).size() == 1);
  CHECK(pf::schedule(2)[0] == std::vector<pf::Edge>{pf::Edge{0, 1}});
  for (int n = 3; n <= 9; ++n) {
    INFO("n = " << n);
    const auto rounds = pf::schedule(n);
    CHECK(rounds.size() == (n % 2 ? 3u : 2u));
    std::set<std::pair<int, int>> edges;
    for (const auto& round : rounds) {
      std::set<int> busy;
      for (const pf::Edge& e : round) {
        CHECK(busy.insert(e.from).second);
        CHECK(busy.insert(e.to).second);
        CHECK(edges.insert({e.from, e.to}).second);
      }
    }
    CHECK(edges.size() == static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) CHECK(edges.count({i, (i + 1) % n}) == 1);
  }
}

namespace {

// Each probe of the ring at the slower of its two nodes' links.
std::vector<pf::Measured> ring(const std::vector<double>& link) {
  std::vector<pf::Measured> out;
  const int n = static_cast<int>(link.size());
  for (const auto& round : pf::schedule(n)) {
    for (const pf::Edge& e : round) {
      out.push_back({e, std::min(link[static_cast<std::size_t>(e.from)],
                                 link[static_cast<std::size_t>(e.to)])});
    }
  }
  return out;
}

}  // namespace

TEST_CASE("preflight: a node whose link is a fifth of the others' is named, its neighbours are "
          "not",
          "[preflight]") {
  const std::vector<double> compute(5, 1000);
  for (int slow = 0; slow < 5; ++slow) {
    std::vector<double> link(5, 50);
    link[static_cast<std::size_t>(slow)] = 10;
    const pf::Verdict v = pf::judge(5, ring(link), compute);
    CHECK(v.slow_link == std::vector<int>{slow});
    CHECK(v.slow_compute.empty());
    CHECK(v.named(slow));
    CHECK_THAT(v.why(slow), Catch::Contains("its link moved 10.0 MB/s at best, the nodes' "
                                            "median is 50.0 MB/s"));
    CHECK(v.why((slow + 1) % 5).empty());
  }
  // Three nodes, the middle one capped.
  const pf::Verdict three = pf::judge(3, ring({50, 10, 50}), {1000, 1000, 1000});
  CHECK(three.slow_link == std::vector<int>{1});
  // Two: the one probe cannot say which end is slow; nobody is named.
  const pf::Verdict two = pf::judge(2, ring({50, 10}), {1000, 1000});
  CHECK(two.slow_link.empty());
  CHECK_FALSE(two.named(0));
  CHECK_FALSE(two.named(1));
}

TEST_CASE("preflight: noise within half of the median names nobody, a slow compute is named",
          "[preflight]") {
  const pf::Verdict noisy = pf::judge(4, ring({50, 31, 44, 58}), {1000, 700, 1200, 900});
  CHECK(noisy.slow_link.empty());
  CHECK(noisy.slow_compute.empty());
  const pf::Verdict cpu = pf::judge(4, ring({50, 50, 50, 50}), {1000, 300, 1100, 950});
  CHECK(cpu.slow_compute == std::vector<int>{1});
  CHECK_THAT(cpu.why(1), Catch::Contains("its compute scored 300, the nodes' median is 975"));
  // A node that measured nothing (0) is neither named nor counted in the median.
  const pf::Verdict missing = pf::judge(3, ring({50, 50, 50}), {1000, 0, 1000});
  CHECK(missing.slow_compute.empty());
}

TEST_CASE("preflight: the compute kernel scores a positive rate", "[preflight]") {
  CHECK(pf::compute_score(std::chrono::milliseconds(20)) > 0);
}
