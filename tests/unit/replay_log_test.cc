// What an agent keeps to write again on a new stream (rendezvous/src/client/replay_log.h): per
// key the writes since its last SET or DELETE, ADDs and APPENDs in a row merged, bounded.
#include "client/replay_log.h"

#include <catch2/catch.hpp>
#include <map>
#include <string>
#include <vector>

namespace wire = muster::rendezvous::tcpstore;
using wire::Op;
using wire::Request;

namespace {

Request req(Op op, std::vector<std::string> keys, std::vector<std::string> values = {},
            std::int64_t delta = 0) {
  Request r;
  r.op = op;
  r.keys = std::move(keys);
  r.values = std::move(values);
  r.delta = delta;
  return r;
}

// The frames, parsed back (after the VALIDATE that starts them).
std::vector<Request> parsed(const wire::ReplayLog& log) {
  std::vector<Request> out;
  wire::Dialect d = wire::Dialect::kUnknown;
  const wire::FrameLimits limits{4096, 1 << 20, 100, 2 << 20};
  for (const std::string& f : log.frames()) {
    Request r;
    const auto got = wire::parse(d, f.data(), f.size(), limits, r);
    REQUIRE(got.what == wire::Parsed::kRequest);
    REQUIRE(got.consumed == f.size());
    out.push_back(r);
  }
  REQUIRE(!out.empty());
  CHECK(out.front().op == Op::kValidate);
  out.erase(out.begin());
  return out;
}

}  // namespace

TEST_CASE("replay log: a SET or DELETE starts a key again, ADDs and APPENDs in a row merge",
          "[store_relay]") {
  wire::ReplayLog log(1 << 20);
  log.note(req(Op::kSet, {"a"}, {"1"}));
  log.note(req(Op::kSet, {"a"}, {"2"}));
  log.note(req(Op::kAdd, {"n"}, {}, 2));
  log.note(req(Op::kAdd, {"n"}, {}, 3));
  log.note(req(Op::kAppend, {"s"}, {"x"}));
  log.note(req(Op::kAppend, {"s"}, {"y"}));
  log.note(req(Op::kSet, {"gone"}, {"v"}));
  log.note(req(Op::kDelete, {"gone"}));
  log.note(req(Op::kMultiSet, {"m1", "m2"}, {"v1", "v2"}));
  log.note(req(Op::kCompareSet, {"c"}, {"", "first"}));
  log.note(req(Op::kGet, {"a"}));   // reads are not kept
  log.note(req(Op::kWait, {"a"}));
  const auto frames = parsed(log);
  std::map<std::string, std::vector<Request>> by_key;
  for (const Request& r : frames) by_key[r.keys[0]].push_back(r);
  REQUIRE(by_key["a"].size() == 1);
  CHECK(by_key["a"][0].op == Op::kSet);
  CHECK(by_key["a"][0].values[0] == "2");
  REQUIRE(by_key["n"].size() == 1);
  CHECK(by_key["n"][0].delta == 5);
  REQUIRE(by_key["s"].size() == 1);
  CHECK(by_key["s"][0].values[0] == "xy");
  REQUIRE(by_key["gone"].size() == 1);
  CHECK(by_key["gone"][0].op == Op::kDelete);
  CHECK(by_key["m1"][0].values[0] == "v1");
  CHECK(by_key["m2"][0].values[0] == "v2");
  REQUIRE(by_key["c"].size() == 1);
  CHECK(by_key["c"][0].op == Op::kCompareSet);
  CHECK(by_key["c"][0].values[1] == "first");
  CHECK(log.writes() == frames.size());
  CHECK(log.complete());
}

TEST_CASE("replay log: a SET after ADDs keeps the SET and what follows it", "[store_relay]") {
  wire::ReplayLog log(1 << 20);
  log.note(req(Op::kAdd, {"n"}, {}, 7));
  log.note(req(Op::kSet, {"n"}, {"10"}));
  log.note(req(Op::kAdd, {"n"}, {}, 1));
  const auto frames = parsed(log);
  REQUIRE(frames.size() == 2);
  CHECK(frames[0].op == Op::kSet);
  CHECK(frames[1].op == Op::kAdd);
  CHECK(frames[1].delta == 1);
}

TEST_CASE("replay log: past its bound it keeps nothing and says it is not complete",
          "[store_relay]") {
  wire::ReplayLog log(1000);
  log.note(req(Op::kSet, {"small"}, {"v"}));
  CHECK(log.complete());
  log.note(req(Op::kSet, {"big"}, {std::string(2000, 'x')}));
  CHECK_FALSE(log.complete());
  CHECK(log.empty());
  log.note(req(Op::kSet, {"later"}, {"v"}));
  CHECK(log.empty());  // stopped for good: a later write alone would be a wrong replay
}
