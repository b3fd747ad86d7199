// The TCPStore-protocol table's word to the agents that answer reads of their own node's SETs
// (table.h, KeyHolder): who is told, when, and that the word comes before what a write wakes.
#include <catch2/catch.hpp>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "store/tcpstore/table.h"

using namespace muster::rendezvous;
using tcpstore::Op;
using tcpstore::Request;

namespace {

// The order of everything the table does, across connections and holders.
using Log = std::vector<std::string>;

struct FakeHolder : tcpstore::KeyHolder {
  FakeHolder(std::string name, Log& log) : name(std::move(name)), log(log) {}
  void dropped(int round, const std::string& key) override {
    log.push_back(name + " dropped " + key + " of round " + std::to_string(round));
  }
  std::string name;
  Log& log;
};

struct FakeConn : tcpstore::Conn {
  FakeConn(std::string name, Log& log) : name(std::move(name)), log(log) {}
  void flush() override {
    if (!out.empty()) log.push_back(name + " got a reply");
    out.clear();
  }
  void fail(const std::string& why) override { log.push_back(name + " failed: " + why); }
  std::string name;
  Log& log;
};

Request req(Op op, std::vector<std::string> keys, std::vector<std::string> values = {}) {
  Request r;
  r.op = op;
  r.keys = std::move(keys);
  r.values = std::move(values);
  return r;
}

struct Fixture {
  Log log;
  tcpstore::Table table{StoreLimits{}, 100, 7};
  std::shared_ptr<FakeHolder> a = std::make_shared<FakeHolder>("agent a", log);
  std::shared_ptr<FakeHolder> b = std::make_shared<FakeHolder>("agent b", log);
  std::shared_ptr<FakeConn> conn(const std::string& name, std::shared_ptr<FakeHolder> h) {
    auto c = std::make_shared<FakeConn>(name, log);
    c->dialect = tcpstore::Dialect::kTorch2;
    c->holder = h;
    return c;
  }
  void serve(const std::shared_ptr<FakeConn>& c, Request r) {
    table.serve(c, r);
    c->flush();
  }
};

}  // namespace

TEST_CASE("tcpstore table: the agent whose node set a key is told when another node writes it, "
          "before anything that write wakes",
          "[tcpstore_table]") {
  Fixture f;
  auto a1 = f.conn("a1", f.a), a2 = f.conn("a2", f.a), b1 = f.conn("b1", f.b);
  f.serve(a1, req(Op::kSet, {"k"}, {"1"}));
  CHECK(f.table.held_keys() == 1);
  // Another connection of the same node writes it: its agent knows already, nobody is told.
  f.serve(a2, req(Op::kSet, {"k"}, {"2"}));
  CHECK(f.log.empty());
  // A WAIT of b's parked on "done"; b's write of "k" then "done": a hears of "k" first.
  f.serve(b1, req(Op::kWait, {"done"}));
  auto b2 = f.conn("b2", f.b);
  f.serve(b2, req(Op::kSet, {"k"}, {"3"}));
  REQUIRE(f.log == Log{"agent a dropped k of round 7"});
  f.serve(b2, req(Op::kSet, {"done"}, {"x"}));
  CHECK(f.log == Log{"agent a dropped k of round 7", "b1 got a reply"});
  // b holds "k" now: a's write tells b, not a.
  f.log.clear();
  f.serve(a1, req(Op::kSet, {"k"}, {"4"}));
  CHECK(f.log == Log{"agent b dropped k of round 7"});
}

TEST_CASE("tcpstore table: a write whose value the writer's agent cannot know leaves the key "
          "held by nobody and a connection without an agent that keeps holds nothing",
          "[tcpstore_table]") {
  Fixture f;
  auto a1 = f.conn("a1", f.a), b1 = f.conn("b1", f.b);
  auto plain = f.conn("plain", nullptr);
  SECTION("the holder's own ADD") {
    f.serve(a1, req(Op::kSet, {"n"}, {"5"}));
    Request add = req(Op::kAdd, {"n"});
    add.delta = 1;
    f.serve(a1, add);
    CHECK(f.table.held_keys() == 0);
    f.log.clear();
    f.serve(b1, req(Op::kSet, {"n"}, {"9"}));
    CHECK(f.log.empty());  // a forgot it when it sent the ADD
  }
  SECTION("another node's DELETE, COMPARE_SET and APPEND") {
    for (Request w : {req(Op::kDelete, {"k"}), req(Op::kCompareSet, {"k"}, {"1", "2"}),
                      req(Op::kAppend, {"k"}, {"+"})}) {
      f.serve(a1, req(Op::kSet, {"k"}, {"1"}));
      f.log.clear();
      f.serve(b1, w);
      CHECK(f.log.front() == "agent a dropped k of round 7");
      CHECK(f.table.held_keys() == 0);
    }
  }
  SECTION("MULTI_SET holds each key; a plain connection's write tells the holder") {
    f.serve(a1, req(Op::kMultiSet, {"x", "y"}, {"1", "2"}));
    CHECK(f.table.held_keys() == 2);
    f.serve(plain, req(Op::kSet, {"y"}, {"3"}));
    CHECK(f.log == Log{"agent a dropped y of round 7"});
    CHECK(f.table.held_keys() == 1);
  }
  SECTION("a holder gone is not told") {
    f.serve(a1, req(Op::kSet, {"k"}, {"1"}));
    f.a.reset();
    a1->holder.reset();
    f.serve(b1, req(Op::kSet, {"k"}, {"2"}));
    CHECK(f.log.empty());
    CHECK(f.table.held_keys() == 1);  // b's now
  }
}
