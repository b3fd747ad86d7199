// The store relay's per-world rules apart from its sockets and stream
// (rendezvous/src/client/relay_rules.h): the node's read cache, combined ADDs and their answers,
// write-behind on a fake clock, WAIT groups, and the owner check (with PeerUid's
// /proc/net/tcp rule on a table of fake peers).
#include "client/relay_rules.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <sstream>

#include "client/peer_uid.h"

using muster::rendezvous::relay::combined_answers;
using muster::rendezvous::relay::WorldCache;
using muster::rendezvous::relay::WriteBehind;
using muster::rendezvous::tcpstore::Op;
using muster::rendezvous::tcpstore::Request;
using namespace std::chrono_literals;

namespace {

Request req(Op op, std::vector<std::string> keys, std::vector<std::string> values = {}) {
  Request r;
  r.op = op;
  r.keys = std::move(keys);
  r.values = std::move(values);
  return r;
}

// A reply as the wire has it: a value is its 8-byte length, then its bytes.
std::string bytes_reply(const std::vector<std::string>& values) {
  std::string out;
  for (const std::string& v : values) {
    const std::uint64_t n = v.size();
    out.append(reinterpret_cast<const char*>(&n), 8);
    out += v;
  }
  return out;
}

}  // namespace

TEST_CASE("relay cache: a node's SET answers its GET, MULTI_GET, CHECK and WAIT here, and a key "
          "it did not set goes to the server",
          "[relay_rules]") {
  WorldCache cache(1 << 20);
  cache.remember(req(Op::kSet, {"a"}, {"1"}), true);
  cache.remember(req(Op::kMultiSet, {"b", "c"}, {"22", "333"}), true);
  std::string out;
  CHECK(cache.answer(req(Op::kGet, {"a"}), out));
  CHECK(out == bytes_reply({"1"}));
  out.clear();
  CHECK(cache.answer(req(Op::kMultiGet, {"c", "b"}), out));
  CHECK(out == bytes_reply({"333", "22"}));
  out.clear();
  CHECK(cache.answer(req(Op::kCheck, {"a", "b"}), out));
  CHECK(out == std::string(1, '\0'));  // kCheckReady
  out.clear();
  CHECK(cache.answer(req(Op::kWait, {"c"}), out));
  CHECK(out == std::string(1, '\0'));  // kStopWaiting
  out.clear();
  CHECK_FALSE(cache.answer(req(Op::kGet, {"elsewhere"}), out));
  CHECK_FALSE(cache.answer(req(Op::kMultiGet, {"a", "elsewhere"}), out));
  CHECK_FALSE(cache.answer(req(Op::kAdd, {"a"}), out));  // not a read
  CHECK(out.empty());
  CHECK(cache.size() == 3);
  CHECK(cache.bytes() == 1 + 1 + 1 + 2 + 1 + 3);
}

TEST_CASE("relay cache: any write but a SET forgets its key, its value is the server's to say",
          "[relay_rules]") {
  for (Op op : {Op::kAdd, Op::kAppend, Op::kCompareSet, Op::kDelete}) {
    WorldCache cache(1 << 20);
    cache.remember(req(Op::kSet, {"k"}, {"v"}), true);
    cache.remember(req(op, {"k"}, {"x", "y"}), true);
    std::string out;
    CHECK_FALSE(cache.answer(req(Op::kGet, {"k"}), out));
    CHECK(cache.bytes() == 0);
  }
  WorldCache cache(1 << 20);
  cache.remember(req(Op::kSet, {"k"}, {"old"}), true);
  cache.remember(req(Op::kSet, {"k"}, {"newer"}), true);  // the last SET is the value
  std::string out;
  CHECK(cache.answer(req(Op::kGet, {"k"}), out));
  CHECK(out == bytes_reply({"newer"}));
  CHECK(cache.bytes() == 1 + 5);
  cache.forget("k");  // the server said another node wrote it (dropped)
  CHECK_FALSE(cache.answer(req(Op::kGet, {"k"}), out));
}

TEST_CASE("relay cache: within its bound only, off when the node does not cache, and emptied "
          "at once for a new server",
          "[relay_rules]") {
  WorldCache cache(10);
  cache.remember(req(Op::kSet, {"a"}, {"12345"}), true);  // 6 bytes
  cache.remember(req(Op::kSet, {"b"}, {"1234"}), true);   // 5 more: over 10, not kept
  std::string out;
  CHECK(cache.answer(req(Op::kGet, {"a"}), out));
  CHECK_FALSE(cache.answer(req(Op::kGet, {"b"}), out));
  CHECK(cache.bytes() == 6);
  // A SET that no longer fits forgets the key's older value too.
  cache.remember(req(Op::kSet, {"a"}, {"123456789012"}), true);
  CHECK_FALSE(cache.answer(req(Op::kGet, {"a"}), out));
  CHECK(cache.bytes() == 0);

  cache.remember(req(Op::kSet, {"c"}, {"1"}), false);  // caching off (store_cache=false)
  CHECK_FALSE(cache.answer(req(Op::kGet, {"c"}), out));
  cache.remember(req(Op::kSet, {"d"}, {"1"}), true);
  cache.forget_all();
  CHECK_FALSE(cache.answer(req(Op::kGet, {"d"}), out));
  CHECK(cache.size() == 0);
  CHECK(cache.bytes() == 0);
}

TEST_CASE("relay combined ADD: each member gets what it would have had with the ADDs one after "
          "another, in their order",
          "[relay_rules]") {
  // The key was 10; members added 1, 5, -2: the server's answer to the sum (4) is 14.
  CHECK(combined_answers(14, {1, 5, -2}) == std::vector<std::int64_t>{11, 16, 14});
  CHECK(combined_answers(7, {7}) == std::vector<std::int64_t>{7});
  CHECK(combined_answers(3, {}).empty());
  // Wrapping as the server's 64-bit sum does.
  const std::int64_t max = std::numeric_limits<std::int64_t>::max();
  const std::int64_t min = std::numeric_limits<std::int64_t>::min();
  CHECK(combined_answers(min, {1, 0}) == std::vector<std::int64_t>{min, min});
  CHECK(combined_answers(min + 1, {1, 1}) == std::vector<std::int64_t>{min, min + 1});
  CHECK(combined_answers(max, {max, 0}) == std::vector<std::int64_t>{max, max});
}

TEST_CASE("relay write-behind: a held write goes up `quiet` after it when the workers sent "
          "nothing more, `busy` after it when they did",
          "[relay_rules]") {
  const WriteBehind::Clock::time_point t0{};
  WriteBehind b(100us, 2000us);
  CHECK_FALSE(b.holding());
  CHECK_FALSE(b.due().has_value());
  CHECK(b.held(t0));              // the first: the caller arms its timer
  CHECK_FALSE(b.held(t0 + 10us));  // later ones ride with it
  REQUIRE(b.due().has_value());
  CHECK(*b.due() == t0 + 100us);
  SECTION("quiet: no query since the first held write, it goes up at `quiet`") {
    CHECK(b.fired(t0 - 5us));
    b.sent();
    CHECK_FALSE(b.holding());
    CHECK_FALSE(b.due().has_value());
  }
  SECTION("busy: a query came after it, the timer waits on to `busy` (one wake-up)") {
    CHECK_FALSE(b.fired(t0 + 50us));
    REQUIRE(b.due().has_value());
    CHECK(*b.due() == t0 + 2000us);
    CHECK(b.fired(t0 + 1900us));  // the second firing sends, busy or not
    b.sent();
    // The next held write starts quiet again.
    CHECK(b.held(t0 + 3000us));
    CHECK(*b.due() == t0 + 3100us);
  }
}

TEST_CASE("relay write-behind: as queries come, what is held is overdue at `busy`, and a query "
          "that waits takes it up at once",
          "[relay_rules]") {
  const WriteBehind::Clock::time_point t0{};
  WriteBehind b(100us, 2000us);
  CHECK_FALSE(b.overdue(t0 + 5000us));  // nothing held
  b.held(t0);
  CHECK_FALSE(b.overdue(t0 + 1999us));
  CHECK(b.overdue(t0 + 2000us));
  b.sent();  // a query that waits went up, and what was held with it
  CHECK_FALSE(b.holding());
  CHECK_FALSE(b.fired(t0 + 3000us));  // a timer that fires after: nothing to send
}

TEST_CASE("relay write-behind: with `quiet` as long as `busy` the timer fires once", "[relay_rules]") {
  const WriteBehind::Clock::time_point t0{};
  WriteBehind b(2000us, 2000us);
  b.held(t0);
  CHECK(b.fired(t0 + 500us));
}

using Groups = muster::rendezvous::relay::WaitGroups<int>;

TEST_CASE("relay WAIT groups: the first WAIT for some keys leads, later ones for the same keys "
          "ride on it and are answered with it",
          "[relay_rules]") {
  Groups g;
  CHECK_FALSE(g.has({"k"}));
  CHECK(g.lead(1, {"k"}));
  CHECK(g.has({"k"}));
  CHECK_FALSE(g.has({"k", "j"}));  // other keys: another group
  CHECK_FALSE(g.lead(2, {"k"}));   // one group per keys: 2 rides instead
  g.follow(2, {"k"});
  g.follow(3, {"k"});
  CHECK(g.leads(1));
  CHECK(g.follows(2));
  CHECK(g.follows(3));
  auto ended = g.answered(1);
  REQUIRE(ended.has_value());
  CHECK(ended->keys == std::vector<std::string>{"k"});
  CHECK(ended->followers == std::vector<int>{2, 3});
  CHECK_FALSE(g.has({"k"}));
  CHECK_FALSE(g.leads(1));
  CHECK_FALSE(g.follows(2));
  CHECK(g.size() == 0);
  CHECK_FALSE(g.answered(1).has_value());  // once
  CHECK_FALSE(g.answered(2).has_value());  // a follower leads nothing
}

TEST_CASE("relay WAIT groups: a group's name tells keys apart by their lengths", "[relay_rules]") {
  CHECK(Groups::name_of({"a:b"}) != Groups::name_of({"a", "b"}));
  CHECK(Groups::name_of({"ab", "c"}) != Groups::name_of({"a", "bc"}));
  Groups g;
  CHECK(g.lead(1, {"a:b"}));
  CHECK(g.lead(2, {"a", "b"}));
  CHECK(g.size() == 2);
}

TEST_CASE("relay WAIT groups: a leader that goes hands its group to the last follower, which "
          "must ask for itself, and none left or its connections closing ends the group",
          "[relay_rules]") {
  Groups g;
  g.lead(1, {"k"});
  g.follow(2, {"k"});
  g.follow(3, {"k"});
  auto next = g.hand_on(1, false);
  REQUIRE(next.has_value());
  CHECK(next->leader == 3);
  CHECK(next->keys == std::vector<std::string>{"k"});
  CHECK(g.leads(3));
  CHECK_FALSE(g.follows(3));
  CHECK_FALSE(g.leads(1));
  CHECK(g.follows(2));
  // The new leader answered: 2 with it.
  auto ended = g.answered(3);
  REQUIRE(ended.has_value());
  CHECK(ended->followers == std::vector<int>{2});

  g.lead(4, {"j"});
  CHECK_FALSE(g.hand_on(4, false).has_value());  // nobody rode on it
  CHECK_FALSE(g.has({"j"}));
  g.lead(5, {"j"});
  g.follow(6, {"j"});
  CHECK_FALSE(g.hand_on(5, true).has_value());  // closing: no WAIT is handed on
  CHECK_FALSE(g.follows(6));
  CHECK(g.size() == 0);
  CHECK_FALSE(g.hand_on(7, false).has_value());  // leads nothing
}

TEST_CASE("relay WAIT groups: a follower that goes or sends more leaves its group, the others "
          "stay in it",
          "[relay_rules]") {
  Groups g;
  g.lead(1, {"k"});
  for (int f = 2; f <= 5; ++f) g.follow(f, {"k"});
  auto keys = g.leave(3);  // from the middle
  REQUIRE(keys.has_value());
  CHECK(*keys == std::vector<std::string>{"k"});
  CHECK_FALSE(g.follows(3));
  CHECK_FALSE(g.leave(3).has_value());  // once
  CHECK(g.leave(5).has_value());        // the last
  CHECK_FALSE(g.leave(1).has_value());  // the leader follows nothing
  auto ended = g.answered(1);
  REQUIRE(ended.has_value());
  std::vector<int> rest = ended->followers;
  std::sort(rest.begin(), rest.end());
  CHECK(rest == std::vector<int>{2, 4});
}

using Adds = muster::rendezvous::relay::AddCombiner<int>;

TEST_CASE("relay combined ADD: ADDs of a key gather while none of it flies, go up as their sum "
          "on the launch, and the next ones gather behind it",
          "[relay_rules]") {
  Adds a;
  CHECK(a.join("k", 1, 2));         // the first: the caller posts a launch
  CHECK_FALSE(a.join("k", 2, 3));   // queued already
  CHECK(a.join("other", 9, 1));     // keys apart
  CHECK_FALSE(a.launch("k", false).has_value());  // no stream: nothing goes, no longer queued
  CHECK(a.flying_members("k") == 0);
  // The new stream finds it waiting ("other" is queued still) and queues its launch.
  CHECK(a.unlaunched() == std::vector<std::string>{"k"});
  CHECK(a.unlaunched().empty());    // queued now
  CHECK_FALSE(a.join("k", 3, 5));   // it gathers on
  auto sum = a.launch("k", true);
  REQUIRE(sum.has_value());
  CHECK(*sum == 10);
  CHECK(a.flying_members("k") == 3);
  CHECK_FALSE(a.join("k", 4, 7));   // flies: gathers behind it, no launch
  CHECK_FALSE(a.launch("k", true).has_value());  // one flies already
  auto r = a.answer(110);           // the server had 100 before
  REQUIRE(r.has_value());
  CHECK(r->key == "k");
  REQUIRE(r->each.size() == 3);
  CHECK(r->each[0] == std::pair<int, std::int64_t>{1, 102});
  CHECK(r->each[1] == std::pair<int, std::int64_t>{2, 105});
  CHECK(r->each[2] == std::pair<int, std::int64_t>{3, 110});
  CHECK(r->launch_next);            // 4's ADD waits
  sum = a.launch("k", true);
  REQUIRE(sum.has_value());
  CHECK(*sum == 7);
  r = a.answer(117);
  REQUIRE(r.has_value());
  CHECK(r->each == std::vector<std::pair<int, std::int64_t>>{{4, 117}});
  CHECK_FALSE(r->launch_next);
  CHECK_FALSE(a.flying());
  CHECK(a.keys() == 1);             // "other" only: "k" is gone with its last answer
  CHECK_FALSE(a.answer(1).has_value());  // nothing flies
}

TEST_CASE("relay combined ADD: answers come in the order the ADDs went, across keys",
          "[relay_rules]") {
  Adds a;
  a.join("x", 1, 1);
  a.join("y", 2, 10);
  REQUIRE(a.launch("y", true).has_value());
  REQUIRE(a.launch("x", true).has_value());
  auto r = a.answer(10);
  REQUIRE(r.has_value());
  CHECK(r->key == "y");
  r = a.answer(1);
  REQUIRE(r.has_value());
  CHECK(r->key == "x");
  CHECK(a.keys() == 0);
}

TEST_CASE("relay combined ADD: the server failing the first flying ADD loses its members only: "
          "the later ones go again in their order, and its key's next batch is launched again",
          "[relay_rules]") {
  Adds a;
  a.join("x", 1, 1);
  a.join("x", 2, 1);
  a.launch("x", true);
  a.join("y", 3, 5);
  a.launch("y", true);
  a.join("z", 4, 6);
  a.launch("z", true);
  a.join("x", 5, 1);  // gathers behind x's flying one
  auto f = a.first_failed();
  CHECK(f.lost == std::vector<int>{1, 2});
  REQUIRE(f.relaunch.has_value());
  CHECK(*f.relaunch == "x");
  CHECK(a.resend() == std::vector<std::pair<std::string, std::int64_t>>{{"y", 5}, {"z", 6}});
  CHECK(a.answer(5)->key == "y");  // the resent ones are answered in their order
  CHECK(a.answer(6)->key == "z");
  auto sum = a.launch("x", true);  // the relaunch
  REQUIRE(sum.has_value());
  CHECK(*sum == 1);
  // A failed key with nothing behind it is gone.
  f = a.first_failed();
  CHECK(f.lost == std::vector<int>{5});
  CHECK_FALSE(f.relaunch.has_value());
  CHECK(a.keys() == 0);
  CHECK(a.first_failed().lost.empty());  // nothing flies
}

TEST_CASE("relay combined ADD: a lost stream loses every flying ADD's members, keeps what "
          "gathers behind them for the new stream",
          "[relay_rules]") {
  Adds a;
  a.join("x", 1, 1);
  a.launch("x", true);
  a.join("x", 2, 1);  // behind it
  a.join("y", 3, 1);
  a.launch("y", true);
  std::vector<int> lost = a.lose_flying();
  std::sort(lost.begin(), lost.end());
  CHECK(lost == std::vector<int>{1, 3});
  CHECK_FALSE(a.flying());
  CHECK(a.keys() == 1);  // y had nothing behind it
  CHECK(a.unlaunched() == std::vector<std::string>{"x"});
  auto sum = a.launch("x", true);
  REQUIRE(sum.has_value());
  CHECK(*sum == 1);
  CHECK(a.flying_members("x") == 1);
}

TEST_CASE("relay owner check: only an IPv4 connection the kernel says is the relay's own user's "
          "is let in, one whose owner is not known is refused",
          "[relay_rules]") {
  using muster::rendezvous::relay::Owner;
  using muster::rendezvous::relay::owner_check;
  CHECK(owner_check(true, absl::StatusOr<uid_t>(1000), 1000) == Owner::kMine);
  CHECK(owner_check(true, absl::StatusOr<uid_t>(0), 1000) == Owner::kOtherUser);
  CHECK(owner_check(true, absl::StatusOr<uid_t>(absl::NotFoundError("gone")), 1000) ==
        Owner::kUnknown);
  CHECK(owner_check(false, absl::StatusOr<uid_t>(1000), 1000) == Owner::kNotIpv4);
}

TEST_CASE("relay owner check: /proc/net/tcp's line for the connection's two ends names its owner",
          "[relay_rules]") {
  using muster::rendezvous::PeerUid;
  auto addr = [](std::uint32_t host_order_ip, std::uint16_t port) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(host_order_ip);
    a.sin_port = htons(port);
    return a;
  };
  const sockaddr_in worker = addr(0x7F000001, 40000), relay = addr(0x7F000001, 29500);
  // As the kernel prints it: addresses in network order as hex, ports in host order as hex.
  // 40000 = 0x9C40, 29500 = 0x733C; 127.0.0.1 reads 0100007F.
  const std::string table =
      "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
      "   0: 0100007F:733C 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1\n"
      "   1: 0100007F:733C 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 2 1\n"
      "   2: 0100007F:9C40 0100007F:733C 01 00000000:00000000 00:00000000 00000000  1000        0 3 1\n";
  std::istringstream in(table);
  auto uid = PeerUid::owner_in_table(in, worker, relay);
  REQUIRE(uid.ok());
  CHECK(*uid == 1000);  // the worker's end, not the relay's (line 1, uid 0)
  std::istringstream again(table);
  CHECK(absl::IsNotFound(PeerUid::owner_in_table(again, addr(0x7F000001, 40001), relay).status()));
  std::istringstream empty("");
  CHECK_FALSE(PeerUid::owner_in_table(empty, worker, relay).ok());
}
