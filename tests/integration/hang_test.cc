// --hang_timeout with a Python worker (docs/hangs.md): its tracebacks, from faulthandler, are in
// its stack file, and the job fails with the hang as its cause.
#include <catch2/catch.hpp>
#include <algorithm>
#include <regex>

#include "helpers.h"
#include "skip.h"

using namespace muster::testing;

TEST_CASE("hang: a Python worker stuck in time.sleep is named, its traceback is in the dump",
          "[hang]") {
  TempDir logs;
  Proc p({kLaunch, "--standalone", "--nproc_per_node=3", "--hang_timeout=1", "--log_dir",
          logs.path(), std::string(INTEROP_SCRIPTS_DIR) + "/hang_in_sleep.py"},
         {{"PYTHON_EXEC", kPython}, {"PYTHONPATH", MUSTER_PYTHON_DIR}});
  const auto rc = p.wait(60s);
  INFO(p.out() << p.err());
  CHECK(rc == 1);  // no restarts: the job fails, the hang its cause
  CHECK_THAT(p.out(), Catch::Contains("rank 1: hanging at step 3"));
  const std::string err = p.err();
  std::smatch m;
  REQUIRE(std::regex_search(
      err, m,
      std::regex(R"(hang: rank 1 \(host \S+, local rank 1, pid \d+\) stuck at step 3 in phase )"
                 R"('data_loader' for \d+\.\d s; 2 ranks got further \(up to step 3\); writing )"
                 R"(its stacks to (\S+stacks\.txt))")));
  const std::string stacks = read_file(m[1].str());
  CHECK_THAT(stacks, Catch::Contains("in wait_for_batch_forever"));
  CHECK_THAT(stacks, Catch::Contains("hang_in_sleep.py"));
  // torchrun's failure summary names the cause and carries the traceback.
  CHECK_THAT(err, Catch::Contains("message   : hang: rank 1"));
}

TEST_CASE("hang: an unmodified DDP script stuck in its data loading is named, with its phase",
          "[hang][torch]") {
  if (!torch_importable()) MUSTER_SKIP(kPython + " cannot import torch (install python3-torch)");
  // The script imports nothing of muster's and PYTHONPATH is unset: the step counting is the
  // hook launch puts on the workers' PYTHONPATH for a run with a hang timeout.
  TempDir logs;
  // 5 s: three interpreters importing torch on a loaded 2-core machine can take 2 s between
  // one rank's first step and another's, which a shorter timeout would call a hang.
  constexpr double kTimeout = 5.0;
  Proc p({kLaunch, "--standalone", "--nproc_per_node=3", "--hang_timeout=5", "--log_dir",
          logs.path(), std::string(INTEROP_SCRIPTS_DIR) + "/ddp_hang_in_data.py", "100", "stuck"},
         {{"PYTHON_EXEC", kPython}, {"PYTHONPATH", std::nullopt},
          {"MUSTER_PROGRESS_AUTO", std::nullopt}});
  const auto rc = p.wait(90s);
  INFO(p.out() << p.err());
  CHECK(rc == 1);
  CHECK(count_lines_with(p.out(), "auto_progress=True") == 3);
  CHECK_THAT(p.out(), Catch::Contains("rank 1: loading step 3 forever"));
  const std::string err = p.err();
  std::smatch m;
  REQUIRE(std::regex_search(
      err, m,
      std::regex(R"(hang: rank 1 \(host \S+, local rank 1, pid \d+\) stuck at step 3 in phase )"
                 R"('between_steps' for (\d+\.\d) s; 2 ranks got further \(up to step 3\); )"
                 R"(writing its stacks to (\S+stacks\.txt))")));
  // Named once still for the timeout, within one sampling period (a quarter of it, at most
  // 1 s) more.
  CHECK(std::stod(m[1].str()) >= kTimeout);
  CHECK(std::stod(m[1].str()) <= kTimeout + std::min(kTimeout / 4, 1.0) + 0.2);
  CHECK_THAT(read_file(m[2].str()), Catch::Contains("in load_batch"));
}

TEST_CASE("hang: without --hang_timeout a Python worker's PYTHONPATH is left as it is",
          "[hang][torch]") {
  if (!torch_importable()) MUSTER_SKIP(kPython + " cannot import torch (install python3-torch)");
  Proc p({kLaunch, "--standalone", "--nproc_per_node=2",
          std::string(INTEROP_SCRIPTS_DIR) + "/ddp_hang_in_data.py", "2"},
         {{"PYTHON_EXEC", kPython}, {"PYTHONPATH", std::nullopt}});
  const auto rc = p.wait(90s);
  INFO(p.out() << p.err());
  CHECK(rc == 0);
  CHECK(count_lines_with(p.out(), "auto_progress=False") == 2);
  CHECK(count_lines_with(p.out(), ": done") == 2);
}

TEST_CASE("hang: across nodes, the server names the rank no node alone could tell is behind",
          "[hang]") {
  // Two agents of one worker each: rank 1 sleeps forever, rank 0 (on the other node) waits in
  // the step's all_reduce. Each agent sees one rank, still; only the server sees both.
  TempDir logs;
  const std::string ep = "127.0.0.1:" + std::to_string(free_port());
  auto agent = [&](const std::string& host_flag) {
    return std::make_unique<Proc>(
        std::vector<std::string>{kLaunch, "--nnodes=2", "--nproc_per_node=1",
                                 "--rdzv_backend=c10d", "--rdzv_endpoint=" + ep, "--rdzv_id=hang",
                                 "--hang_timeout=1", "--log_dir", logs.path(), host_flag,
                                 std::string(INTEROP_SCRIPTS_DIR) + "/hang_in_sleep.py"},
        std::map<std::string, std::optional<std::string>>{{"PYTHON_EXEC", kPython},
                                                          {"PYTHONPATH", MUSTER_PYTHON_DIR}});
  };
  auto a = agent("--local_addr=node-a");
  auto b = agent("--local_addr=node-b");
  for (Proc* p : {a.get(), b.get()}) {
    const auto rc = p->wait(60s);
    INFO(p->out() << p->err());
    CHECK(rc == 1);
  }
  const std::string err = a->err() + b->err();
  INFO(err);
  std::smatch m;
  REQUIRE(std::regex_search(
      err, m,
      std::regex(R"(hang: rank 1 \(host (node-[ab]), local rank 0, pid \d+\) stuck at step 3 in )"
                 R"(phase 'data_loader' for \d+\.\d s; 1 rank got further \(up to step 3\))")));
  // Told to the node that holds rank 1, which dumped it.
  Proc& holder = m[1].str() == "node-a" ? *a : *b;
  CHECK_THAT(holder.err(), Catch::Contains("writing its stacks to"));
  CHECK_THAT(holder.out(), Catch::Contains("rank 1: hanging at step 3"));
}

TEST_CASE("budget: a job that keeps failing before any step stops with exit code 3",
          "[hang]") {
  // Rank 0 exits at once, every attempt, before reporting anything (no report: no step).
  Proc p(launch_args({"--standalone", "--nproc_per_node=2", "--max_restarts=10",
                      "--max_restarts_without_progress=2"},
                     {"exit", "5", "0"}));
  const auto rc = p.wait(60s);
  INFO(p.err());
  CHECK(rc == 3);
  CHECK(count_lines_with(p.err(), "restarting workers") == 2);
  CHECK_THAT(p.err(), Catch::Contains("3 rounds in a row before any rank made a step") &&
                          Catch::Contains("(do not requeue)"));
}
