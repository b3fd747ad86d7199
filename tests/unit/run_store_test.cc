// The file run store (rdzvd --state_dir): atomic per-run files, what it refuses, what it skips;
// and the agent's endpoint list.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>

#include "muster/agent/endpoints.h"
#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/run_store.h"
#include "proc.h"

using muster::rendezvous::open_file_run_store;
using muster::testing::TempDir;
namespace v1 = muster::v1;
namespace fs = std::filesystem;

namespace {

v1::RunRecord rec(const std::string& id, int round) {
  v1::RunRecord r;
  r.set_format(1);
  r.set_run_id(id);
  r.set_phase(v1::RunRecord::RUNNING);
  r.set_round(round);
  r.set_min_nodes(1);
  r.set_max_nodes(2);
  v1::Join* j = r.add_members();
  j->set_run_id(id);
  j->set_node_id("n0");
  return r;
}

std::vector<std::string> files(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

TEST_CASE("run store: records go to one file per run and come back", "[rdzv][run_store]") {
  TempDir dir;
  {
    auto store = open_file_run_store({dir.path(), false});
    REQUIRE(store.ok());
    REQUIRE((*store)->put(rec("job-a", 1)).ok());
    REQUIRE((*store)->put(rec("job/b with spaces", 3)).ok());
    REQUIRE((*store)->put(rec("job-a", 2)).ok());  // replaces
    auto loaded = (*store)->load_all();
    REQUIRE(loaded.ok());
    REQUIRE(loaded->records.size() == 2);
    CHECK(loaded->records[0].run_id() == "job-a");
    CHECK(loaded->records[0].round() == 2);
    CHECK(loaded->records[1].run_id() == "job/b with spaces");
    CHECK(loaded->skipped.empty());
    REQUIRE((*store)->erase("job-a").ok());
    REQUIRE((*store)->erase("never-there").ok());
    // Two run files and the lock; no temporary file left behind.
    CHECK(files(dir.path()).size() == 2);
  }
  // With fsync, and after the first store is closed (its lock released).
  auto store = open_file_run_store({dir.path(), true});
  REQUIRE(store.ok());
  REQUIRE((*store)->put(rec("job-c", 1)).ok());
  auto loaded = (*store)->load_all();
  REQUIRE(loaded.ok());
  REQUIRE(loaded->records.size() == 2);
  CHECK(loaded->records[0].run_id() == "job-c");  // by run id
  CHECK(loaded->records[1].run_id() == "job/b with spaces");
}

TEST_CASE("run store: a second server on the folder, a missing folder, a file are refused",
          "[rdzv][run_store]") {
  TempDir dir;
  auto first = open_file_run_store({dir.path(), false});
  REQUIRE(first.ok());
  auto second = open_file_run_store({dir.path(), false});
  REQUIRE_FALSE(second.ok());
  CHECK(second.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(second.status().message()), Catch::Contains("in use by another server"));
  auto missing = open_file_run_store({dir.file("nope"), false});
  REQUIRE_FALSE(missing.ok());
  CHECK_THAT(std::string(missing.status().message()), Catch::Contains("nope"));
  std::ofstream(dir.file("plain")) << "x";
  auto not_dir = open_file_run_store({dir.file("plain"), false});
  REQUIRE_FALSE(not_dir.ok());
  CHECK_THAT(std::string(not_dir.status().message()), Catch::Contains("Not a directory"));
}

TEST_CASE("run store: unreadable files are skipped and moved aside, leftovers removed",
          "[rdzv][run_store]") {
  TempDir dir;
  auto store = open_file_run_store({dir.path(), false});
  REQUIRE(store.ok());
  REQUIRE((*store)->put(rec("good", 1)).ok());
  REQUIRE((*store)->put(rec("flipped", 1)).ok());
  REQUIRE((*store)->put(rec("cut", 1)).ok());
  // Damage two of them: a flipped byte in the payload, a file cut short.
  std::string flipped, cut;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    const std::string name = e.path().filename().string();
    if (name == "lock") continue;
    std::string bytes = muster::testing::read_file(e.path().string());
    if (bytes.find("flipped") != std::string::npos) {
      flipped = name;
      bytes[bytes.size() - 3] ^= 0x5a;
      std::ofstream(e.path(), std::ios::binary) << bytes;
    } else if (bytes.find("cut") != std::string::npos) {
      cut = name;
      std::ofstream(e.path(), std::ios::binary) << bytes.substr(0, 20);
    }
  }
  REQUIRE(!flipped.empty());
  REQUIRE(!cut.empty());
  std::ofstream(dir.file("run-00000000000000aa.rec.tmp")) << "half a write";
  std::ofstream(dir.file("notes.txt")) << "not ours";
  auto loaded = (*store)->load_all();
  REQUIRE(loaded.ok());
  REQUIRE(loaded->records.size() == 1);
  CHECK(loaded->records[0].run_id() == "good");
  REQUIRE(loaded->skipped.size() == 2);
  CHECK(fs::exists(dir.file(flipped + ".corrupt")));
  CHECK(fs::exists(dir.file(cut + ".corrupt")));
  CHECK_FALSE(fs::exists(dir.file("run-00000000000000aa.rec.tmp")));
  CHECK(fs::exists(dir.file("notes.txt")));
  // Moved aside: the next start does not see them again.
  auto again = (*store)->load_all();
  REQUIRE(again.ok());
  CHECK(again->skipped.empty());
}

TEST_CASE("run store: a record over the size limit is not written", "[rdzv][run_store]") {
  TempDir dir;
  auto store = open_file_run_store({dir.path(), false});
  REQUIRE(store.ok());
  v1::RunRecord big = rec("big", 1);
  big.mutable_members(0)->set_host(std::string(muster::rendezvous::limits::kMaxRunRecordBytes, 'h'));
  absl::Status st = (*store)->put(big);
  CHECK(st.code() == absl::StatusCode::kResourceExhausted);
  CHECK(files(dir.path()) == std::vector<std::string>{"lock"});
}

TEST_CASE("endpoints: one gets all the time, several take turns, a window each",
          "[agent][endpoints]") {
  using muster::agent::Endpoints;
  using muster::agent::RdzvEndpoint;
  using std::chrono::milliseconds;
  Endpoints one(std::vector<RdzvEndpoint>{{"ipv4:10.0.0.1:1", "a:1"}});
  CHECK(one.attempt(milliseconds(60000), milliseconds(2000)) == milliseconds(60000));
  one.next();
  CHECK(one.current().name == "a:1");
  Endpoints two(std::vector<RdzvEndpoint>{{"ipv4:10.0.0.1:1", "a:1"}, {"ipv4:10.0.0.2:2", "b:2"}});
  CHECK(two.attempt(milliseconds(60000), milliseconds(2000)) == milliseconds(2000));
  CHECK(two.attempt(milliseconds(60000), milliseconds(100)) ==
        muster::rendezvous::limits::kMinConnectAttempt);
  CHECK(two.attempt(milliseconds(500), milliseconds(2000)) == milliseconds(500));
  CHECK(two.names() == "a:1, b:2");
  CHECK(two.current().name == "a:1");
  two.next();
  CHECK(two.current().target == "ipv4:10.0.0.2:2");
  two.next();
  CHECK(two.index() == 0);
}
