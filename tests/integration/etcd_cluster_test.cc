// The etcd test harness (support/etcd_cluster.h) against Debian's real etcd 3.4: a cluster
// forms, a write is read from another member, the raft leader's kill -9 elects a new one, a
// restarted member rejoins, and the destructor leaves no member or folder. Without etcd these
// tests report SKIPPED.
#include "etcd_cluster.h"

#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <filesystem>
#include <set>

using namespace muster::testing;
using Catch::Matchers::Contains;

namespace {

// A started cluster, or null with a SKIPPED warning where etcd is missing (the caller returns).
std::unique_ptr<EtcdCluster> etcd_cluster_or_skip(EtcdOptions o = {}) {
  if (const std::string why = EtcdCluster::missing(); !why.empty()) {
    report_skip(why + "; scripts/setup installs it");
    return nullptr;
  }
  return EtcdCluster::start(o);
}

// Gone for good: its pidfd (opened while it ran) is readable and the pid is free (reaped).
bool gone(int pidfd, pid_t pid) {
  return wait_pidfd(pidfd, std::chrono::milliseconds(0)) && ::kill(pid, 0) == -1 && errno == ESRCH;
}

}  // namespace

TEST_CASE("etcd harness: three members form a cluster and a put is read from another member",
          "[etcd]") {
  auto etcd = etcd_cluster_or_skip();
  if (!etcd) return;
  REQUIRE(etcd->size() == 3);
  std::set<std::string> eps;
  for (int i = 0; i < 3; ++i) {
    CHECK(etcd->running(i));
    eps.insert(etcd->endpoint(i));
  }
  CHECK(eps.size() == 3);
  CHECK(etcd->endpoints() == etcd->endpoint(0) + "," + etcd->endpoint(1) + "," + etcd->endpoint(2));
  REQUIRE(etcd->healthy(10s));
  const int leader = etcd->leader();
  CHECK(leader >= 0);
  CHECK(leader < 3);

  const std::string members = etcd->ctl({"member", "list"});
  INFO(members);
  CHECK(count_lines_with(members, ", started, ") == 3);

  CHECK_THAT(etcd->ctl({"put", "harness/k", "v1"}, 0), Contains("OK"));
  CHECK(etcd->ctl({"get", "harness/k", "--print-value-only"}, 2) == "v1\n");
  CHECK(etcd->ctl({"get", "harness/k", "--print-value-only"}, 1) == "v1\n");
}

TEST_CASE("etcd harness: kill -9 of the leader elects a new one, and a restarted member rejoins",
          "[etcd]") {
  auto etcd = etcd_cluster_or_skip();
  if (!etcd) return;
  CHECK_THAT(etcd->ctl({"put", "harness/before", "1"}), Contains("OK"));
  const int old = etcd->leader();
  REQUIRE(old >= 0);
  const pid_t old_pid = etcd->pid(old);
  const int old_pidfd = open_pidfd(old_pid);

  etcd->kill(old);
  CHECK_FALSE(etcd->running(old));
  CHECK(gone(old_pidfd, old_pid));
  ::close(old_pidfd);
  CHECK(etcd->pid(old) == old_pid);
  CHECK_THROWS_WITH(etcd->kill(old), Contains("not running"));

  // The two left elect a leader among them (election timeout 1 s) and answer reads again.
  REQUIRE(etcd->healthy(15s));
  const int now = etcd->leader();
  CHECK(now >= 0);
  CHECK(now != old);
  const int follower = 3 - old - now;  // the running member that is not the leader
  CHECK_THAT(etcd->ctl({"put", "harness/after", "2"}), Contains("OK"));
  CHECK(etcd->ctl({"get", "harness/after", "--print-value-only"}, follower) == "2\n");
  CHECK(etcd->ctl({"get", "harness/before", "--print-value-only"}, follower) == "1\n");

  // Restarted with its data dir it rejoins: every member answers a linearizable read, and it
  // has the write made while it was down.
  etcd->restart(old);
  CHECK(etcd->running(old));
  CHECK(etcd->pid(old) != old_pid);
  REQUIRE(etcd->healthy(15s));
  CHECK(etcd->ctl({"get", "harness/after", "--print-value-only"}, old) == "2\n");
  CHECK(etcd->ctl({"get", "harness/after", "--print-value-only", "--consistency=s"}, old) == "2\n");
  CHECK(count_lines_with(etcd->ctl({"member", "list"}, old), ", started, ") == 3);
  CHECK(etcd->leader() >= 0);
}

TEST_CASE("etcd harness: the destructor ends every member by its pid and removes its folder",
          "[etcd]") {
  auto etcd = etcd_cluster_or_skip();
  if (!etcd) return;
  etcd->kill(2);  // one already dead, one restarted, one never touched
  etcd->kill(1);
  etcd->restart(1);
  std::vector<pid_t> pids;
  std::vector<int> pidfds;
  for (int i = 0; i < 3; ++i) {
    pids.push_back(etcd->pid(i));
    pidfds.push_back(open_pidfd(etcd->pid(i)));
  }
  CHECK(pidfds[0] >= 0);
  CHECK(pidfds[1] >= 0);
  const std::string dir = etcd->dir();
  REQUIRE(std::filesystem::exists(dir + "/m0"));

  etcd.reset();
  for (int i = 0; i < 3; ++i) {
    INFO("member " << i << ", pid " << pids[i]);
    CHECK(gone(pidfds[i], pids[i]));
    if (pidfds[i] >= 0) ::close(pidfds[i]);
  }
  CHECK_FALSE(std::filesystem::exists(dir));
}

TEST_CASE("etcd harness: a member that cannot start is reported in etcd's own words", "[etcd]") {
  if (const std::string why = EtcdCluster::missing(); !why.empty()) {
    MUSTER_SKIP(why);
  }
  // etcd refuses an election timeout under 5 heartbeats, and exits at once.
  EtcdOptions o;
  o.heartbeat = std::chrono::milliseconds(100);
  o.election = std::chrono::milliseconds(200);
  CHECK_THROWS_WITH(EtcdCluster::start(o),
                    Contains("exited with") && Contains("--election-timeout"));
  o.members = 0;
  CHECK_THROWS_AS(EtcdCluster::start(o), std::invalid_argument);
}
