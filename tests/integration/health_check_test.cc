// launch --health_check (docs/launch.md, "Health checks"): the pre-flight command each node
// runs before it first joins. Real launches on one rdzvd (127.0.0.1, port 0).
#include <signal.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <regex>

#include "helpers.h"
#include "rdzvd_proc.h"

using namespace muster::testing;

namespace {

int count_of(const std::string& text, const std::string& what) {
  int n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("health check: a node whose check fails is kept out with one line naming it, the "
          "other two train",
          "[health_check]") {
  RdzvdProc server;
  TempDir work;
  auto node = [&](const std::string& check) {
    return std::make_unique<Proc>(launch_args(
        c10d(server.endpoint, "2:3", 1, "hc",
             {"--health_check=" + check, "--local_addr=127.0.0.1",
              "--rdzv_conf=last_call_timeout=1"}),
        {"env", work.path()}));
  };
  auto sick = node("echo checking; echo gpu 3 is sick >&2; exit 3");
  auto a = node("true");
  auto b = node("echo all good");
  REQUIRE(sick->wait(30s) == 1);
  INFO("sick node's stderr:\n" << sick->err());
  CHECK(count_of(sick->err(), "launch: error:") == 1);
  CHECK(sick->err().find("launch: error: health check failed on 127.0.0.1: 'echo checking; echo "
                         "gpu 3 is sick >&2; exit 3' exited with 3 (its last line: gpu 3 is "
                         "sick)\n") != std::string::npos);
  CHECK(sick->err().find("[health_check] checking\n") != std::string::npos);
  REQUIRE(a->wait(60s) == 0);
  REQUIRE(b->wait(60s) == 0);
  CHECK(b->err().find("[health_check] all good\n") != std::string::npos);
  // The two healthy nodes formed a world of two, and only they ran workers.
  for (const char* rank : {"0", "1"}) {
    const auto env = read_env_file(work.file(std::string("env.") + rank));
    CHECK(env.at("WORLD_SIZE") == "2");
    CHECK(env.count("MUSTER_HEALTH_CHECK") == 0);  // the check's, not the workers'
  }
  CHECK_FALSE(std::ifstream(work.file("env.2")).good());
}

TEST_CASE("health check: one that outlasts its timeout is killed with what it started, and the "
          "node is not admitted, and a bad timeout is a usage error",
          "[health_check]") {
  TempDir work;
  const std::string pidfile = work.file("check.pid");
  Proc slow(launch_args({"--standalone", "--nproc_per_node=1", "--health_check_timeout=0.5",
                         "--health_check=echo $$ > " + pidfile + "; exec sleep 30"},
                        {"env", work.path()}));
  REQUIRE(slow.wait(30s) == 1);
  INFO(slow.err());
  CHECK(count_of(slow.err(), "launch: error:") == 1);
  CHECK(slow.err().find("did not finish within 0.5 s") != std::string::npos);
  std::string pid;
  std::ifstream(pidfile) >> pid;
  REQUIRE_FALSE(pid.empty());
  CHECK(::kill(std::stoi(pid), 0) == -1);  // gone (killed, and reaped by launch)
  CHECK_FALSE(std::ifstream(work.file("env.0")).good());

  Proc bad(launch_args({"--standalone", "--nproc_per_node=1", "--health_check_timeout=0",
                        "--health_check=true"},
                       {"env", work.path()}));
  REQUIRE(bad.wait(30s) == 2);
  CHECK(bad.err() == "launch: error: --health_check_timeout: must be more than 0 seconds\n");
}
