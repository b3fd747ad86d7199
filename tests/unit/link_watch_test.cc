// The slow-link rate rule (agent/link_watch.h, LinkRates) apart from its sampling: what the
// kernel's counters give as each pair of addresses' rate (docs/stragglers.md, "Slow links").
#include "muster/agent/link_watch.h"

#include <catch2/catch.hpp>

using muster::agent::kMinLinkBytes;
using muster::agent::LinkRates;

namespace {

constexpr std::uint64_t MB = 1000 * 1000;

}  // namespace

TEST_CASE("link rates: a connection's first sample gives no rate, its second its bytes over "
          "its busy time",
          "[link_watch]") {
  LinkRates r;
  r.observe(7, "10.0.0.1", "10.0.0.2", 1 * MB, 1000);
  CHECK(r.finish().empty());  // nothing to compare with yet
  r.observe(7, "10.0.0.1", "10.0.0.2", 11 * MB, 201000);  // 10 MB in 0.2 s busy
  const auto rates = r.finish();
  REQUIRE(rates.size() == 1);
  CHECK(rates[0].local() == "10.0.0.1");
  CHECK(rates[0].remote() == "10.0.0.2");
  CHECK(rates[0].mbps() == Approx(50.0));  // bytes per microsecond: MB/s
}

TEST_CASE("link rates: the busy time, not the time between samples, is the divisor, so a "
          "program's pauses do not slow a link",
          "[link_watch]") {
  LinkRates r;
  r.observe(1, "a", "b", 0, 0);
  r.finish();
  // 1 MB acknowledged over 10 ms of sending, whatever the sampler's period was.
  r.observe(1, "a", "b", 1 * MB, 10000);
  const auto rates = r.finish();
  REQUIRE(rates.size() == 1);
  CHECK(rates[0].mbps() == Approx(100.0));
}

TEST_CASE("link rates: a connection that moved less than kMinLinkBytes, or was not busy, or "
          "whose counters went back, gives no rate",
          "[link_watch]") {
  LinkRates r;
  r.observe(1, "a", "b", 0, 0);
  r.observe(2, "a", "c", 0, 0);
  r.observe(3, "a", "d", 5 * MB, 5000);
  r.finish();
  r.observe(1, "a", "b", kMinLinkBytes - 1, 100);  // a few small messages: the round trip
  r.observe(2, "a", "c", 4 * MB, 0);               // not busy since: no time to divide by
  r.observe(3, "a", "d", 1 * MB, 9000);            // counters back: another socket's inode
  CHECK(r.finish().empty());
  // The inode's new counters are the base of its next sample.
  r.observe(3, "a", "d", 3 * MB, 19000);
  const auto rates = r.finish();
  REQUIRE(rates.size() == 1);
  CHECK(rates[0].remote() == "d");
  CHECK(rates[0].mbps() == Approx(200.0));
}

TEST_CASE("link rates: per pair of addresses the best connection's rate, and a connection missing "
          "from a sample is forgotten",
          "[link_watch]") {
  LinkRates r;
  r.observe(1, "a", "b", 0, 0);
  r.observe(2, "a", "b", 0, 0);
  r.observe(3, "a", "c", 0, 0);
  r.finish();
  r.observe(1, "a", "b", 10 * MB, 1000000);  // 10 MB/s
  r.observe(2, "a", "b", 10 * MB, 100000);   // 100 MB/s: the pair's best
  r.observe(3, "a", "c", 1 * MB, 100000);    // 10 MB/s, to another peer
  auto rates = r.finish();
  REQUIRE(rates.size() == 2);
  CHECK(rates[0].remote() == "b");
  CHECK(rates[0].mbps() == Approx(100.0));
  CHECK(rates[1].remote() == "c");
  CHECK(rates[1].mbps() == Approx(10.0));
  // Connection 1 is not seen in the next sample (closed): when an inode comes back, it is new.
  r.observe(2, "a", "b", 10 * MB, 100000);
  r.finish();
  r.observe(1, "a", "b", 30 * MB, 1100000);
  CHECK(r.finish().empty());
}
