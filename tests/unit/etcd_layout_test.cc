// rdzvd --etcd's key layout (etcd_layout.h), pure: records split into a head and node keys
// and joined back byte for byte, keys that stay under their run's prefix, and what join()
// skips or ignores in what it reads back (a damaged generation, a dead leader's half write,
// a head under another run's key).
#include "muster/rendezvous/etcd_layout.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <map>
#include <set>
#include <string>

namespace layout = muster::rendezvous::etcd_layout;
namespace v1 = muster::v1;
using Catch::Matchers::Contains;

namespace {

const std::string kPrefix = "/muster/rdzv/";

v1::Join member(const std::string& run, int i) {
  v1::Join j;
  j.set_run_id(run);
  j.set_node_id("node-" + std::to_string(i));
  j.set_host("host" + std::to_string(i) + ".example");
  j.set_local_world_size(8);
  j.set_min_nodes(2);
  j.set_max_nodes(64);
  j.set_master_port_candidate(29500 + i);
  j.set_requested_rank(-1);
  return j;
}

v1::RunRecord base(const std::string& run, v1::RunRecord::Phase phase) {
  v1::RunRecord r;
  r.set_format(1);
  r.set_run_id(run);
  r.set_phase(phase);
  r.set_round(3);
  r.set_restart_count(1);
  r.set_min_nodes(2);
  r.set_max_nodes(64);
  r.set_max_restarts(5);
  r.set_join_timeout_ms(600000);
  r.set_keep_alive_interval_ms(5000);
  r.set_keep_alive_max_attempt(3);
  r.set_budget_from(2);
  return r;
}

// Running: `members` members and `ranks` last ranks (of different lengths on purpose).
v1::RunRecord running(const std::string& run, int members, int ranks) {
  v1::RunRecord r = base(run, v1::RunRecord::RUNNING);
  for (int i = 0; i < members; ++i) *r.add_members() = member(run, i);
  for (int i = 0; i < ranks; ++i) {
    v1::RankOf* l = r.add_last_rank();
    l->set_node_id("node-" + std::to_string(i));
    l->set_rank(ranks - 1 - i);
  }
  return r;
}

// What a writer leaves in etcd for `r` at `generation`: the head and its node keys.
void put(std::map<std::string, std::string>& kvs, const v1::RunRecord& r, std::int64_t generation) {
  layout::Split s = layout::split(r);
  s.head.set_generation(generation);
  kvs[layout::head_key(kPrefix, r.run_id())] = s.head.SerializeAsString();
  for (std::size_t i = 0; i < s.nodes.size(); ++i) {
    kvs[layout::node_key(kPrefix, r.run_id(), generation, static_cast<int>(i))] = s.nodes[i];
  }
}

}  // namespace

TEST_CASE("etcd layout: records split and join back byte for byte", "[etcd_layout]") {
  v1::RunRecord finished = base("done-run", v1::RunRecord::FINISHED);
  finished.mutable_result()->mutable_fail()->set_reason(
      "a worker failed and all 5 restarts are spent");
  finished.mutable_result()->mutable_fail()->mutable_root_cause()->set_exit_code(3);
  finished.add_last_rank()->set_node_id("n0");
  const std::vector<v1::RunRecord> records = {
      base("joining", v1::RunRecord::JOINING),  // no node keys at all
      running("more-members", 7, 3),
      running("more-ranks", 2, 9),
      running("members-only", 5, 0),
      running("ranks-only", 0, 4),
      finished,
  };
  std::map<std::string, std::string> kvs;
  std::map<std::string, std::int64_t> generation_of;
  std::int64_t generation = 10;
  for (const v1::RunRecord& r : records) {
    const layout::Split s = layout::split(r);
    CHECK(s.nodes.size() ==
          static_cast<std::size_t>(std::max(r.members_size(), r.last_rank_size())));
    CHECK(s.head.record().members_size() == 0);
    CHECK(s.head.record().last_rank_size() == 0);
    generation_of[r.run_id()] = generation;
    put(kvs, r, generation++);
  }
  // A key of the group but not of the runs, and one of another group: not read.
  kvs[kPrefix + "leader/694d7d3b8b0a8c04"] = "127.0.0.1:1";
  kvs["/muster/other/runs/6a6f696e696e67/h"] = "not ours";
  const layout::Joined joined = layout::join(kPrefix, kvs);
  CHECK(joined.skipped.empty());
  REQUIRE(joined.records.size() == records.size());
  REQUIRE(joined.generations.size() == records.size());
  // join() goes by key, so by hex run id; match each back by its id.
  for (const v1::RunRecord& r : records) {
    INFO(r.run_id());
    auto it = std::find_if(joined.records.begin(), joined.records.end(),
                           [&](const v1::RunRecord& j) { return j.run_id() == r.run_id(); });
    REQUIRE(it != joined.records.end());
    CHECK(it->SerializeAsString() == r.SerializeAsString());
    CHECK(joined.generations[it - joined.records.begin()] == generation_of[r.run_id()]);
  }
  // The finished run's generation (15) is the last with node keys.
  CHECK(joined.max_generation == 15);
}

TEST_CASE(
    "etcd layout: keys of any run id stay under its prefix, apart from a run whose id is "
    "a prefix of it",
    "[etcd_layout]") {
  const std::string slashy = "team/a/job 1";
  const std::string bytes = std::string("j\xc3\xa9") + std::string("\x00\xff/g", 4);
  for (const std::string& id : {slashy, bytes, std::string("team"), std::string("team/a")}) {
    INFO(id);
    const std::string run = layout::run_prefix(kPrefix, id);
    CHECK(run.starts_with(layout::runs_prefix(kPrefix)));
    CHECK(run.ends_with("/"));
    // One segment under runs/: the id's bytes never add a '/' or leave the prefix.
    const std::string seg = run.substr(layout::runs_prefix(kPrefix).size());
    CHECK(seg.find('/') == seg.size() - 1);
    CHECK(seg.find_first_not_of("0123456789abcdef") == seg.size() - 1);
    CHECK(layout::head_key(kPrefix, id).starts_with(run));
    CHECK(layout::generation_prefix(kPrefix, id, 7).starts_with(run));
    CHECK(layout::node_key(kPrefix, id, 7, 9999)
              .starts_with(layout::generation_prefix(kPrefix, id, 7)));
    CHECK(layout::node_key(kPrefix, id, 7, 3) == run + "g0000000000000007/00000003");
    CHECK(layout::head_key(kPrefix, id) == run + "h");
  }
  // "team" is a prefix of "team/a" (and its hex of the other's hex): neither run's range
  // [run_prefix, prefix_end(run_prefix)) holds a key of the other.
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"team", "team/a"}, {"team/a", "team/a/job 1"}, {"a", "a\xff"}, {"j", std::string("j\0", 2)}};
  for (const auto& [shorter, longer] : pairs) {
    INFO(shorter << " / " << longer);
    const std::string p = layout::run_prefix(kPrefix, shorter);
    const std::string end = layout::prefix_end(p);
    for (const std::string& key :
         {layout::head_key(kPrefix, longer), layout::node_key(kPrefix, longer, 1, 0),
          layout::node_key(kPrefix, longer, 0x7fffffffffffffff, 99999999)}) {
      CHECK_FALSE((key >= p && key < end));
    }
    const std::string q = layout::run_prefix(kPrefix, longer);
    for (const std::string& key :
         {layout::head_key(kPrefix, shorter), layout::node_key(kPrefix, shorter, 1, 0)}) {
      CHECK_FALSE((key >= q && key < layout::prefix_end(q)));
    }
  }
  // Both read back as themselves, by their own ids.
  std::map<std::string, std::string> kvs;
  put(kvs, running("team", 2, 2), 1);
  put(kvs, running("team/a", 3, 1), 2);
  put(kvs, running(bytes, 1, 1), 3);
  const layout::Joined joined = layout::join(kPrefix, kvs);
  CHECK(joined.skipped.empty());
  REQUIRE(joined.records.size() == 3);
  std::set<std::string> ids;
  for (const auto& r : joined.records) ids.insert(r.run_id());
  CHECK(ids == std::set<std::string>{"team", "team/a", bytes});
}

TEST_CASE(
    "etcd layout: a generation with a missing or damaged node key is skipped with one "
    "line naming the run",
    "[etcd_layout]") {
  std::map<std::string, std::string> kvs;
  put(kvs, running("good", 3, 3), 1);
  put(kvs, running("missing", 3, 3), 2);
  put(kvs, running("garbage", 3, 3), 3);
  put(kvs, running("no-member", 3, 1), 4);
  put(kvs, running("extra-rank", 3, 1), 5);
  kvs.erase(layout::node_key(kPrefix, "missing", 2, 1));
  kvs[layout::node_key(kPrefix, "garbage", 3, 2)] = "\xff\xff\xff";  // not a message
  // A node that should hold a member holds only a rank, and one past last_ranks holds one.
  v1::EtcdRunNode rank_only;
  rank_only.mutable_last_rank()->set_node_id("x");
  kvs[layout::node_key(kPrefix, "no-member", 4, 0)] = rank_only.SerializeAsString();
  v1::EtcdRunNode both;
  *both.mutable_member() = member("extra-rank", 2);
  both.mutable_last_rank()->set_node_id("x");
  kvs[layout::node_key(kPrefix, "extra-rank", 5, 2)] = both.SerializeAsString();

  const layout::Joined joined = layout::join(kPrefix, kvs);
  REQUIRE(joined.records.size() == 1);
  CHECK(joined.records[0].run_id() == "good");
  REQUIRE(joined.skipped.size() == 4);
  const std::vector<std::pair<std::string, std::string>> want = {
      {"missing", "node key 1 of generation 2"},
      {"garbage", "node key 2 of generation 3"},
      {"no-member", "node key 0 of generation 4"},
      {"extra-rank", "node key 2 of generation 5"}};
  for (const auto& [id, what] : want) {
    auto line = std::find_if(
        joined.skipped.begin(), joined.skipped.end(),
        [&](const std::string& s) { return s.find("'" + id + "'") != std::string::npos; });
    REQUIRE(line != joined.skipped.end());
    CHECK_THAT(*line, Contains(what) && Contains("missing or damaged"));
    CHECK(line->find('\n') == std::string::npos);
  }
}

TEST_CASE(
    "etcd layout: keys of another generation (a dead leader's unfinished write) are "
    "ignored and counted in max_generation",
    "[etcd_layout]") {
  const v1::RunRecord old = running("job", 4, 2);
  std::map<std::string, std::string> kvs;
  put(kvs, old, 3);
  // A leader that died writing generation 0x2a got two of its node keys out, not its head;
  // one of an older generation was never deleted.
  const layout::Split newer = layout::split(running("job", 9, 9));
  kvs[layout::node_key(kPrefix, "job", 0x2a, 0)] = newer.nodes[0];
  kvs[layout::node_key(kPrefix, "job", 0x2a, 5)] = newer.nodes[5];
  kvs[layout::node_key(kPrefix, "job", 1, 0)] = newer.nodes[0];
  // A key of the form with a generation that does not parse counts for nothing.
  kvs[layout::run_prefix(kPrefix, "job") + "gzzzzzzzzzzzzzzzz/00000000"] = "x";
  const layout::Joined joined = layout::join(kPrefix, kvs);
  CHECK(joined.skipped.empty());
  REQUIRE(joined.records.size() == 1);
  CHECK(joined.records[0].SerializeAsString() == old.SerializeAsString());
  CHECK(joined.generations == std::vector<std::int64_t>{3});
  CHECK(joined.max_generation == 0x2a);

  // Only half-written keys, no head at all: no record, no line, but still counted.
  std::map<std::string, std::string> orphans;
  orphans[layout::node_key(kPrefix, "gone", 0x1234, 0)] = newer.nodes[0];
  const layout::Joined none = layout::join(kPrefix, orphans);
  CHECK(none.records.empty());
  CHECK(none.skipped.empty());
  CHECK(none.max_generation == 0x1234);
}

TEST_CASE("etcd layout: prefix_end is the first key after every key with the prefix",
          "[etcd_layout]") {
  CHECK(layout::prefix_end("a") == "b");
  CHECK(layout::prefix_end("/muster/rdzv/runs/") == "/muster/rdzv/runs0");
  CHECK(layout::prefix_end("ab\xff") == "ac");
  CHECK(layout::prefix_end("a\xff\xff") == "b");
  CHECK(layout::prefix_end(std::string("a\xfe", 2)) == std::string("a\xff", 2));
  // Nothing to raise: etcd's "\0", every key from the start.
  CHECK(layout::prefix_end("\xff\xff") == std::string(1, '\0'));
  CHECK(layout::prefix_end("") == std::string(1, '\0'));
  // Every key with the prefix sorts below it, and the prefix's next sibling does not.
  const std::string p = "runs/6a6f62/";
  const std::string end = layout::prefix_end(p);
  for (const std::string& k : {p, p + "h", p + "g0000000000000001/00000000", p + "\xff\xff"}) {
    CHECK(k < end);
  }
  CHECK_FALSE(std::string("runs/6a6f620/h") < end);
}

TEST_CASE("etcd layout: a head that does not match its key, or is not a head, is skipped",
          "[etcd_layout]") {
  std::map<std::string, std::string> kvs;
  put(kvs, running("kept", 1, 1), 1);
  // The head of "a" under the key of "b" (and b's node keys in place).
  {
    layout::Split s = layout::split(running("a", 1, 1));
    s.head.set_generation(2);
    kvs[layout::head_key(kPrefix, "b")] = s.head.SerializeAsString();
    kvs[layout::node_key(kPrefix, "b", 2, 0)] = s.nodes[0];
  }
  // A head that does not parse, and one claiming more nodes than any run may have.
  kvs[layout::head_key(kPrefix, "junk")] = "\x0a\xff\xff\xff\xff";
  {
    layout::Split s = layout::split(running("huge", 0, 0));
    s.head.set_members(2000000000);
    kvs[layout::head_key(kPrefix, "huge")] = s.head.SerializeAsString();
  }
  {
    layout::Split s = layout::split(running("negative", 0, 0));
    s.head.set_last_ranks(-1);
    kvs[layout::head_key(kPrefix, "negative")] = s.head.SerializeAsString();
  }
  // Keys ending in /h that are no run's head: upper-case or odd hex, no hex at all.
  kvs[layout::runs_prefix(kPrefix) + "6A/h"] = kvs[layout::head_key(kPrefix, "kept")];
  kvs[layout::runs_prefix(kPrefix) + "6a6/h"] = "x";
  kvs[layout::runs_prefix(kPrefix) + "/h"] = "x";
  const layout::Joined joined = layout::join(kPrefix, kvs);
  REQUIRE(joined.records.size() == 1);
  CHECK(joined.records[0].run_id() == "kept");
  REQUIRE(joined.skipped.size() == 7);
  auto line_with = [&](const std::string& text) {
    return std::count_if(joined.skipped.begin(), joined.skipped.end(),
                         [&](const std::string& s) { return s.find(text) != std::string::npos; });
  };
  CHECK(line_with("does not match its key") == 4);
  for (const char* id : {"'b'", "'junk'", "'huge'", "'negative'"}) {
    INFO(id);
    CHECK(line_with(id) == 1);
  }
  CHECK(line_with("not a run's head") == 3);
  CHECK(line_with(layout::runs_prefix(kPrefix) + "6A/h") == 1);
}
