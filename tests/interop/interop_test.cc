// Real PyTorch under `launch`: Debian's python3-torch (CPU, gloo), run by /usr/bin/python3.
// Exits 77 (ctest: Skipped) where that torch is not installed.
#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>

#include <regex>
#include <set>

#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "helpers.h"

using namespace muster::testing;

namespace {

const std::string kScripts = INTEROP_DIR;
const std::map<std::string, std::optional<std::string>> kEnv{{"PYTHON_EXEC", kPython}};

std::set<std::string> checksums(const std::string& out, int world) {
  std::set<std::string> sums;
  std::regex re(R"(rank (\d+)/(\d+) params_identical=True checksum=(\S+))");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it) {
    if (std::stoi((*it)[2]) == world) sums.insert((*it)[3]);
  }
  return sums;
}

}  // namespace

TEST_CASE("interop: DDP with gloo, standalone, 2 and 4 workers: identical parameters", "[interop]") {
  for (int n : {2, 4}) {
    Proc p({kLaunch, "--standalone", "--nproc_per_node=" + std::to_string(n),
            kScripts + "/ddp_train.py"},
           kEnv);
    INFO(p.err());
    REQUIRE(p.wait(300s) == 0);
    CHECK(count_lines_with(p.out(), "params_identical=True") == n);
    CHECK(count_lines_with(p.out(), "agent_store=True") == n);  // on the run's store
    CHECK(checksums(p.out(), n).size() == 1);
  }
}

TEST_CASE("interop: DDP across two agents on loopback (c10d)", "[interop]") {
  const std::string ep = "127.0.0.1:" + std::to_string(free_port());
  auto args = [&](int nproc) {
    return std::vector<std::string>{kLaunch, "--nnodes=2", "--nproc_per_node=" + std::to_string(nproc),
                                    "--rdzv_backend=c10d", "--rdzv_endpoint=" + ep,
                                    "--rdzv_id=ddp", kScripts + "/ddp_train.py"};
  };
  Proc a(args(1), kEnv);
  Proc b(args(1), kEnv);
  REQUIRE(a.wait(300s) == 0);
  REQUIRE(b.wait(300s) == 0);
  auto sums = checksums(a.out() + b.out(), 2);
  CHECK(sums.size() == 1);
  CHECK(count_lines_with(a.out() + b.out(), "params_identical=True") == 2);
  CHECK(count_lines_with(a.out() + b.out(), "agent_store=True") == 2);
}

TEST_CASE("interop: a script that fails once succeeds after a restart", "[interop]") {
  Proc p({kLaunch, "--standalone", "--nproc_per_node=2", "--max_restarts=1",
          kScripts + "/fail_once.py"},
         kEnv);
  INFO(p.err());
  REQUIRE(p.wait(300s) == 0);
  CHECK_THAT(p.out(), Catch::Contains("rank 0 attempt 1 sum 2"));
  CHECK_THAT(p.out(), Catch::Contains("rank 1 attempt 1 sum 2"));
}

TEST_CASE("interop: @record's exception message is in the failure summary", "[interop]") {
  Proc p({kLaunch, "--standalone", "--nproc_per_node=1", kScripts + "/record_fail.py"}, kEnv);
  REQUIRE(p.wait(300s) == 1);
  CHECK_THAT(p.err(), Catch::Contains("record_fail.py FAILED"));
  CHECK_THAT(p.err(), Catch::Contains("ValueError: interop: the loss went to NaN at step 7"));
  CHECK_THAT(p.err(), Catch::Contains("traceback : Traceback (most recent call last):"));
}

TEST_CASE("interop: -m package.module", "[interop]") {
  auto env = kEnv;
  env["PYTHONPATH"] = kScripts;
  Proc p({kLaunch, "--standalone", "--nproc_per_node=2", "-m", "pkg.train_mod"}, env);
  INFO(p.err());
  REQUIRE(p.wait(300s) == 0);
  CHECK_THAT(p.out(), Catch::Contains("module rank 0 of 2"));
  CHECK_THAT(p.out(), Catch::Contains("module rank 1 of 2"));
}

TEST_CASE("interop: with PYTHON_EXEC unset, a torch script runs under the python3 on PATH that "
          "has torch, not the first one",
          "[interop][python]") {
  TempDir dir;
  // A python3 without torch first on PATH (it answers no to everything), then Debian's.
  std::ofstream(dir.file("python3")) << "#!/bin/sh\necho 'fake python3 ran' >&2\nexit 1\n";
  ::chmod(dir.file("python3").c_str(), 0755);
  std::ofstream(dir.file("job.py")) << "import sys\nimport torch\n"
                                       "print('torch', torch.__version__, sys.executable)\n";
  Proc p({kLaunch, "--standalone", dir.file("job.py")},
         {{"PATH", dir.path() + ":/usr/bin:/bin"}, {"PYTHON_EXEC", std::nullopt},
          {"VIRTUAL_ENV", std::nullopt}, {"MUSTER_LOG_LEVEL", "info"}});
  INFO(p.err());
  REQUIRE(p.wait(120s) == 0);
  CHECK_THAT(p.out(), Catch::Contains("[default0]:torch "));
  CHECK_THAT(p.out(), Catch::Contains(" /usr/bin/python3\n"));
  CHECK_THAT(p.err(), Catch::Contains("runs under /usr/bin/python3 (the first python3 on PATH that "
                                      "can import torch)"));
  CHECK(p.err().find("fake python3 ran") == std::string::npos);  // probed, never a worker
}

TEST_CASE("interop: torch's FileTimerClient: a worker stuck past expires() is killed, the group "
          "restarts",
          "[interop]") {
  auto env = kEnv;
  env["TORCHELASTIC_ENABLE_FILE_TIMER"] = "1";
  Proc p({kLaunch, "--standalone", "--nproc_per_node=2", "--max_restarts=1",
          kScripts + "/stuck_timer.py"},
         env);
  INFO(p.err());
  REQUIRE(p.wait(300s) == 0);
  // Attempt 0: rank 0 left its timer in time, rank 1 was stuck inside it and got SIGKILL.
  CHECK_THAT(p.out(), Catch::Contains("rank 0 attempt 0 done"));
  CHECK_THAT(p.out(), !Catch::Contains("rank 1 attempt 0 done"));
  CHECK_THAT(p.err(), Catch::Contains("file timer: scope 'step' of worker rank 1"));
  // Attempt 1: both finish.
  CHECK_THAT(p.out(), Catch::Contains("rank 0 attempt 1 done"));
  CHECK_THAT(p.out(), Catch::Contains("rank 1 attempt 1 done"));
}

TEST_CASE("interop: the run's store speaks torch's TCPStore protocol: env:// uses it, it "
          "outlives rank 0, and the next attempt's world has a store of its own",
          "[interop]") {
  Proc p({kLaunch, "--standalone", "--nproc_per_node=3", "--max_restarts=1",
          kScripts + "/agent_store.py"},
         kEnv);
  INFO(p.out() << p.err());
  REQUIRE(p.wait(300s) == 0);
  for (int r = 0; r < 3; ++r) {
    CHECK_THAT(p.out(), Catch::Contains("rank " + std::to_string(r) +
                                        " attempt 1 agent store ok, attempt 0 left 0 keys"));
  }
  CHECK_THAT(p.err(), Catch::Contains("restart 1 of 1"));
  // Each world on a port of its own, the same for every rank of it.
  std::map<int, std::set<std::string>> ports;  // attempt -> ports its ranks were given
  std::regex re(R"(rank \d attempt (\d) store port (\d+))");
  const std::string out = p.out();
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator(); ++it) {
    ports[std::stoi((*it)[1])].insert((*it)[2]);
  }
  REQUIRE(ports[0].size() == 1);
  REQUIRE(ports[1].size() == 1);
  CHECK(*ports[0].begin() != *ports[1].begin());
}

TEST_CASE("interop: --rdzv_conf use_agent_store=false: rank 0 hosts torch's own TCPStore on "
          "MASTER_PORT",
          "[interop]") {
  Proc p({kLaunch, "--standalone", "--nproc_per_node=3", "--rdzv_conf=use_agent_store=false",
          kScripts + "/own_store.py"},
         kEnv);
  INFO(p.err());
  REQUIRE(p.wait(300s) == 0);
  for (int r = 0; r < 3; ++r) {
    CHECK_THAT(p.out(), Catch::Contains("rank " + std::to_string(r) + " own store ok 3"));
  }
}

namespace {

// Lines "rank R/W <what>" in `out` (behind the launcher's prefix).
int lines_of_world(const std::string& out, int world, const std::string& what) {
  return count_lines_with(out, "/" + std::to_string(world) + " " + what);
}

auto world_at(int world, const std::string& what, int n) {
  return [=](const std::string& out, const std::string&) {
    return lines_of_world(out, world, what) >= n;
  };
}

// Every rank of the finished world of `world` ranks trained `steps` steps and printed the same
// parameter checksum.
void check_finished(const std::string& out, int world, int steps) {
  CHECK(lines_of_world(out, world, "params_identical=True") == world);
  CHECK(count_lines_with(out, "steps=" + std::to_string(steps)) == world);
  CHECK(checksums(out, world).size() == 1);
}

// The wall clock (seconds) of the first "rank R/W step 0 t=T" of a world of `world` ranks.
std::optional<double> first_step_time(const std::string& out, int world) {
  std::smatch m;
  if (!std::regex_search(out, m, std::regex("/" + std::to_string(world) + R"( step 0 t=(\d+\.\d+))"))) {
    return std::nullopt;
  }
  return std::stod(m[1]);
}

double wall_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// --rdzv_conf=`conf`, and --in_place when asked.
std::vector<std::string> job_flags(const std::string& conf, bool in_place) {
  std::vector<std::string> f{"--rdzv_conf=" + conf};
  if (in_place) f.push_back("--in_place");
  return f;
}

std::vector<std::string> elastic_job(const std::string& ep, const std::string& id,
                                     std::vector<std::string> extra, int finish_world) {
  std::vector<std::string> argv{kLaunch, "--nnodes=1:2", "--nproc_per_node=2",
                                "--rdzv_backend=c10d", "--rdzv_endpoint=" + ep, "--rdzv_id=" + id};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.insert(argv.end(), {kScripts + "/ddp_train.py", "10",
                           "--finish_world=" + std::to_string(finish_world)});
  return argv;
}

}  // namespace

// Issue 38: the world that follows a node's loss has the same TORCHELASTIC_RESTART_COUNT as the
// one before (a node leaving is not a restart, as in torchrun), so torch's /worker/attempt_<N>
// keys are the same names; each world's store is its own, so the new one never reads the old
// world's gloo addresses. The default --max_restarts=0: nothing may be counted.
TEST_CASE("interop: a node killed -9 mid-training: the survivor trains on in the smaller "
          "world and exits 0, with and without --in_place (max_restarts=0)",
          "[interop]") {
  for (bool in_place : {false, true}) {
    const std::string ep = "127.0.0.1:" + std::to_string(free_port());
    // The first hosts the rendezvous (it survives); both join its first round (last call: 30 s).
    Proc a(elastic_job(ep, "leave", job_flags("is_host=true", in_place), 2), kEnv);
    Proc b(elastic_job(ep, "leave", job_flags("is_host=false", in_place), 2), kEnv);
    for (Proc* p : {&a, &b}) {
      const bool training = p->wait_output(world_at(4, "step 3", 2), 120s);
      INFO(p->out() << p->err());
      REQUIRE(training);
    }
    ::kill(b.pid(), SIGKILL);
    const double killed = wall_now();
    CHECK(b.wait(60s) == 128 + SIGKILL);
    const auto rc = a.wait(300s);
    INFO("in_place=" << in_place << "\n" << a.out() << a.err());
    REQUIRE(rc == 0);
    check_finished(a.out(), 2, 10);
    CHECK(count_lines_with(a.out(), "joined attempt=0") == 4);  // its 2 ranks of 4, then of 2
    CHECK_THAT(a.out(), !Catch::Contains("joined attempt=1"));
    // The time from the loss to the smaller world's first step (bench/README.md has the
    // figure; printed here for whoever reads the log).
    if (auto t = first_step_time(a.out(), 2)) {
      std::printf("in_place=%d: first step in the smaller world %.2f s after the kill\n",
                  in_place, *t - killed);
    }
  }
}

TEST_CASE("interop: a node joining a running job: both train in the larger world and exit 0, "
          "with and without --in_place",
          "[interop]") {
  for (bool in_place : {false, true}) {
    const std::string ep = "127.0.0.1:" + std::to_string(free_port());
    Proc a(elastic_job(ep, "join", job_flags("last_call_timeout=1,is_host=true", in_place), 4), kEnv);
    {
      const bool training = a.wait_output(world_at(2, "step 3", 2), 120s);
      INFO(a.out() << a.err());
      REQUIRE(training);
    }
    Proc b(elastic_job(ep, "join", job_flags("last_call_timeout=1,is_host=false", in_place), 4), kEnv);
    for (Proc* p : {&a, &b}) {
      const auto rc = p->wait(300s);
      INFO("in_place=" << in_place << "\n" << p->out() << p->err());
      REQUIRE(rc == 0);
    }
    check_finished(a.out() + b.out(), 4, 10);
    CHECK(count_lines_with(a.out() + b.out(), "joined attempt=0") == 6);  // 2, then 4
    CHECK_THAT(a.out() + b.out(), !Catch::Contains("joined attempt=1"));
  }
}

int main(int argc, char** argv) {
  Proc probe({kPython, "-c", "import torch.distributed"});
  if (probe.wait(120s) != 0) {
    std::printf("SKIPPED: %s cannot import torch (install python3-torch)\n", kPython.c_str());
    return kSkipExit;
  }
  return catch_exit(Catch::Session().run(argc, argv));
}
