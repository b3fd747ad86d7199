// The worker runtime in real worker processes: the store, the environment and the TCP ring.
#include <signal.h>

#include <regex>

#include <catch2/catch.hpp>

#include "helpers.h"
#include "held_run.h"

using namespace muster::testing;

namespace {
const std::string kCollective = COLLECTIVE_WORKER_BIN;
}  // namespace

TEST_CASE("runtime: every collective, dtype and size is right for 1 to 4 ranks", "[runtime]") {
  for (int k = 1; k <= 4; ++k) {
    Proc p({kLaunch, "--standalone", "--nproc_per_node=" + std::to_string(k), kCollective, "check"});
    INFO("nproc " << k << "\n" << p.err());
    REQUIRE(p.wait(300s) == 0);
    for (int r = 0; r < k; ++r) {
      CHECK_THAT(p.out(), Catch::Contains("rank " + std::to_string(r) + ": all collectives correct"));
    }
  }
}

TEST_CASE("runtime: the collectives over TCP only (MUSTER_RING_UNIX=0), 2 and 3 ranks", "[runtime]") {
  // By default ranks on one machine use Unix-domain sockets; this keeps the TCP path tested.
  for (int k = 2; k <= 3; ++k) {
    Proc p({kLaunch, "--standalone", "--nproc_per_node=" + std::to_string(k), kCollective, "check"},
           {{"MUSTER_RING_UNIX", "0"}});
    INFO("nproc " << k << "\n" << p.err());
    REQUIRE(p.wait(300s) == 0);
    for (int r = 0; r < k; ++r) {
      CHECK_THAT(p.out(), Catch::Contains("rank " + std::to_string(r) + ": all collectives correct"));
    }
  }
}

TEST_CASE("runtime: a rank killed mid-collective gives the others an error, not a hang",
          "[runtime]") {
  // Workers run without an agent here, so nothing else stops them: only the ring can.
  std::regex re(R"(listening on port (\d+))");
  Proc server({kRdzvd, "--listen", "127.0.0.1:0"});
  REQUIRE(server.wait_output([](const std::string& o, const std::string&) {
    return o.find('\n') != std::string::npos;
  }, 30s));
  std::smatch m;
  REQUIRE(std::regex_search(server.out(), m, re));
  const std::string store = "127.0.0.1:" + m[1].str();
  HeldRun held(store, "die");  // workers without an agent: the store needs the run held
  std::vector<std::unique_ptr<Proc>> ranks;
  for (int r = 0; r < 3; ++r) {
    std::map<std::string, std::optional<std::string>> env{
        {"RANK", std::to_string(r)}, {"LOCAL_RANK", std::to_string(r)}, {"WORLD_SIZE", "3"},
        {"LOCAL_WORLD_SIZE", "3"}, {"GROUP_RANK", "0"}, {"GROUP_WORLD_SIZE", "1"},
        {"ROLE_RANK", std::to_string(r)}, {"ROLE_WORLD_SIZE", "3"}, {"ROLE_NAME", "default"},
        {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1"}, {"TORCHELASTIC_RESTART_COUNT", "0"},
        {"TORCHELASTIC_MAX_RESTARTS", "0"}, {"TORCHELASTIC_RUN_ID", "die"},
        {"MUSTER_STORE_ADDR", store}, {"MUSTER_RUN_ID", "die"}, {"MUSTER_ROUND", "1"},
        {"MUSTER_NODE_ADDR", "127.0.0.1"}};
    ranks.push_back(std::make_unique<Proc>(std::vector<std::string>{kCollective, "die", "1"}, env));
  }
  CHECK(ranks[1]->wait(60s) == 128 + SIGKILL);
  for (int r : {0, 2}) {
    INFO("rank " << r << ": " << ranks[r]->out() << ranks[r]->err());
    CHECK(ranks[r]->wait(60s) == 3);
    CHECK_THAT(ranks[r]->out(), Catch::Contains("lost rank"));
  }
  ::kill(server.pid(), SIGTERM);
  CHECK(server.wait(30s) == 0);
}
