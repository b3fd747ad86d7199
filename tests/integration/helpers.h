// Shared by the integration tests: the binaries under test and what workers print.
#pragma once

#include <unistd.h>

#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "proc.h"

namespace muster::testing {

inline const std::string kLaunch = LAUNCH_BIN;
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

}  // namespace muster::testing
