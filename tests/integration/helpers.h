// Shared by the integration tests: the binaries under test and what workers print.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "proc.h"
#include "skip.h"

namespace muster::testing {

// The variable `name`, or `fallback` where it is unset or empty.
inline std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::string(v) : fallback;
}

// The suite's PyTorch cases run again against torch 2.x (tests/support/in_torch_root.sh): there
// launch is the wheel's, installed in a Debian root with that torch, and Python is the root's.
// Elsewhere: the build's launch and Debian 12's /usr/bin/python3 (torch 1.13).
inline const std::string kLaunch = env_or("MUSTER_TEST_LAUNCH", LAUNCH_BIN);
inline const std::string kPython = env_or("MUSTER_TEST_PYTHON", "/usr/bin/python3");
inline const std::string kWorker = TEST_WORKER_BIN;
inline const std::string kRdzvd = RDZVD_BIN;

inline std::vector<std::string> launch_args(const std::vector<std::string>& flags,
                                            const std::vector<std::string>& worker_args) {
  std::vector<std::string> argv{kLaunch};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back(kWorker);
  argv.insert(argv.end(), worker_args.begin(), worker_args.end());
  return argv;
}

inline std::map<std::string, std::string> read_env_file(const std::string& path) {
  std::map<std::string, std::string> env;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    auto eq = line.find('=');
    if (eq != std::string::npos) env[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return env;
}

// The pids printed by workers as "ready <pid>" (behind the launcher's prefix).
inline std::vector<pid_t> ready_pids(const std::string& out) {
  std::vector<pid_t> pids;
  static const std::regex re(R"(\]:ready (\d+))");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator();
       ++it) {
    pids.push_back(static_cast<pid_t>(std::stoi((*it)[1])));
  }
  return pids;
}

// Waits for `n` workers to have printed "ready ... <what>", e.g. "world 4 round 2".
inline auto has_ready(int n, const std::string& what = "") {
  return [n, what](const std::string& out, const std::string&) {
    static const std::regex re(R"(\]:ready \d+ (.*))");
    int count = 0;
    for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator();
         ++it) {
      if ((*it)[1].str().find(what) != std::string::npos) ++count;
    }
    return count >= n;
  };
}

// A wait_output predicate: `what` is in the process's stdout.
inline auto out_has(const std::string& what) {
  return [what](const std::string& out, const std::string&) {
    return out.find(what) != std::string::npos;
  };
}

// Whether kPython has torch (python3-torch, from scripts/setup --tests).
inline bool torch_importable() {
  Proc probe({kPython, "-c", "import torch.distributed"});
  return probe.wait(120s) == 0;
}

// The pids in "ready <pid> ... restart <n>" lines of `out`.
inline std::vector<pid_t> ready_with(const std::string& out, const std::string& restart) {
  std::vector<pid_t> pids;
  static const std::regex re(R"(\]:ready (\d+) world \d+ round \d+ restart (\d+))");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator();
       ++it) {
    if ((*it)[2].str() == restart) pids.push_back(static_cast<pid_t>(std::stoi((*it)[1])));
  }
  return pids;
}

// Each rank's start records (test_worker `signals` writes them to DIR/starts.<rank>) ("<pid> <restart count>" per start).
inline std::vector<std::string> starts(const TempDir& dir, int rank) {
  std::vector<std::string> lines;
  std::istringstream in(read_file(dir.file("starts." + std::to_string(rank))));
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// test_worker `signals`: each agent's workers are told to exit 0 (SIGUSR1), and every agent
// then exits 0.
inline void release_workers(std::initializer_list<Proc*> agents) {
  for (Proc* p : agents) {
    for (pid_t pid : ready_pids(p->out())) ::kill(pid, SIGUSR1);
  }
  for (Proc* p : agents) CHECK(p->wait(30s) == 0);
}

// Two agents `a` and `b` with 2 test_worker `signals` workers each in a round of restart 0:
// a worker of `a` fails (exit 3), which costs exactly one counted restart; then every worker
// exits 0, and so do both agents. Each of the 4 ranks started exactly twice (restart 0, then 1).
inline void fail_once_then_finish(Proc& a, Proc& b, const TempDir& work) {
  const std::vector<pid_t> first = ready_with(a.out(), "0");
  REQUIRE(first.size() == 2);
  ::kill(first[0], SIGUSR2);  // exits 3
  REQUIRE(a.wait_output(has_ready(2, "round 2 restart 1"), 30s));
  REQUIRE(b.wait_output(has_ready(2, "round 2 restart 1"), 30s));
  for (Proc* p : {&a, &b}) {
    for (pid_t pid : ready_with(p->out(), "1")) ::kill(pid, SIGUSR1);  // exit 0
  }
  CHECK(a.wait(30s) == 0);
  CHECK(b.wait(30s) == 0);
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    auto s = starts(work, r);
    REQUIRE(s.size() == 2);
    CHECK_THAT(s[0], Catch::EndsWith(" 0"));
    CHECK_THAT(s[1], Catch::EndsWith(" 1"));
  }
}

}  // namespace muster::testing
