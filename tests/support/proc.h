// Real processes for integration tests: argv is fork+exec'd with stdout and stderr on pipes;
// every wait is bounded and event driven (poll on the pipes and on a pidfd, no sleeps).
// The destructor ends a process that is still running, by its pid.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace muster::testing {

using namespace std::chrono_literals;

class Proc {
 public:
  // env: variables to set (value) or remove (nullopt) on top of this process's environment.
  Proc(const std::vector<std::string>& argv,
       const std::map<std::string, std::optional<std::string>>& env = {});
  ~Proc();
  Proc(const Proc&) = delete;
  Proc& operator=(const Proc&) = delete;

  pid_t pid() const { return pid_; }

  // Reads output until pred(stdout, stderr) holds; false when `timeout` passes first or the
  // process has exited and closed its output without satisfying it.
  bool wait_output(const std::function<bool(const std::string&, const std::string&)>& pred,
                   std::chrono::milliseconds timeout);

  // Waits for exit while draining output. Returns the exit code, or 128+N when killed by
  // signal N; nullopt on timeout.
  std::optional<int> wait(std::chrono::milliseconds timeout = 60s);

  const std::string& out() const { return out_; }
  const std::string& err() const { return err_; }

 private:
  bool pump(std::chrono::steady_clock::time_point deadline, bool want_exit);

  pid_t pid_ = -1;
  int pidfd_ = -1;
  int out_fd_ = -1, err_fd_ = -1;
  std::string out_, err_;
  std::optional<int> status_;
};

// Waits until the process `pid` (not necessarily our child) has exited. `pidfd` must have been
// opened with open_pidfd() while the process was alive.
int open_pidfd(pid_t pid);
bool wait_pidfd(int pidfd, std::chrono::milliseconds timeout);

// A TCP port for tests whose processes must all be told one endpoint in advance (port 0
// cannot be shared). It is this process's until it exits: taken from a range the kernel never
// picks for bind(0) or connect() (outside net.ipv4.ip_local_port_range) and locked against
// every other test process (an flock per port), so nothing else binds it before the program
// does. Where the program can pick (port 0, read back), let it. Throws when none is left.
int free_port();
// Two consecutive such ports (the static rendezvous: MASTER_PORT for torch's TCPStore, the
// next one for launch's server); returns the first, 0 when no pair is free.
int free_port_pair();

// An upper bound on how long something takes on this machine, times MUSTER_TEST_TIME_FACTOR
// (a number >= 1, default 1; a slow or loaded CI machine sets it). Only for bounds that say
// "quickly" in a functional test; what is fast enough is the benchmarks' business (bench/).
std::chrono::milliseconds scaled(std::chrono::milliseconds bound);

// The path of an executable `name` on PATH, or "" (a test whose tool is missing skips).
std::string find_on_path(const std::string& name);

// A fresh empty folder under TMPDIR, removed by the destructor.
class TempDir {
 public:
  TempDir();
  // Under `base` instead of TMPDIR.
  explicit TempDir(const std::string& base);
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

std::string read_file(const std::string& path);
int count_lines_with(const std::string& text, const std::string& needle);
// `s` without its trailing newlines, carriage returns and spaces (a tool's output, for a message).
std::string trim_end(std::string s);

}  // namespace muster::testing
