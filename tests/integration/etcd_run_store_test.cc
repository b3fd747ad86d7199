// rdzvd --etcd's replica and fenced run store (etcd.h) against a real etcd 3.4, through the
// public EtcdReplica API only: round trips, a 10,000-member record in many transactions, a
// head-only write, fencing of a replica that no longer leads, a campaign that waits for the
// leader, and a lease revoked behind a replica's back. What etcd holds is checked with
// etcdctl. Without etcd these tests report SKIPPED.
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <regex>
#include <sstream>
#include <thread>

#include "etcd_cluster.h"
#include "muster/rendezvous/etcd.h"
#include "muster/rendezvous/etcd_layout.h"
#include "muster/rendezvous/limits.h"

using namespace std::chrono_literals;
using Catch::Matchers::Contains;
using muster::rendezvous::EtcdReplica;
using muster::rendezvous::RunStore;
using muster::testing::EtcdCluster;
namespace layout = muster::rendezvous::etcd_layout;
namespace limits = muster::rendezvous::limits;
namespace v1 = muster::v1;

namespace {

std::unique_ptr<EtcdCluster> etcd_or_skip(int members = 1) {
  if (const std::string why = EtcdCluster::missing(); !why.empty()) {
    muster::testing::report_skip(why + "; scripts/setup installs it");
    return nullptr;
  }
  muster::testing::EtcdOptions o;
  o.members = members;
  return EtcdCluster::start(o);
}

// What on_lost was called with, to wait for.
struct Lost {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> whys;
  void operator()(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu);
    whys.push_back(why);
    cv.notify_all();
  }
  bool wait(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, timeout, [&] { return !whys.empty(); });
  }
  std::size_t count() {
    std::lock_guard<std::mutex> lock(mu);
    return whys.size();
  }
};

const std::string kPrefix = "/test/store/";

std::unique_ptr<EtcdReplica> connect(const std::string& endpoints, Lost& lost,
                                     const std::string& prefix = kPrefix) {
  muster::rendezvous::EtcdOptions o;
  o.endpoints = endpoints;
  o.prefix = prefix;
  auto r = EtcdReplica::connect(o, [&lost](const std::string& why) { lost(why); });
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  return std::move(*r);
}

// campaign() on a thread of its own; the destructor ends a campaign still waiting (resign)
// and joins, so a failing test leaves no thread behind.
class Campaign {
 public:
  Campaign(EtcdReplica& r, std::string name) : r_(r) {
    t_ = std::thread([this, name = std::move(name)] {
      absl::Status st = r_.campaign(name);
      std::lock_guard<std::mutex> lock(mu_);
      result_ = st;
      cv_.notify_all();
    });
  }
  ~Campaign() {
    if (!result(0ms)) r_.resign();
    t_.join();
  }
  std::optional<absl::Status> result(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, timeout, [&] { return result_.has_value(); });
    return result_;
  }

 private:
  EtcdReplica& r_;
  std::thread t_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<absl::Status> result_;
};

v1::RunRecord running(const std::string& id, int members, int ranks, int round = 1) {
  v1::RunRecord r;
  r.set_format(1);
  r.set_run_id(id);
  r.set_phase(v1::RunRecord::RUNNING);
  r.set_round(round);
  r.set_min_nodes(1);
  r.set_max_nodes(std::max(members, 1));
  r.set_max_restarts(3);
  for (int i = 0; i < members; ++i) {
    v1::Join* j = r.add_members();
    j->set_run_id(id);
    j->set_node_id("node-" + std::to_string(i));
    j->set_host("10.0." + std::to_string(i / 256) + "." + std::to_string(i % 256));
    j->set_local_world_size(8);
    j->set_master_port_candidate(20000 + i % 30000);
    j->set_requested_rank(-1);
  }
  for (int i = 0; i < ranks; ++i) {
    v1::RankOf* l = r.add_last_rank();
    l->set_node_id("node-" + std::to_string(i));
    l->set_rank(i);
  }
  return r;
}

std::vector<std::string> serialized(const std::vector<v1::RunRecord>& records) {
  std::vector<std::string> out;
  for (const auto& r : records) out.push_back(r.SerializeAsString());
  return out;
}

std::vector<v1::RunRecord> load(RunStore& store) {
  auto loaded = store.load_all();
  INFO(loaded.status().ToString());
  REQUIRE(loaded.ok());
  CHECK(loaded->skipped.empty());
  return loaded->records;
}

// Numbers of a field in etcdctl's JSON (-w json), in order.
std::vector<std::int64_t> json_numbers(const std::string& json, const std::string& field) {
  std::vector<std::int64_t> out;
  const std::regex re("\"" + field + "\":(\\d+)");
  for (auto it = std::sregex_iterator(json.begin(), json.end(), re); it != std::sregex_iterator();
       ++it) {
    out.push_back(std::stoll((*it)[1]));
  }
  return out;
}

// etcd's current revision (it goes up by one per transaction that changes anything).
std::int64_t revision(const EtcdCluster& etcd) {
  const std::string json = etcd.ctl({"get", "no-such-key", "-w", "json"});
  std::smatch m;
  REQUIRE(std::regex_search(json, m, std::regex(R"("header":\{[^}]*"revision":(\d+))")));
  return std::stoll(m[1]);
}

// How many keys start with `prefix`: a range's "count" is every key in it, whatever its limit
// (etcdctl 3.4 has no --count-only; its JSON leaves "count" out when it is 0).
std::int64_t count_keys(const EtcdCluster& etcd, const std::string& prefix) {
  const std::vector<std::int64_t> n = json_numbers(
      etcd.ctl({"get", prefix, "--prefix", "--keys-only", "--limit=1", "-w", "json"}), "count");
  return n.empty() ? 0 : n[0];
}

// The keys that start with `prefix`, in order.
std::vector<std::string> keys(const EtcdCluster& etcd, const std::string& prefix) {
  std::istringstream in(etcd.ctl({"get", prefix, "--prefix", "--keys-only"}));
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) out.push_back(line);
  }
  return out;
}

// The leases etcd holds now (`etcdctl lease list`: "found N leases" and one hex id a line).
std::vector<std::string> leases(const EtcdCluster& etcd) {
  std::istringstream in(etcd.ctl({"lease", "list"}));
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) {
    if (std::regex_match(line, std::regex("[0-9a-f]+"))) out.push_back(line);
  }
  return out;
}

}  // namespace

TEST_CASE("etcd store: put, load_all and erase round trip", "[etcd]") {
  auto etcd = etcd_or_skip();
  if (!etcd) return;
  Lost lost;
  auto a = connect(etcd->endpoints(), lost);
  REQUIRE(a->campaign("a:1").ok());
  std::shared_ptr<RunStore> store = a->run_store();
  REQUIRE(store);
  CHECK(load(*store).empty());

  const std::string odd_id = std::string("team/a/j\xc3\xa9", 10) + std::string("\0/x", 3);
  const v1::RunRecord first = running("job-a", 3, 2);
  v1::RunRecord second = running(odd_id, 2, 5);
  second.set_restart_count(2);
  v1::RunRecord joining;
  joining.set_format(1);
  joining.set_run_id("team");  // a prefix of odd_id
  joining.set_phase(v1::RunRecord::JOINING);
  REQUIRE(store->put(first).ok());
  REQUIRE(store->put(second).ok());
  REQUIRE(store->put(joining).ok());
  // By run id, as put.
  CHECK(serialized(load(*store)) == serialized({first, joining, second}));

  const v1::RunRecord replaced = running("job-a", 4, 4, 2);
  REQUIRE(store->put(replaced).ok());
  CHECK(serialized(load(*store)) == serialized({replaced, joining, second}));
  // Nothing left of the replaced generation: 4 node keys and the head.
  CHECK(count_keys(*etcd, layout::run_prefix(kPrefix, "job-a")) == 5);

  // Erasing "team" leaves the run whose id starts with it.
  REQUIRE(store->erase("team").ok());
  REQUIRE(store->erase("never-there").ok());
  CHECK(serialized(load(*store)) == serialized({replaced, second}));
  REQUIRE(store->erase(odd_id).ok());
  CHECK(count_keys(*etcd, layout::run_prefix(kPrefix, odd_id)) == 0);
  CHECK(serialized(load(*store)) == serialized({replaced}));
  CHECK(count_keys(*etcd, layout::runs_prefix(kPrefix)) == 5);

  // Another group on the same etcd sees none of it.
  Lost other_lost;
  auto other = connect(etcd->endpoints(), other_lost, "/test/other-group/");
  REQUIRE(other->campaign("o:1").ok());
  CHECK(load(*other->run_store()).empty());
  CHECK(lost.count() == 0);
}

TEST_CASE("etcd store: a record of 10,000 members round trips exactly, in many transactions",
          "[etcd]") {
  auto etcd = etcd_or_skip();
  if (!etcd) return;
  Lost lost;
  auto a = connect(etcd->endpoints(), lost);
  REQUIRE(a->campaign("a:1").ok());
  const v1::RunRecord big = running("big", 10000, 9999);
  const std::int64_t before = revision(*etcd);
  const auto t0 = std::chrono::steady_clock::now();
  REQUIRE(a->run_store()->put(big).ok());
  INFO("put took " << std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::steady_clock::now() - t0)
                          .count()
                   << " ms");
  // One revision per transaction: at least as many as 10,000 keys need at kEtcdMaxOpsPerTxn
  // each (etcd refuses more than 128 in one), and not one per key.
  const std::int64_t txns = revision(*etcd) - before;
  const std::int64_t least = (10000 + limits::kEtcdMaxOpsPerTxn - 1) / limits::kEtcdMaxOpsPerTxn;
  CHECK(txns >= least);
  CHECK(txns <= least + 1);
  CHECK(count_keys(*etcd, layout::run_prefix(kPrefix, "big")) == 10000 + 1);
  CHECK(count_keys(*etcd, layout::generation_prefix(kPrefix, "big", 1)) == 10000);

  // Read back by a replica that leads next (more keys than one page of a range read).
  a->resign();
  Lost lost_b;
  auto b = connect(etcd->endpoints(), lost_b);
  REQUIRE(b->campaign("b:1").ok());
  const std::vector<v1::RunRecord> loaded = load(*b->run_store());
  REQUIRE(loaded.size() == 1);
  CHECK(loaded[0].members_size() == 10000);
  CHECK(loaded[0].SerializeAsString() == big.SerializeAsString());

  // A smaller round replaces it whole: the 10,000 node keys go with the new head.
  const v1::RunRecord small = running("big", 3, 10000, 2);
  REQUIRE(b->run_store()->put(small).ok());
  CHECK(count_keys(*etcd, layout::run_prefix(kPrefix, "big")) == 10000 + 1);
  CHECK(count_keys(*etcd, layout::generation_prefix(kPrefix, "big", 1)) == 0);
  const v1::RunRecord smaller = running("big", 3, 0, 3);
  REQUIRE(b->run_store()->put(smaller).ok());
  CHECK(count_keys(*etcd, layout::run_prefix(kPrefix, "big")) == 3 + 1);
  CHECK(serialized(load(*b->run_store())) == serialized({smaller}));
}

TEST_CASE("etcd store: a put where only the head changes writes no node keys", "[etcd]") {
  auto etcd = etcd_or_skip();
  if (!etcd) return;
  Lost lost;
  auto a = connect(etcd->endpoints(), lost);
  REQUIRE(a->campaign("a:1").ok());
  std::shared_ptr<RunStore> store = a->run_store();
  const std::string run = layout::run_prefix(kPrefix, "job");
  const std::string head = layout::head_key(kPrefix, "job");
  auto node_json = [&] { return etcd->ctl({"get", run + "g", "--prefix", "-w", "json"}); };
  auto head_mod = [&] {
    const auto mods = json_numbers(etcd->ctl({"get", head, "-w", "json"}), "mod_revision");
    REQUIRE(mods.size() == 1);
    return mods[0];
  };

  v1::RunRecord r = running("job", 5, 5);
  REQUIRE(store->put(r).ok());
  const std::vector<std::int64_t> node_mods = json_numbers(node_json(), "mod_revision");
  REQUIRE(node_mods.size() == 5);
  const std::int64_t first = revision(*etcd);

  r.set_restart_count(1);
  r.set_round(2);
  REQUIRE(store->put(r).ok());
  // One transaction, holding the head only: the node keys are as they were.
  CHECK(revision(*etcd) == first + 1);
  CHECK(head_mod() == first + 1);
  CHECK(json_numbers(node_json(), "mod_revision") == node_mods);
  CHECK(json_numbers(node_json(), "version") == std::vector<std::int64_t>(5, 1));
  CHECK(serialized(load(*store)) == serialized({r}));

  // After a load_all (as a new leader starts), still only the head.
  r.set_round(3);
  REQUIRE(store->put(r).ok());
  CHECK(revision(*etcd) == first + 2);
  CHECK(json_numbers(node_json(), "mod_revision") == node_mods);

  // One member changes: a new generation, written whole, the old one gone.
  r.mutable_members(4)->set_host("10.9.9.9");
  REQUIRE(store->put(r).ok());
  const std::int64_t now = revision(*etcd);
  CHECK(now == first + 3);
  CHECK(json_numbers(node_json(), "mod_revision") == std::vector<std::int64_t>(5, now));
  CHECK(count_keys(*etcd, run) == 5 + 1);
  CHECK(serialized(load(*store)) == serialized({r}));
}

TEST_CASE(
    "etcd store: a replica that resigned writes nothing (FAILED_PRECONDITION), and the next "
    "leader reads its last record",
    "[etcd]") {
  // Three members, each replica on its own: the fence holds across etcd's members.
  auto etcd = etcd_or_skip(3);
  if (!etcd) return;
  Lost lost_a, lost_b;
  auto a = connect(etcd->endpoint(0), lost_a);
  auto b = connect(etcd->endpoint(2), lost_b);
  REQUIRE(a->campaign("a:1").ok());
  std::shared_ptr<RunStore> old = a->run_store();
  const v1::RunRecord r1 = running("job-1", 2, 2);
  const v1::RunRecord r2 = running("job-2", 300, 300);  // three transactions
  REQUIRE(old->put(r1).ok());
  REQUIRE(old->put(r2).ok());

  a->resign();
  const std::int64_t rev = revision(*etcd);
  const std::vector<std::string> before = keys(*etcd, kPrefix);
  // A new round (new node keys, several transactions), a head-only change, an erase: all
  // refused, and not one key written.
  v1::RunRecord r2_next = running("job-2", 300, 300, 2);
  r2_next.mutable_members(0)->set_host("10.1.1.1");
  for (absl::Status st : {old->put(r2_next), old->put(running("job-1", 2, 2, 5)),
                          old->erase("job-1"), old->put(running("job-3", 1, 0))}) {
    INFO(st.ToString());
    CHECK(st.code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(std::string(st.message()), Contains("no longer leads"));
  }
  CHECK(revision(*etcd) == rev);
  CHECK(keys(*etcd, kPrefix) == before);

  REQUIRE(b->campaign("b:1").ok());
  CHECK(serialized(load(*b->run_store())) == serialized({r1, r2}));
  REQUIRE(b->run_store()->put(r2_next).ok());
  CHECK(serialized(load(*b->run_store())) == serialized({r1, r2_next}));
  // The old store stays fenced after the new leader wrote.
  CHECK(old->put(r2).code() == absl::StatusCode::kFailedPrecondition);
  CHECK(lost_b.count() == 0);
}

TEST_CASE("etcd store: a second replica's campaign waits while the first leads", "[etcd]") {
  auto etcd = etcd_or_skip();
  if (!etcd) return;
  Lost lost_a, lost_b;
  auto a = connect(etcd->endpoints(), lost_a);
  auto b = connect(etcd->endpoints(), lost_b);
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> seen;
  b->observe([&](const std::string& leader) {
    std::lock_guard<std::mutex> lock(mu);
    seen.push_back(leader);
    cv.notify_all();
  });
  auto seen_now = [&](std::size_t n, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, timeout, [&] { return seen.size() >= n; });
    return seen;
  };
  REQUIRE(a->campaign("a:1").ok());
  CHECK(seen_now(1, 10s) == std::vector<std::string>{"a:1"});
  {
    Campaign waiting(*b, "b:1");
    REQUIRE(a->run_store()->put(running("job", 2, 2)).ok());
    // The put went through etcd after b asked; b still waits (a bounded look, as there is
    // no event for "still waiting").
    CHECK_FALSE(waiting.result(300ms).has_value());
    CHECK(a->run_store()->put(running("job", 2, 2, 2)).ok());
    a->resign();
    const std::optional<absl::Status> won = waiting.result(10s);
    REQUIRE(won.has_value());
    CHECK(won->ok());
  }
  CHECK(seen_now(2, 10s) == std::vector<std::string>{"a:1", "b:1"});
  CHECK(serialized(load(*b->run_store())) == serialized({running("job", 2, 2, 2)}));
  CHECK(b->run_store()->put(running("job", 2, 2, 3)).ok());
  CHECK(lost_a.count() == 0);
  CHECK(lost_b.count() == 0);
}

TEST_CASE("etcd store: a standby whose lease is revoked takes a new one and campaigns on, a "
          "leader whose lease is revoked gets on_lost",
          "[etcd]") {
  auto etcd = etcd_or_skip();
  if (!etcd) return;
  Lost lost_a;
  auto a = connect(etcd->endpoints(), lost_a);
  const std::vector<std::string> a_lease = leases(*etcd);
  REQUIRE(a_lease.size() == 1);
  REQUIRE(a->campaign("a:1").ok());
  REQUIRE(a->run_store()->put(running("job", 1, 1)).ok());

  // A standby whose lease goes while it waits: no on_lost (it decided nothing), a new lease,
  // and its campaign goes on under it.
  Lost lost_b;
  auto b = connect(etcd->endpoints(), lost_b);
  std::vector<std::string> b_lease = leases(*etcd);
  std::erase(b_lease, a_lease[0]);
  REQUIRE(b_lease.size() == 1);
  Campaign waiting(*b, "b:1");
  CHECK_FALSE(waiting.result(200ms).has_value());
  etcd->ctl({"lease", "revoke", b_lease[0]});
  // A bounded look (no event says "still waiting"): two of b's renewals go by.
  CHECK_FALSE(waiting.result(b->lease_ttl()).has_value());
  CHECK(lost_b.count() == 0);
  REQUIRE(a->run_store()->put(running("job", 1, 1, 2)).ok());  // a still leads

  // The leader's lease: on_lost within about a renewal, and its writes are refused.
  const auto t0 = std::chrono::steady_clock::now();
  etcd->ctl({"lease", "revoke", a_lease[0]});
  REQUIRE(lost_a.wait(a->lease_ttl() + 5s));
  INFO("on_lost after " << std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::steady_clock::now() - t0)
                               .count()
                        << " ms");
  CHECK(std::chrono::steady_clock::now() - t0 < muster::testing::scaled(a->lease_ttl()));
  CHECK_THAT(lost_a.whys[0], Contains("its lease") && Contains("expired"));
  CHECK(lost_a.count() == 1);
  CHECK(a->run_store()->put(running("job", 1, 1, 3)).code() ==
        absl::StatusCode::kFailedPrecondition);

  // The standby leads under its new lease (no key of a's is left to wait for) and finds
  // round 2.
  const std::optional<absl::Status> won = waiting.result(10s);
  REQUIRE(won.has_value());
  REQUIRE(won->ok());
  const std::vector<std::string> now = leases(*etcd);
  REQUIRE(now.size() == 1);
  CHECK(now[0] != b_lease[0]);
  CHECK(serialized(load(*b->run_store())) == serialized({running("job", 1, 1, 2)}));
  CHECK(b->run_store()->put(running("job", 1, 1, 4)).ok());
  CHECK(lost_b.count() == 0);
}

TEST_CASE("etcd store: a dead leader's unfinished write is ignored, and goes with the next head",
          "[etcd]") {
  auto etcd = etcd_or_skip();
  if (!etcd) return;
  Lost lost_a;
  auto a = connect(etcd->endpoints(), lost_a);
  REQUIRE(a->campaign("a:1").ok());
  const v1::RunRecord r = running("job", 3, 3);
  REQUIRE(a->run_store()->put(r).ok());
  a->resign();
  // As if a leader had died writing generation 0xff: two node keys, no head naming them.
  etcd->ctl({"put", layout::node_key(kPrefix, "job", 0xff, 0), "x"});
  etcd->ctl({"put", layout::node_key(kPrefix, "job", 0xff, 7), "y"});

  Lost lost_b;
  auto b = connect(etcd->endpoints(), lost_b);
  REQUIRE(b->campaign("b:1").ok());
  CHECK(serialized(load(*b->run_store())) == serialized({r}));
  // A new round goes to a generation above every one seen, and its head takes the rest away.
  const v1::RunRecord next = running("job", 2, 3, 2);
  REQUIRE(b->run_store()->put(next).ok());
  std::vector<std::string> want;
  for (int i = 0; i < 3; ++i) want.push_back(layout::node_key(kPrefix, "job", 0x100, i));
  want.push_back(layout::head_key(kPrefix, "job"));
  CHECK(keys(*etcd, layout::run_prefix(kPrefix, "job")) == want);
  CHECK(serialized(load(*b->run_store())) == serialized({next}));
}
