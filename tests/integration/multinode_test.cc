// Several agents (real `launch` processes) forming one run on 127.0.0.1, with the server
// embedded in one of them or in an external rdzvd.
#include <signal.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <memory>
#include <regex>
#include <set>

#include "helpers.h"
#include "rdzvd_proc.h"
#include "muster/rendezvous/client.h"
#include "muster/rendezvous/limits.h"

using namespace muster::testing;

namespace {



void check_world(const TempDir& dir, const std::vector<int>& nproc_by_group_rank) {
  int world = 0;
  for (int n : nproc_by_group_rank) world += n;
  std::set<std::string> masters;
  int rank = 0;
  for (std::size_t g = 0; g < nproc_by_group_rank.size(); ++g) {
    for (int lr = 0; lr < nproc_by_group_rank[g]; ++lr, ++rank) {
      auto env = read_env_file(dir.file("env." + std::to_string(rank)));
      INFO("rank " << rank);
      CHECK(env["GROUP_RANK"] == std::to_string(g));
      CHECK(env["GROUP_WORLD_SIZE"] == std::to_string(nproc_by_group_rank.size()));
      CHECK(env["LOCAL_RANK"] == std::to_string(lr));
      CHECK(env["LOCAL_WORLD_SIZE"] == std::to_string(nproc_by_group_rank[g]));
      CHECK(env["WORLD_SIZE"] == std::to_string(world));
      CHECK(env["ROLE_WORLD_SIZE"] == std::to_string(world));
      // torch's store: this node's agent's, on loopback (one listener per agent).
      CHECK(env["MASTER_ADDR"] == "127.0.0.1");
      masters.insert(std::to_string(g) + " " + env["MASTER_PORT"] + " " +
                     env["TORCHELASTIC_RUN_ID"]);
    }
  }
  CHECK(masters.size() == nproc_by_group_rank.size());
  CHECK_FALSE(std::filesystem::exists(dir.file("env." + std::to_string(world))));
}

}  // namespace

TEST_CASE("multinode: agents hosting the server themselves form one world", "[multinode]") {
  TempDir dir;
  const std::string ep = "127.0.0.1:" + std::to_string(free_port());
  // Different nproc per node: WORLD_SIZE is the sum, ranks contiguous per node.
  const std::vector<std::string> local{"--local_addr=127.0.0.1"};
  Proc a(launch_args(c10d(ep, "3", 2, "job", local), {"env", dir.path()}));
  Proc b(launch_args(c10d(ep, "3", 3, "job", local), {"env", dir.path()}));
  Proc c(launch_args(c10d(ep, "3", 1, "job", local), {"env", dir.path()}));
  REQUIRE(a.wait() == 0);
  REQUIRE(b.wait() == 0);
  REQUIRE(c.wait() == 0);
  // Group ranks follow join order, which the test does not control: rebuild it from the
  // files (rank 0's LOCAL_WORLD_SIZE tells which node came first, and so on).
  std::vector<int> by_rank;
  for (int r = 0; r < 6;) {
    int n = std::stoi(read_env_file(dir.file("env." + std::to_string(r)))["LOCAL_WORLD_SIZE"]);
    by_rank.push_back(n);
    r += n;
  }
  std::vector<int> sorted = by_rank;
  std::sort(sorted.begin(), sorted.end());
  CHECK(sorted == std::vector<int>{1, 2, 3});
  check_world(dir, by_rank);
  CHECK(read_env_file(dir.file("env.0"))["TORCHELASTIC_RUN_ID"] == "job");
}

TEST_CASE("multinode: an external rdzvd serves two runs apart and drops them when done",
          "[multinode]") {
  RdzvdProc server({"--finished_run_grace=0"});
  TempDir d1, d2;
  Proc a1(launch_args(c10d(server.endpoint, "2", 2, "one"), {"env", d1.path()}));
  Proc a2(launch_args(c10d(server.endpoint, "2", 2, "two"), {"env", d2.path()}));
  Proc b1(launch_args(c10d(server.endpoint, "2", 2, "one"), {"env", d1.path()}));
  Proc b2(launch_args(c10d(server.endpoint, "2", 2, "two"), {"env", d2.path()}));
  for (Proc* p : {&a1, &a2, &b1, &b2}) REQUIRE(p->wait() == 0);
  check_world(d1, {2, 2});
  check_world(d2, {2, 2});
  CHECK(read_env_file(d1.file("env.3"))["TORCHELASTIC_RUN_ID"] == "one");
  CHECK(read_env_file(d2.file("env.3"))["TORCHELASTIC_RUN_ID"] == "two");
  auto status = muster::rendezvous::get_status(server.endpoint, "", "", 10s);
  REQUIRE(status.ok());
  CHECK(status->runs().empty());
}

TEST_CASE("multinode: a worker crash on one node restarts every node, the budget is the run's",
          "[multinode]") {
  SECTION("restart succeeds") {
    TempDir dir;
    const std::string ep = "127.0.0.1:" + std::to_string(free_port());
    Proc a(
        launch_args(c10d(ep, "2", 2, "job", {"--max_restarts=1"}), {"restart", dir.path(), "1"}));
    Proc b(
        launch_args(c10d(ep, "2", 2, "job", {"--max_restarts=1"}), {"restart", dir.path(), "1"}));
    REQUIRE(a.wait() == 0);
    REQUIRE(b.wait() == 0);
    CHECK(read_file(dir.file("restarts.0")) == "0\n1\n");
    for (int r = 1; r < 4; ++r) {
      CHECK_THAT(read_file(dir.file("restarts." + std::to_string(r))), Catch::EndsWith("1\n"));
    }
  }
  SECTION("budget spent: every node prints the same root cause and exits 1") {
    TempDir dir;
    RdzvdProc server;
    Proc a(launch_args(c10d(server.endpoint, "2", 2, "job", {"--max_restarts=1"}),
                       {"restart", dir.path(), "5"}));
    Proc b(launch_args(c10d(server.endpoint, "2", 2, "job", {"--max_restarts=1"}),
                       {"restart", dir.path(), "5"}));
    REQUIRE(a.wait() == 1);
    REQUIRE(b.wait() == 1);
    CHECK(read_file(dir.file("restarts.0")) == "0\n1\n");  // 1 restart for the run, not per node
    for (Proc* p : {&a, &b}) {
      CHECK_THAT(p->err(), Catch::Contains("Root Cause (first observed failure):\n[0]:"));
      CHECK_THAT(p->err(), Catch::Contains("  rank      : 0 (local_rank: 0)\n"));
      CHECK_THAT(p->err(), Catch::Contains("  exitcode  : 3 (pid: "));
    }
  }
}

TEST_CASE("multinode: kill -9 of an agent: the survivor goes on alone at once", "[multinode]") {
  RdzvdProc server;
  // A liveness window of 90 s: the new round within the 10 s below is the closed stream's
  // doing, not the keep-alive timer's.
  const std::vector<std::string> conf{
      "--rdzv_conf=last_call_timeout=0.5,keep_alive_interval=30,keep_alive_max_attempt=3"};
  Proc a(launch_args(c10d(server.endpoint, "1:2", 2, "job", conf), {"wait"}));
  Proc b(launch_args(c10d(server.endpoint, "1:2", 2, "job", conf), {"wait"}));
  REQUIRE(a.wait_output(has_ready(2, "world 4 round 1"), 30s));
  REQUIRE(b.wait_output(has_ready(2, "world 4 round 1"), 30s));
  std::vector<int> fds;
  for (pid_t pid : ready_pids(b.out())) fds.push_back(open_pidfd(pid));
  ::kill(b.pid(), SIGKILL);
  REQUIRE(b.wait() == 128 + SIGKILL);
  // How fast is bench/run's "recovery" row; here: that it happens.
  REQUIRE(a.wait_output(has_ready(2, "world 2 round 2"), 10s));
  for (int fd : fds) {
    CHECK(wait_pidfd(fd, 10s));  // b's workers died with it
    ::close(fd);
  }
  ::kill(a.pid(), SIGTERM);
  CHECK(a.wait() == 143);
}

TEST_CASE("multinode: the surviving host restarts without a killed member", "[multinode]") {
  const int port = free_port();
  const std::string ep = "127.0.0.1:" + std::to_string(port);
  const std::vector<std::string> conf{"--rdzv_conf=last_call_timeout=0.5"};
  Proc host(launch_args(c10d(ep, "1:2", 2, "job", conf), {"wait"}));
  // The host is whoever binds first: start it alone and wait until its round runs.
  REQUIRE(host.wait_output(has_ready(2, "world 2 round 1"), 30s));
  Proc other(launch_args(c10d(ep, "1:2", 1, "job", conf), {"wait"}));
  // A late joiner scales the run up to both nodes.
  REQUIRE(host.wait_output(has_ready(2, "world 3 round 2"), 30s));
  REQUIRE(other.wait_output(has_ready(1, "world 3 round 2"), 30s));
  ::kill(other.pid(), SIGKILL);
  REQUIRE(other.wait() == 128 + SIGKILL);
  REQUIRE(host.wait_output(has_ready(2, "world 2 round 3"), 10s));
  CHECK(has_ready(2, "restart 0")(host.out(), ""));   // membership changes spend no restarts
  ::kill(host.pid(), SIGTERM);
  CHECK(host.wait() == 143);
}

TEST_CASE("multinode: below min the survivor waits for a replacement", "[multinode]") {
  RdzvdProc server;
  Proc a(launch_args(c10d(server.endpoint, "2", 1, "job"), {"wait"}));
  Proc b(launch_args(c10d(server.endpoint, "2", 1, "job"), {"wait"}));
  REQUIRE(a.wait_output(has_ready(1, "world 2 round 1"), 30s));
  ::kill(b.pid(), SIGKILL);
  REQUIRE(b.wait() == 128 + SIGKILL);
  Proc c(launch_args(c10d(server.endpoint, "2", 1, "job"), {"wait"}));
  REQUIRE(a.wait_output(has_ready(1, "world 2 round 2"), 30s));
  REQUIRE(c.wait_output(has_ready(1, "world 2 round 2"), 30s));
  for (Proc* p : {&a, &c}) {
    ::kill(p->pid(), SIGTERM);
    CHECK(p->wait() == 143);
  }
}

TEST_CASE("multinode: static mode with fixed node ranks and master", "[multinode]") {
  TempDir dir;
  const int master_port = free_port_pair();  // the server listens on the next port
  REQUIRE(master_port != 0);
  auto flags = [&](int node_rank, int nproc) {
    return std::vector<std::string>{"--rdzv_backend=static",
                                    "--nnodes=2",
                                    "--node_rank=" + std::to_string(node_rank),
                                    "--master_addr=127.0.0.1",
                                    "--master_port=" + std::to_string(master_port),
                                    "--nproc_per_node=" + std::to_string(nproc)};
  };
  Proc n1(launch_args(flags(1, 1), {"env", dir.path()}));  // node 1 first: it waits for node 0
  Proc n0(launch_args(flags(0, 2), {"env", dir.path()}));
  REQUIRE(n0.wait() == 0);
  REQUIRE(n1.wait() == 0);
  check_world(dir, {2, 1});
  auto env = read_env_file(dir.file("env.2"));
  CHECK(env["MASTER_ADDR"] == "127.0.0.1");
  CHECK(env["MASTER_PORT"] == std::to_string(master_port));
  CHECK(env["GROUP_RANK"] == "1");
}

TEST_CASE("multinode: a wrong secret is refused with a clear error", "[multinode]") {
  RdzvdProc server({"--token=s3cret"});
  Proc bad(
      launch_args(c10d(server.endpoint, "1", 1, "job", {"--rdzv_conf=token=guess"}), {"wait"}));
  REQUIRE(bad.wait() == 1);
  CHECK_THAT(bad.err(), Catch::Contains("wrong or missing token"));
  CHECK(bad.out().empty());
  TempDir dir;
  Proc good(launch_args(c10d(server.endpoint, "1", 1, "job", {"--rdzv_conf=token=s3cret"}),
                        {"env", dir.path()}));
  CHECK(good.wait() == 0);
  CHECK(muster::rendezvous::get_status(server.endpoint, "", "nope", 10s).status().code() ==
        absl::StatusCode::kPermissionDenied);
}

TEST_CASE("multinode: a join to a finished run is refused", "[multinode]") {
  RdzvdProc server;
  TempDir dir;
  Proc first(launch_args(c10d(server.endpoint, "1", 1, "done-job"), {"env", dir.path()}));
  REQUIRE(first.wait() == 0);
  Proc late(launch_args(c10d(server.endpoint, "1", 1, "done-job"), {"wait"}));
  REQUIRE(late.wait() == 1);
  CHECK_THAT(late.err(), Catch::Contains("run 'done-job' has already finished"));
}

TEST_CASE("multinode: bad rendezvous flags are usage errors", "[multinode]") {
  const std::vector<std::vector<std::string>> cases{
      {"--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:notaport"},
      {"--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=[::1"},
      {"--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=:29400"},
      {"--nnodes=3:2", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:1"},
      // An unknown key is accepted (torchrun passes it through); a malformed value is not.
      {"--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:1",
       "--rdzv_conf=join_timeout=soon"},
      {"--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0"},  // port 0: one node
      {"--nnodes=2", "--rdzv_backend=c10d"},
      {"--nnodes=2", "--rdzv_backend=etcd", "--rdzv_endpoint=127.0.0.1:1"},
      {"--nnodes=1:2", "--rdzv_backend=static"},
      {"--nnodes=2", "--rdzv_backend=static", "--node_rank=2"},
  };
  for (const auto& flags : cases) {
    Proc p(launch_args(flags, {"wait"}));
    INFO(flags.back());
    CHECK(p.wait() == 2);
    CHECK_THAT(p.err(), Catch::StartsWith("launch: error: "));
    CHECK(std::count(p.err().begin(), p.err().end(), '\n') == 1);
    CHECK(p.out().empty());
  }
}

TEST_CASE("multinode: when the hosting agent dies the others stop cleanly with an error",
          "[multinode]") {
  const std::string ep = "127.0.0.1:" + std::to_string(free_port());
  // read_timeout: how long a node that lost its server tries to reach it again.
  const std::vector<std::string> conf{"--rdzv_conf=last_call_timeout=0.5,read_timeout=3"};
  Proc host(launch_args(c10d(ep, "1:2", 1, "job", conf), {"wait"}));
  REQUIRE(host.wait_output(has_ready(1, "world 1 round 1"), 30s));
  Proc other(launch_args(c10d(ep, "1:2", 2, "job", conf), {"wait"}));
  REQUIRE(other.wait_output(has_ready(2, "world 3 round 2"), 30s));
  std::vector<int> fds;
  for (pid_t pid : ready_pids(other.out())) fds.push_back(open_pidfd(pid));
  ::kill(host.pid(), SIGKILL);
  REQUIRE(host.wait() == 128 + SIGKILL);
  for (int fd : fds) {
    CHECK(wait_pidfd(fd, 10s));  // its workers are stopped at once, not after the retries
    ::close(fd);
  }
  REQUIRE(other.wait(30s) == 1);
  CHECK_THAT(other.err(), Catch::Contains("rendezvous: lost the server at " + ep));
  CHECK_THAT(other.err(), Catch::Contains("could not reach it again within 3 s"));
  CHECK(std::count(other.err().begin(), other.err().end(), '\n') <= 4);  // clear lines, no flood
}

TEST_CASE("multinode: a 9 MiB error file is cut, reported by every node, exit 1", "[multinode]") {
  namespace limits = muster::rendezvous::limits;
  RdzvdProc server;
  const std::vector<std::string> worker{"bigerr", std::to_string(9 << 20), "0"};
  Proc a(launch_args(c10d(server.endpoint, "2", 1, "bigjob"), worker));
  Proc b(launch_args(c10d(server.endpoint, "2", 1, "bigjob"), worker));
  REQUIRE(a.wait() == 1);
  REQUIRE(b.wait() == 1);
  for (Proc* p : {&a, &b}) {
    INFO(p->err().substr(0, 4096));
    CHECK_THAT(p->err(), Catch::Contains("Root Cause (first observed failure):\n[0]:"));
    CHECK_THAT(p->err(), Catch::Contains("  message   : BigError: xxxxxxxx"));
    CHECK_THAT(p->err(), Catch::Contains("cut"));
    CHECK_THAT(p->err(), !Catch::Contains("lost"));
    CHECK(p->err().size() < 4 * (limits::kMaxFailureMessageBytes + limits::kMaxFailureTracebackBytes));
  }
}
