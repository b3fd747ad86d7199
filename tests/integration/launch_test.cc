// The real `launch` binary with real worker processes, on 127.0.0.1.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "helpers.h"

using namespace muster::testing;
using Env = std::map<std::string, std::optional<std::string>>;

namespace {

bool alive(pid_t pid) {
  // A zombie that init has yet to reap counts as dead.
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string s;
  if (!std::getline(stat, s)) return false;
  auto close = s.rfind(')');
  return close != std::string::npos && close + 2 < s.size() && s[close + 2] != 'Z';
}

}  // namespace

TEST_CASE("launch: every worker gets torchrun's environment (N=4)", "[launch]") {
  TempDir dir;
  Proc p(
      launch_args({"--standalone", "--nproc_per_node=4", "--max_restarts=2"}, {"env", dir.path()}),
      Env{{"OMP_NUM_THREADS", std::nullopt},
          {"TORCH_NCCL_ASYNC_ERROR_HANDLING", std::nullopt},
          {"RANK", "99"}});
  REQUIRE(p.wait() == 0);
  std::set<std::string> run_ids, masters, error_files;
  for (int r = 0; r < 4; ++r) {
    auto env = read_env_file(dir.file("env." + std::to_string(r)));
    INFO("rank " << r);
    CHECK(env["RANK"] == std::to_string(r));
    CHECK(env["LOCAL_RANK"] == std::to_string(r));
    CHECK(env["WORLD_SIZE"] == "4");
    CHECK(env["LOCAL_WORLD_SIZE"] == "4");
    CHECK(env["GROUP_RANK"] == "0");
    CHECK(env["GROUP_WORLD_SIZE"] == "1");
    CHECK(env["ROLE_RANK"] == std::to_string(r));
    CHECK(env["ROLE_NAME"] == "default");
    CHECK(env["ROLE_WORLD_SIZE"] == "4");
    CHECK(env["TORCHELASTIC_RESTART_COUNT"] == "0");
    CHECK(env["TORCHELASTIC_MAX_RESTARTS"] == "2");
    // MASTER_ADDR:MASTER_PORT is the run's TCPStore-protocol store (torchrun 2.x's agent store).
    CHECK(env["TORCHELASTIC_USE_AGENT_STORE"] == "True");
    CHECK(env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1");
    CHECK(env["OMP_NUM_THREADS"] == "1");
    CHECK(std::regex_match(
        env["TORCHELASTIC_RUN_ID"],
        std::regex("[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")));
    CHECK(env["MUSTER_RUN_ID"] == env["TORCHELASTIC_RUN_ID"]);
    CHECK(env["MUSTER_ROUND"] == "1");
    CHECK(std::regex_match(env["MUSTER_STORE_ADDR"], std::regex(R"(unix-abstract:muster-rdzv-\d+-\d+)")));
    const int port = std::stoi(env["MASTER_PORT"]);
    CHECK(port > 0);
    CHECK(port < 65536);
    CHECK_FALSE(env["MASTER_ADDR"].empty());
    CHECK_THAT(env["TORCHELASTIC_ERROR_FILE"],
               Catch::EndsWith("/attempt_0/" + std::to_string(r) + "/error.json"));
    run_ids.insert(env["TORCHELASTIC_RUN_ID"]);
    masters.insert(env["MASTER_ADDR"] + ":" + env["MASTER_PORT"]);
    error_files.insert(env["TORCHELASTIC_ERROR_FILE"]);
  }
  CHECK(run_ids.size() == 1);
  CHECK(masters.size() == 1);
  CHECK(error_files.size() == 4);
}

TEST_CASE("launch: no endpoint, one node and no master port is --standalone (torchrun 2.6+)",
          "[launch]") {
  // Two such jobs on one host at once: each gets a store of its own on a free port and a
  // random run id (the static defaults would have both on MASTER_PORT=29500).
  TempDir a, b;
  Proc pa(launch_args({"--nproc_per_node=2"}, {"env", a.path()}));
  Proc pb(launch_args({"--nproc_per_node=2"}, {"env", b.path()}));
  REQUIRE(pa.wait() == 0);
  REQUIRE(pb.wait() == 0);
  auto ea = read_env_file(a.file("env.1"));
  auto eb = read_env_file(b.file("env.1"));
  CHECK(ea["TORCHELASTIC_USE_AGENT_STORE"] == "True");
  CHECK(ea["MASTER_PORT"] != "29500");
  CHECK(ea["MASTER_PORT"] != eb["MASTER_PORT"]);
  CHECK(ea["TORCHELASTIC_RUN_ID"] != "none");
  CHECK(ea["TORCHELASTIC_RUN_ID"] != eb["TORCHELASTIC_RUN_ID"]);
  // A master port given keeps torchrun's static rendezvous.
  TempDir c;
  const int port = free_port();
  Proc pc(launch_args({"--nproc_per_node=1", "--master_port=" + std::to_string(port)},
                      {"env", c.path()}));
  REQUIRE(pc.wait() == 0);
  auto ec = read_env_file(c.file("env.0"));
  CHECK(ec["MASTER_PORT"] == std::to_string(port));
  CHECK(ec["TORCHELASTIC_RUN_ID"] == "none");
}

TEST_CASE("launch: --rdzv_conf store_cache=false: the workers use their agent's store, whose "
          "agent answers none of their reads itself",
          "[launch]") {
  TempDir dir;
  Proc p(launch_args({"--standalone", "--nproc_per_node=2", "--rdzv_conf=store_cache=false"},
                     {"env", dir.path()}),
         Env{{"MUSTER_LOG_LEVEL", "info"}});
  REQUIRE(p.wait() == 0);
  CHECK(read_env_file(dir.file("env.1"))["TORCHELASTIC_USE_AGENT_STORE"] == "True");
  INFO(p.err());
  CHECK(count_lines_with(p.err() + p.out(), "every read of the workers goes to the server") == 1);
}

TEST_CASE("launch: --nproc_per_node=xpu counts Level Zero's devices", "[launch]") {
  TempDir dir;
  Proc p(launch_args({"--standalone", "--nproc_per_node=xpu"}, {"env", dir.path()}),
         Env{{"LD_LIBRARY_PATH", std::string(FAKE_ZE_DIR)}, {"FAKE_ZE_DEVICES", "3"}});
  REQUIRE(p.wait() == 0);
  CHECK(read_env_file(dir.file("env.2"))["WORLD_SIZE"] == "3");
  CHECK_FALSE(std::filesystem::exists(dir.file("env.3")));
  Proc none(launch_args({"--standalone", "--nproc_per_node=xpu"}, {"env", dir.path()}),
            Env{{"LD_LIBRARY_PATH", std::string(FAKE_ZE_DIR)}, {"FAKE_ZE_DEVICES", "0"}});
  CHECK(none.wait() == 2);
  CHECK(none.err() == "launch: error: --nproc_per_node=xpu: no Intel GPU is visible (Level "
                      "Zero's libze_loader.so.1)\n");
}

TEST_CASE("launch: a user's OMP_NUM_THREADS is kept", "[launch]") {
  TempDir dir;
  Proc p(launch_args({"--standalone", "--nproc_per_node=2"}, {"env", dir.path()}),
         Env{{"OMP_NUM_THREADS", "3"}});
  REQUIRE(p.wait() == 0);
  CHECK(read_env_file(dir.file("env.1"))["OMP_NUM_THREADS"] == "3");
}

TEST_CASE("launch: a failing worker stops the group, launch exits 1 with the root cause",
          "[launch]") {
  Proc p(launch_args({"--standalone", "--nproc_per_node=3"}, {"exit", "3", "1"}));
  REQUIRE(p.wait() == 1);
  CHECK_THAT(p.err(), Catch::Contains(kWorker + " FAILED"));
  CHECK_THAT(p.err(), Catch::Contains("Root Cause (first observed failure):"));
  CHECK_THAT(p.err(), Catch::Contains("  rank      : 1 (local_rank: 1)\n"));
  CHECK_THAT(p.err(), Catch::Contains("  exitcode  : 3 (pid: "));
  CHECK_THAT(p.out(), Catch::Contains("[default1]:rank 1 exiting with 3\n"));
}

TEST_CASE("launch: a worker killed by a signal is named in the summary", "[launch]") {
  Proc p(launch_args({"--standalone", "--nproc_per_node=1"}, {"partial"}));
  REQUIRE(p.wait() == 1);
  // The line it was writing when it died still arrives, whole and prefixed.
  CHECK_THAT(p.out(), Catch::Contains("[default0]:no newline at the end\n"));
  CHECK_THAT(p.err(), Catch::Contains("  exitcode  : -9 (pid: "));
  CHECK_THAT(p.err(), Catch::Contains("Signal 9 (SIGKILL) received by PID"));
}

TEST_CASE("launch: the worker's error file message is in the summary", "[launch]") {
  Proc p(
      launch_args({"--standalone", "--nproc_per_node=2"}, {"errfile", "ValueError: loss is NaN"}));
  REQUIRE(p.wait() == 1);
  CHECK_THAT(p.err(), Catch::Contains("  message   : ValueError: loss is NaN\n"));
  CHECK_THAT(p.err(), Catch::Contains("  traceback : Traceback (most recent call last):\n"));
}

TEST_CASE("launch: restarts count up to --max_restarts", "[launch]") {
  SECTION("the job succeeds on the last allowed restart") {
    TempDir dir;
    Proc p(launch_args({"--standalone", "--nproc_per_node=2", "--max_restarts=2"},
                       {"restart", dir.path(), "2"}));
    REQUIRE(p.wait() == 0);
    CHECK(read_file(dir.file("restarts.0")) == "0\n1\n2\n");
    // Rank 1 may be stopped before it starts in a failing attempt; the last one it saw.
    CHECK_THAT(read_file(dir.file("restarts.1")), Catch::EndsWith("2\n"));
  }
  SECTION("the budget runs out first") {
    TempDir dir;
    Proc p(launch_args({"--standalone", "--nproc_per_node=2", "--max_restarts=1"},
                       {"restart", dir.path(), "2"}));
    REQUIRE(p.wait() == 1);
    CHECK(read_file(dir.file("restarts.0")) == "0\n1\n");
    CHECK_THAT(p.err(), Catch::Contains("  exitcode  : 3 (pid: "));
  }
}

TEST_CASE("launch: SIGTERM is forwarded to every worker, launch exits 143", "[launch]") {
  TempDir dir;
  Proc p(launch_args({"--standalone", "--nproc_per_node=3"}, {"term", dir.path(), "handle"}));
  REQUIRE(p.wait_output(has_ready(3), 30s));
  ::kill(p.pid(), SIGTERM);
  REQUIRE(p.wait() == 143);
  for (int r = 0; r < 3; ++r) {
    CHECK(read_file(dir.file("term." + std::to_string(r))) == "SIGTERM\n");
  }
}

namespace {

// The names of a process's threads (/proc/PID/task/*/comm).
std::vector<std::string> thread_names(pid_t pid) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& t : std::filesystem::directory_iterator(
           "/proc/" + std::to_string(pid) + "/task", ec)) {
    std::string name = read_file((t.path() / "comm").string());
    if (!name.empty() && name.back() == '\n') name.pop_back();
    names.push_back(name);
  }
  return names;
}

// The local addresses (hex, as /proc/net/tcp{,6} write them) of the listening TCP sockets
// `pid` holds.
std::vector<std::string> listening_addresses(pid_t pid) {
  std::set<std::string> inodes;
  std::error_code ec;
  const std::string fd_dir = "/proc/" + std::to_string(pid) + "/fd";
  for (const auto& fd : std::filesystem::directory_iterator(fd_dir, ec)) {
    const std::string target = std::filesystem::read_symlink(fd.path(), ec).string();
    if (target.rfind("socket:[", 0) == 0) inodes.insert(target.substr(8, target.size() - 9));
  }
  std::vector<std::string> out;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::istringstream lines(read_file(table));
    std::string line;
    std::getline(lines, line);  // the header
    while (std::getline(lines, line)) {
      std::istringstream f(line);
      std::string sl, local, remote, state, queues, timer, retr, uid, timeout, inode;
      f >> sl >> local >> remote >> state >> queues >> timer >> retr >> uid >> timeout >> inode;
      if (state == "0A" && inodes.count(inode) != 0) out.push_back(local);
    }
  }
  return out;
}

}  // namespace

TEST_CASE("launch: a standalone job starts no gRPC for its own rendezvous and listens on loopback "
          "only, and a worker's store call starts it",
          "[launch]") {
  Proc p(launch_args({"--standalone", "--nproc_per_node=1"}, {"wait"}));
  REQUIRE(p.wait_output(has_ready(1), 30s));
  // gRPC's own threads (its timers, executors, event engine) are not there: the agent reached
  // the embedded server in-process, and no worker has called the store.
  for (const std::string& name : thread_names(p.pid())) {
    INFO(name);
    CHECK(name.find("grpc") == std::string::npos);
    CHECK(name.find("executo") == std::string::npos);
    CHECK(name.find("event_engine") == std::string::npos);
    CHECK(name.find("timer_manager") == std::string::npos);
  }
  const std::vector<std::string> listening = listening_addresses(p.pid());
  CHECK_FALSE(listening.empty());  // the store ports (gRPC on demand, and the TCPStore one)
  for (const std::string& a : listening) {
    INFO(a);
    const bool loopback = a.rfind("0100007F:", 0) == 0 ||  // 127.0.0.1
                          a.rfind("00000000000000000000000001000000:", 0) == 0;  // ::1
    CHECK(loopback);
  }
  ::kill(p.pid(), SIGTERM);
  CHECK(p.wait() == 143);

  // Workers that call the store (the C++ runtime's gRPC store) are served: gRPC starts then.
  Proc q({kLaunch, "--standalone", "--nproc_per_node=2", COLLECTIVE_WORKER_BIN, "sum"});
  CHECK(q.wait() == 0);
  CHECK_THAT(q.out(), Catch::Contains("rank 1: sum correct"));
}

// launch in a mount namespace of its own whose resolver knows only `hosts` (files only: a
// name not there is "not known" at once, as a name a headless service has not published yet).
std::vector<std::string> with_hosts_file(const TempDir& dir, const std::string& hosts,
                                         std::vector<std::string> argv) {
  std::ofstream(dir.file("hosts")) << hosts;
  std::ofstream(dir.file("nsswitch.conf")) << "hosts: files\n";
  std::vector<std::string> v{"/usr/bin/unshare", "-m", "/bin/sh", "-c",
                             "mount --bind \"$1\" /etc/hosts && mount --bind \"$2\" "
                             "/etc/nsswitch.conf && shift 2 && exec \"$@\"",
                             "sh", dir.file("hosts"), dir.file("nsswitch.conf")};
  v.insert(v.end(), argv.begin(), argv.end());
  return v;
}

TEST_CASE("launch: a rendezvous name not known yet is looked up again until read_timeout, then "
          "one line, and a signal ends the wait",
          "[launch]") {
  if (::geteuid() != 0) MUSTER_SKIP("needs root (a mount namespace with its own /etc/hosts)");
  TempDir dir;
  const std::vector<std::string> job{kLaunch, "--nnodes=2", "--nproc_per_node=1",
                                     "--rdzv_backend=c10d", "--rdzv_endpoint=not-yet:29400"};
  std::vector<std::string> bounded = job;
  bounded.insert(bounded.end(), {"--rdzv_conf=read_timeout=1", "/bin/true"});
  Proc p(with_hosts_file(dir, "127.0.0.1 localhost\n", bounded));
  CHECK(p.wait() == 1);
  CHECK_THAT(p.err(), Catch::Contains("cannot resolve 'not-yet'") &&
                          Catch::Contains("looking it up again every 500 ms for up to 1 s"));
  CHECK_THAT(p.err(), Catch::EndsWith("(looked up for 1 s)\n"));

  std::vector<std::string> waiting = job;
  waiting.push_back("/bin/true");
  Proc q(with_hosts_file(dir, "127.0.0.1 localhost\n", waiting));
  REQUIRE(q.wait_output([](const std::string&, const std::string& err) {
    return err.find("looking it up again") != std::string::npos;
  }, 30s));
  ::kill(q.pid(), SIGTERM);
  CHECK(q.wait(10s) == 143);
}

TEST_CASE("launch: workers that ignore SIGTERM are killed after the grace", "[launch]") {
  TempDir dir;
  Proc p(launch_args({"--standalone", "--nproc_per_node=2", "--shutdown_timeout=1"},
                     {"term", dir.path(), "ignore"}));
  REQUIRE(p.wait_output(has_ready(2), 30s));
  std::vector<pid_t> pids = ready_pids(p.out());
  REQUIRE(pids.size() == 2);
  std::vector<int> fds;
  for (pid_t pid : pids) fds.push_back(open_pidfd(pid));
  auto t0 = std::chrono::steady_clock::now();
  ::kill(p.pid(), SIGTERM);
  REQUIRE(p.wait() == 143);
  CHECK(std::chrono::steady_clock::now() - t0 >= 900ms);  // the grace was honoured
  for (int fd : fds) {
    CHECK(wait_pidfd(fd, 0ms));
    ::close(fd);
  }
  for (pid_t pid : pids) CHECK_FALSE(alive(pid));
}

TEST_CASE("launch: kill -9 of launch leaves no worker behind", "[launch]") {
  Proc p(launch_args({"--standalone", "--nproc_per_node=4"}, {"wait"}));
  REQUIRE(p.wait_output(has_ready(4), 30s));
  std::vector<pid_t> pids = ready_pids(p.out());
  REQUIRE(pids.size() == 4);
  std::vector<int> fds;
  for (pid_t pid : pids) {
    fds.push_back(open_pidfd(pid));
    REQUIRE(fds.back() >= 0);
  }
  ::kill(p.pid(), SIGKILL);
  REQUIRE(p.wait() == 128 + SIGKILL);
  for (std::size_t i = 0; i < fds.size(); ++i) {
    bool gone = wait_pidfd(fds[i], 10s);
    CHECK(gone);
    if (!gone) ::kill(pids[i], SIGKILL);  // never leave one behind, even when failing
    ::close(fds[i]);
  }
}

TEST_CASE("launch: two standalone jobs started together both run", "[launch]") {
  TempDir a, b;
  Proc pa(launch_args({"--standalone", "--nproc_per_node=4"}, {"env", a.path()}));
  Proc pb(launch_args({"--standalone", "--nproc_per_node=4"}, {"env", b.path()}));
  REQUIRE(pa.wait() == 0);
  REQUIRE(pb.wait() == 0);
  std::set<std::string> stores_a, stores_b, runs;
  for (int r = 0; r < 4; ++r) {
    auto ea = read_env_file(a.file("env." + std::to_string(r)));
    auto eb = read_env_file(b.file("env." + std::to_string(r)));
    CHECK(ea["RANK"] == std::to_string(r));
    CHECK(eb["RANK"] == std::to_string(r));
    stores_a.insert(ea["MUSTER_STORE_ADDR"]);
    stores_b.insert(eb["MUSTER_STORE_ADDR"]);
    runs.insert(ea["TORCHELASTIC_RUN_ID"]);
    runs.insert(eb["TORCHELASTIC_RUN_ID"]);
  }
  REQUIRE(stores_a.size() == 1);
  REQUIRE(stores_b.size() == 1);
  CHECK(*stores_a.begin() != *stores_b.begin());  // each job has its own rendezvous server
  CHECK(runs.size() == 2);
}

TEST_CASE("launch: 10 MB from each of 4 workers arrives complete and prefixed", "[launch]") {
  const long bytes = 10L * 1024 * 1024;
  Proc p(launch_args({"--standalone", "--nproc_per_node=4"}, {"spew", std::to_string(bytes)}));
  REQUIRE(p.wait(120s) == 0);
  const std::string payload(80, 'x');
  std::vector<long> next(4, 0), got(4, 0);
  std::istringstream in(p.out());
  long bad = 0;
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    static const std::regex re(R"(\[default(\d)\]:R(\d) L(\d+) (x+))");
    if (!std::regex_match(line, m, re) || m[1] != m[2] || m[4] != payload) {
      ++bad;
      continue;
    }
    int r = std::stoi(m[1]);
    if (std::stol(m[3]) != next[r]) ++bad;  // every line, in order, once
    next[r] = std::stol(m[3]) + 1;
    got[r] += static_cast<long>(line.size()) - 11 + 1;  // minus "[defaultN]:", plus "\n"
  }
  CHECK(bad == 0);
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    CHECK(got[r] >= bytes);
    CHECK(got[r] < bytes + 200);
  }
}

TEST_CASE("launch: TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE sets the prefix", "[launch]") {
  Proc p(launch_args({"--standalone", "--nproc_per_node=2", "--role=trainer"}, {"exit", "0", "1"}),
         Env{{"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "<${role_name}|${rank}|${local_rank}> "}});
  REQUIRE(p.wait_output(
      [](const std::string& out, const std::string&) {
        return out.find("<trainer|1|1> rank 1 exiting with 0\n") != std::string::npos;
      },
      30s));
  // Rank 0 waits to be stopped: end the job.
  REQUIRE(p.wait_output(
      [](const std::string& out, const std::string&) {
        return out.find("<trainer|0|0> ready ") != std::string::npos;
      },
      30s));
  ::kill(p.pid(), SIGTERM);
  CHECK(p.wait() == 143);
}

TEST_CASE("launch: bad usage is one line on stderr, exit 2, nothing spawned", "[launch]") {
  TempDir dir;
  const std::string plain = dir.file("not-executable");
  std::ofstream(plain) << "x\n";
  const std::vector<std::vector<std::string>> cases{
      {kLaunch, "--standalone", "--bogus", kWorker, "env", dir.path()},
      {kLaunch, "--standalone", "--nproc_per_node=0", kWorker, "env", dir.path()},
      {kLaunch, "--standalone", "--nproc_per_node=many", kWorker, "env", dir.path()},
      {kLaunch, "--standalone", "--max_restarts=x", kWorker, "env", dir.path()},
      {kLaunch, "--standalone", dir.file("missing"), "env", dir.path()},
      {kLaunch, "--standalone", plain},
      {kLaunch, "--standalone", "no-such-program-anywhere"},
      {kLaunch, "--standalone"},
      {kLaunch, "--standalone", "--no", kWorker, "env", dir.path()},               // ambiguous
      {kLaunch, "--standalone", "--max_restarts=", kWorker, "env", dir.path()},    // empty number
      {kLaunch, "--standalone", "--nproc_per_node=xpu", kWorker, "env", dir.path()},
      {kLaunch, "--standalone", "--rdzv_conf=join_timeout=soon", kWorker, "env", dir.path()},
  };
  for (const auto& argv : cases) {
    Proc p(argv);
    INFO(argv.back());
    CHECK(p.wait() == 2);
    CHECK_THAT(p.err(), Catch::StartsWith("launch: error: "));
    CHECK(std::count(p.err().begin(), p.err().end(), '\n') == 1);
    CHECK(p.out().empty());
  }
  // Nothing ran: the folder holds only the file the test made (a worker would add env.<rank>).
  const auto entries = std::distance(std::filesystem::directory_iterator(dir.path()),
                                     std::filesystem::directory_iterator());
  CHECK(entries == 1);
}

TEST_CASE("launch: --help", "[launch]") {
  Proc p({kLaunch, "--help"});
  REQUIRE(p.wait() == 0);
  CHECK_THAT(p.out(), Catch::Contains("--nproc_per_node"));
  CHECK_THAT(p.out(), Catch::Contains("--max_restarts"));
}

TEST_CASE("launch: python scripts and modules run under python3 -u", "[launch]") {
  TempDir dir;
  std::ofstream(dir.file("job.py"))
      << "import os, sys\nprint('script', os.environ['RANK'], sys.argv[1:])\n";
  std::filesystem::create_directories(dir.file("pkg"));
  std::ofstream(dir.file("pkg/__init__.py")) << "";
  std::ofstream(dir.file("pkg/mod.py")) << "import os\nprint('module', os.environ['RANK'])\n";
  Proc script({kLaunch, "--standalone", "--nproc_per_node=2", dir.file("job.py"), "--lr", "1"});
  REQUIRE(script.wait() == 0);
  CHECK_THAT(script.out(), Catch::Contains("[default1]:script 1 ['--lr', '1']\n"));
  Proc module({kLaunch, "--standalone", "--nproc_per_node=2", "-m", "pkg.mod"},
              Env{{"PYTHONPATH", dir.path()}});
  REQUIRE(module.wait() == 0);
  CHECK_THAT(module.out(), Catch::Contains("[default0]:module 0\n"));
  Proc nopy({kLaunch, "--standalone", "--no_python", "true"});
  CHECK(nopy.wait() == 0);
}

TEST_CASE("launch: stopping workers that are still starting does not signal launch", "[launch]") {
  // Regression: a SIGTERM that reached a worker between fork and exec ran the agent's own
  // signal handler in the child, and launch then acted as if it had been sent SIGTERM.
  for (int i = 0; i < 20; ++i) {
    Proc p(launch_args({"--standalone", "--nproc_per_node=8"}, {"exit", "3", "0"}));
    REQUIRE(p.wait() == 1);
    CHECK(p.err().find("received SIGTERM") == std::string::npos);
  }
}

namespace {
// The single <run_id>_<random> folder torchrun's layout puts under --log_dir.
std::string run_log_dir(const std::string& log_dir) {
  std::vector<std::string> runs;
  for (const auto& e : std::filesystem::directory_iterator(log_dir)) runs.push_back(e.path());
  REQUIRE(runs.size() == 1);
  return runs[0];
}
}  // namespace

TEST_CASE("launch: --log_dir keeps torchrun's layout, --tee, --redirects, --local_ranks_filter",
          "[launch][logs]") {
  TempDir logs;
  Proc p(launch_args({"--standalone", "--nproc_per_node=3", "--log_dir=" + logs.path(),
                      "--tee=0:1,1:1", "--redirects=2:1", "--local_ranks_filter=0,2", "--rdzv_id=x"},
                     {"spew", "300"}));
  REQUIRE(p.wait() == 0);
  const std::string run = run_log_dir(logs.path());
  CHECK_THAT(std::filesystem::path(run).filename().string(),
             Catch::Matches("[0-9a-f-]{36}_[A-Za-z0-9]{6}"));
  for (int lr = 0; lr < 3; ++lr) {
    const std::string dir = run + "/attempt_0/" + std::to_string(lr);
    INFO(dir);
    // Files hold the raw lines, without the console's prefix.
    const std::string out = read_file(dir + "/stdout.log");
    CHECK_THAT(out, Catch::StartsWith("R" + std::to_string(lr) + " L0 "));
    CHECK(out.find("[default") == std::string::npos);
    CHECK(std::filesystem::exists(dir + "/stderr.log") == false);  // stderr neither teed nor redirected
  }
  // Console: rank 0 (tee), not rank 1 (filtered), not rank 2 (redirected).
  CHECK(count_lines_with(p.out(), "[default0]:R0 L") > 0);
  CHECK(count_lines_with(p.out(), "[default1]:") == 0);
  CHECK(count_lines_with(p.out(), "[default2]:") == 0);
}

TEST_CASE("launch: logs of earlier attempts are kept", "[launch][logs]") {
  TempDir logs, dir;
  Proc p(launch_args({"--standalone", "--nproc_per_node=2", "--max_restarts=1",
                      "--log_dir=" + logs.path(), "--tee=3"},
                     {"restart", dir.path(), "1"}));
  REQUIRE(p.wait() == 0);
  const std::string run = run_log_dir(logs.path());
  CHECK(std::filesystem::exists(run + "/attempt_0/0/stdout.log"));
  CHECK(std::filesystem::exists(run + "/attempt_1/0/stdout.log"));
}

TEST_CASE("launch: error files: the worker's under --log_dir, and launch's own", "[launch][logs]") {
  TempDir logs, own;
  const std::string own_file = own.file("launch_error.json");
  Proc p(launch_args({"--standalone", "--nproc_per_node=1", "--log_dir=" + logs.path()},
                     {"errfile", "RuntimeError: CUDA out of memory"}),
         Env{{"TORCHELASTIC_ERROR_FILE", own_file}});
  REQUIRE(p.wait() == 1);
  const std::string worker_file = run_log_dir(logs.path()) + "/attempt_0/0/error.json";
  CHECK_THAT(read_file(worker_file), Catch::Contains("RuntimeError: CUDA out of memory"));
  CHECK_THAT(p.err(), Catch::Contains("  error_file: " + worker_file));
  const std::string mine = read_file(own_file);
  CHECK_THAT(mine, Catch::Contains(R"("message":"RuntimeError: CUDA out of memory")"));
  CHECK_THAT(mine, Catch::Contains(R"("errorCode":1)"));
  CHECK_THAT(mine, Catch::Contains(R"("py_callstack":"Traceback (most recent call last):)"));
}

TEST_CASE("launch: --run_path runs a script without .py under python3", "[launch]") {
  TempDir dir;
  std::ofstream(dir.file("job")) << "import os\nprint('run_path rank', os.environ['RANK'])\n";
  Proc p({kLaunch, "--standalone", "--nproc_per_node=2", "--run_path", dir.file("job")});
  REQUIRE(p.wait() == 0);
  CHECK_THAT(p.out(), Catch::Contains("[default1]:run_path rank 1\n"));
}

TEST_CASE("launch: --signals_to_handle chooses what is forwarded", "[launch]") {
  TempDir dir;
  Proc p(launch_args({"--standalone", "--nproc_per_node=2", "--signals_to_handle=SIGUSR1,SIGTERM"},
                     {"term", dir.path(), "handle"}));
  REQUIRE(p.wait_output(has_ready(2), 30s));
  ::kill(p.pid(), SIGUSR1);  // forwarded: the workers die of it (their default action)
  CHECK(p.wait() == 128 + SIGUSR1);
  CHECK_FALSE(std::filesystem::exists(dir.file("term.0")));
}

TEST_CASE("launch: a signal left out of --signals_to_handle is not forwarded to the workers",
          "[launch]") {
  TempDir dir;
  Proc p(launch_args({"--standalone", "--nproc_per_node=2", "--signals_to_handle=SIGUSR1"},
                     {"term", dir.path(), "handle"}));
  REQUIRE(p.wait_output(has_ready(2), 30s));
  std::vector<int> fds;
  for (pid_t pid : ready_pids(p.out())) fds.push_back(open_pidfd(pid));
  REQUIRE(fds.size() == 2);
  // Not handled: its default action ends launch, whose supervisor then kills the workers'
  // process groups (SIGKILL). Forwarded, it would have reached them and they would have
  // written term.<rank>.
  ::kill(p.pid(), SIGTERM);
  CHECK(p.wait() == 128 + SIGTERM);
  for (int fd : fds) {
    CHECK(wait_pidfd(fd, 10s));  // and nothing is left running
    ::close(fd);
  }
  CHECK_FALSE(std::filesystem::exists(dir.file("term.0")));
  CHECK_FALSE(std::filesystem::exists(dir.file("term.1")));
}

// --- Nothing a worker started outlives the job (docs/launch.md "Orphans") ---------------

namespace {

// The pids a "family" worker printed: "family <child> [<grandchild>]".
std::vector<pid_t> family_pids(const std::string& out) {
  std::vector<pid_t> pids;
  static const std::regex re(R"(\]:family (\d+)(?: (\d+))?)");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator();
       ++it) {
    for (int g = 1; g <= 2; ++g) {
      if ((*it)[g].matched) pids.push_back(static_cast<pid_t>(std::stoi((*it)[g])));
    }
  }
  return pids;
}

auto has_families(int n) {
  return [n](const std::string& out, const std::string&) {
    return count_lines_with(out, "]:family ") >= n;
  };
}

// Whether this process could make a cgroup v2 of its own below its current one, as launch
// does (the cgroup2 mount from mountinfo, the "0::" line of /proc/self/cgroup).
bool cgroup_v2_writable() {
  std::string path;
  {
    std::istringstream in(read_file("/proc/self/cgroup"));
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("0::", 0) == 0) path = line.substr(3);
    }
  }
  if (path.empty()) return false;
  std::istringstream in(read_file("/proc/self/mountinfo"));
  for (std::string line; std::getline(in, line);) {
    auto dash = line.find(" - cgroup2 ");
    if (dash == std::string::npos) continue;
    std::istringstream head(line.substr(0, dash));
    std::string id, parent, dev, root, mount;
    head >> id >> parent >> dev >> root >> mount;
    if (root != "/") continue;
    const std::string dir = mount + (path == "/" ? "" : path);
    return ::access(dir.c_str(), W_OK) == 0 &&
           std::filesystem::exists(mount + "/cgroup.controllers");
  }
  return false;
}

// Every pid has exited (a zombie counts as gone); a survivor is killed so no test leaves one.
void check_all_gone(const std::vector<pid_t>& pids, const std::vector<int>& fds) {
  for (std::size_t i = 0; i < pids.size(); ++i) {
    const bool gone = wait_pidfd(fds[i], 10s) || !alive(pids[i]);
    INFO("pid " << pids[i]);
    CHECK(gone);
    if (!gone) ::kill(pids[i], SIGKILL);
    if (fds[i] >= 0) ::close(fds[i]);
  }
}

// "job supervisor pid N; containment: cgroup DIR" (info log) -> N and DIR ("" for groups).
std::pair<pid_t, std::string> supervisor_of(const std::string& err) {
  std::smatch m;
  if (!std::regex_search(err, m, std::regex(R"(job supervisor pid (\d+); containment: ([^\n]*))"))) {
    return {-1, ""};
  }
  std::string how = m[2].str();
  return {static_cast<pid_t>(std::stoi(m[1].str())),
          how.rfind("cgroup ", 0) == 0 ? how.substr(7) : std::string()};
}

// Runs 2 "family MODE" workers, kill -9s launch, and checks that every worker and every
// process they started is gone.
void kill9_leaves_nothing(Env env, const std::string& mode, std::size_t per_worker) {
  TempDir tmp;
  env["TMPDIR"] = tmp.path();
  Proc p(launch_args({"--standalone", "--nproc_per_node=2"}, {"family", mode}), env);
  REQUIRE(p.wait_output(has_families(2), 30s));
  std::vector<pid_t> pids = ready_pids(p.out());
  for (pid_t pid : family_pids(p.out())) pids.push_back(pid);
  REQUIRE(pids.size() == 2 + 2 * per_worker);
  std::vector<int> fds;
  for (pid_t pid : pids) {
    fds.push_back(open_pidfd(pid));
    REQUIRE(fds.back() >= 0);
  }
  ::kill(p.pid(), SIGKILL);
  REQUIRE(p.wait() == 128 + SIGKILL);
  check_all_gone(pids, fds);
  // The supervisor finished, and took the job's cgroup and launch's private temporary
  // folder with it.
  auto [sup, dir] = supervisor_of(p.err());
  REQUIRE(sup > 0);
  const int fd = open_pidfd(sup);
  CHECK(wait_pidfd(fd, 15s));
  if (fd >= 0) ::close(fd);
  if (!dir.empty()) CHECK_FALSE(std::filesystem::exists(dir));
  CHECK(std::filesystem::is_empty(tmp.path()));
}

}  // namespace

TEST_CASE("launch: kill -9 of launch: a worker's children die too (process groups)",
          "[launch][orphans]") {
  kill9_leaves_nothing(Env{{"MUSTER_CGROUP", "0"}, {"MUSTER_LOG_LEVEL", "info"}}, "child", 1);
}

TEST_CASE("launch: kill -9 of launch: children and setsid grandchildren die (cgroup v2)",
          "[launch][orphans]") {
  if (!cgroup_v2_writable()) {
    MUSTER_SKIP("cgroup v2 is not writable here (needs root and a delegated cgroup); the "
                "process-group case above covers the rest");
  }
  Proc probe(launch_args({"--standalone"}, {"die", "0"}), Env{{"MUSTER_LOG_LEVEL", "info"}});
  REQUIRE(probe.wait() == 0);
  auto [sup, dir] = supervisor_of(probe.err());
  INFO(probe.err());
  REQUIRE(sup > 0);
  REQUIRE_FALSE(dir.empty());  // launch chose the cgroup where the test could make one
  CHECK_FALSE(std::filesystem::exists(dir));  // removed by a normal exit
  kill9_leaves_nothing(Env{{"MUSTER_LOG_LEVEL", "info"}}, "setsid", 2);
}

TEST_CASE("launch: SIGTERM of launch: a setsid grandchild dies with the job (cgroup v2)",
          "[launch][orphans]") {
  if (!cgroup_v2_writable()) {
    MUSTER_SKIP("cgroup v2 is not writable here (needs root and a delegated cgroup)");
  }
  Proc p(launch_args({"--standalone", "--nproc_per_node=2", "--shutdown_timeout=5"},
                     {"family", "setsid"}));
  REQUIRE(p.wait_output(has_families(2), 30s));
  std::vector<pid_t> pids = ready_pids(p.out());
  for (pid_t pid : family_pids(p.out())) pids.push_back(pid);
  REQUIRE(pids.size() == 6);
  std::vector<int> fds;
  for (pid_t pid : pids) fds.push_back(open_pidfd(pid));
  ::kill(p.pid(), SIGTERM);
  REQUIRE(p.wait(20s) == 143);
  check_all_gone(pids, fds);
}

// --- Signals in every phase -----------------------------------------------------------

namespace {
// SIGTERM to `p`: it must exit 128+SIGTERM within a second and a half (acted on at once).
void sigterm_ends_at_once(Proc& p) {
  const auto t0 = std::chrono::steady_clock::now();
  ::kill(p.pid(), SIGTERM);
  const auto code = p.wait(10s);
  const auto took = std::chrono::steady_clock::now() - t0;
  REQUIRE(code.has_value());
  INFO("its stderr:\n" << p.err());
  CHECK(*code == 143);
  CHECK(took < scaled(1500ms));  // cut short: the waits it ends are 30 s (close) or 60 s (read)
}
}  // namespace

TEST_CASE("launch: SIGTERM while waiting for an absent rendezvous server ends it at once",
          "[launch][signals]") {
  const std::string ep = "127.0.0.1:" + std::to_string(free_port());  // nobody listens
  Proc p(launch_args({"--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=" + ep,
                      "--rdzv_id=job", "--rdzv_conf=is_host=false"},
                     {"wait"}),
         Env{{"MUSTER_LOG_LEVEL", "info"}});
  CHECK(p.wait_output(
      [](const std::string&, const std::string& err) {
        return err.find("waiting for the rendezvous server") != std::string::npos;
      },
      10s));
  sigterm_ends_at_once(p);
}

TEST_CASE("launch: an absent rendezvous server is an error after read_timeout",
          "[launch][signals]") {
  const std::string ep = "127.0.0.1:" + std::to_string(free_port());
  Proc p(launch_args({"--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=" + ep,
                      "--rdzv_id=job", "--rdzv_conf=is_host=false,read_timeout=1"},
                     {"wait"}));
  REQUIRE(p.wait(10s) == 1);
  CHECK_THAT(p.err(), Catch::Contains("rendezvous server at " + ep + " not reachable within 1 s"));
}

TEST_CASE("launch: a server that accepts but never answers was never reached, not lost",
          "[launch]") {
  // A frozen rdzvd: the kernel still completes TCP handshakes on its port, nothing answers.
  Proc rdzvd({kRdzvd, "--listen", "127.0.0.1:0"});
  REQUIRE(rdzvd.wait_output(
      [](const std::string& out, const std::string&) { return out.find('\n') != std::string::npos; },
      30s));
  std::smatch m;
  REQUIRE(std::regex_search(rdzvd.out(), m, std::regex(R"(listening on port (\d+))")));
  const std::string ep = "127.0.0.1:" + m[1].str();
  REQUIRE(::kill(rdzvd.pid(), SIGSTOP) == 0);
  Proc p(launch_args({"--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=" + ep,
                      "--rdzv_id=job", "--rdzv_conf=is_host=false,read_timeout=3"},
                     {"wait"}));
  CHECK(p.wait(30s) == 1);
  INFO(p.err());
  CHECK(p.err().find("lost the server") == std::string::npos);
  const bool never = p.err().find("never reached the server at " + ep) != std::string::npos;
  const bool unreachable =
      p.err().find("rendezvous server at " + ep + " not reachable within 3 s") != std::string::npos;
  CHECK((never || unreachable));
  CHECK(std::count(p.err().begin(), p.err().end(), '\n') == 1);
  ::kill(rdzvd.pid(), SIGKILL);  // frozen: its clean shutdown is tested elsewhere
  CHECK(rdzvd.wait(30s) == 128 + SIGKILL);
}

TEST_CASE("launch: SIGTERM while a hosting launch closes ends the close at once and removes "
          "its temporary folder",
          "[launch][signals]") {
  TempDir dir, tmp_a;
  const std::string ep = "127.0.0.1:" + std::to_string(free_port());
  auto flags = [&](const std::string& conf, std::vector<std::string> extra) {
    std::vector<std::string> f{"--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=" + ep,
                               "--rdzv_id=job", "--rdzv_conf=" + conf};
    f.insert(f.end(), extra.begin(), extra.end());
    return f;
  };
  // a hosts; b's worker ignores SIGTERM with a long grace, so b's stream stays open and a's
  // close (close_timeout, 30 s) waits for it. a's worker is failed only once b's worker has
  // ignored SIGTERM (it printed ready), or b's stop could end it first and b would exit.
  Proc a(launch_args(flags("is_host=true", {}), {"wait"}), Env{{"TMPDIR", tmp_a.path()}});
  Proc b(launch_args(flags("is_host=false", {"--shutdown_timeout=60"}),
                     {"term", dir.path(), "ignore"}));
  REQUIRE(b.wait_output(has_ready(1), 30s));
  REQUIRE(a.wait_output(has_ready(1), 30s));
  const std::vector<pid_t> a_workers = ready_pids(a.out());
  REQUIRE(a_workers.size() == 1);
  ::kill(a_workers[0], SIGKILL);
  REQUIRE(a.wait_output(
      [](const std::string&, const std::string& err) {
        return err.find("Root Cause (first observed failure)") != std::string::npos;
      },
      30s));
  INFO("b's stderr so far:\n" << b.err());
  sigterm_ends_at_once(a);
  const auto left = std::distance(std::filesystem::directory_iterator(tmp_a.path()),
                                  std::filesystem::directory_iterator());
  CHECK(left == 0);  // its private muster_XXXXXX folder is gone
  // b lost its server and waits out its grace for a worker that ignores SIGTERM: end it.
  ::kill(b.pid(), SIGKILL);
  CHECK(b.wait(20s) == 128 + SIGKILL);
}

// --- issue 12: what a torchrun user types ------------------------------------------------

TEST_CASE("launch: --flag= is an empty value, not the next argument", "[launch][compat]") {
  Proc p({kLaunch, "--standalone", "--rdzv_id=", "/bin/echo", "HI"});
  REQUIRE(p.wait() == 0);
  CHECK(p.out() == "[default0]:HI\n");
}

TEST_CASE("launch: prefixes of long flags work, an ambiguous one names the candidates",
          "[launch][compat]") {
  Proc p({kLaunch, "--stand", "--nproc", "2", "/bin/echo", "HI"});
  REQUIRE(p.wait() == 0);
  CHECK(count_lines_with(p.out(), "]:HI") == 2);
  Proc bad({kLaunch, "--standalone", "--no", "/bin/echo", "HI"});
  CHECK(bad.wait() == 2);
  CHECK(bad.err() == "launch: error: ambiguous option '--no' could match --no_python, --node_rank\n");
  CHECK(bad.out().empty());
}

TEST_CASE("launch: -r 3 -t 3 tees: file and console, as torchrun", "[launch][logs][compat]") {
  TempDir logs;
  const std::vector<std::string> program{"/bin/sh", "-c", "echo out; echo err >&2"};
  auto run = [&](const std::string& redirects, const std::string& tee) {
    std::vector<std::string> argv{kLaunch, "--standalone", "--log_dir=" + logs.path(), "-r",
                                  redirects, "-t", tee};
    argv.insert(argv.end(), program.begin(), program.end());
    return argv;
  };
  SECTION("both streams teed") {
    Proc p(run("3", "3"));
    REQUIRE(p.wait() == 0);
    CHECK_THAT(p.out(), Catch::Contains("[default0]:out\n"));
    CHECK_THAT(p.err(), Catch::Contains("[default0]:err\n"));
    const std::string dir = run_log_dir(logs.path()) + "/attempt_0/0";
    CHECK(read_file(dir + "/stdout.log") == "out\n");
    CHECK(read_file(dir + "/stderr.log") == "err\n");
  }
  SECTION("stdout teed, stderr only redirected") {
    Proc p(run("3", "1"));
    REQUIRE(p.wait() == 0);
    CHECK_THAT(p.out(), Catch::Contains("[default0]:out\n"));
    CHECK(p.err().find("[default0]:err") == std::string::npos);
    const std::string dir = run_log_dir(logs.path()) + "/attempt_0/0";
    CHECK(read_file(dir + "/stdout.log") == "out\n");
    CHECK(read_file(dir + "/stderr.log") == "err\n");
  }
}

TEST_CASE("launch: --log_dir=/dev/null writes no files, output stays on the console",
          "[launch][logs][compat]") {
  TempDir tmp;
  Proc p({kLaunch, "--standalone", "--log_dir=/dev/null", "-r", "3", "/bin/sh", "-c",
          "echo out; echo err >&2; echo \"$TORCHELASTIC_ERROR_FILE\""},
         Env{{"TMPDIR", tmp.path()}});
  REQUIRE(p.wait() == 0);
  CHECK_THAT(p.out(), Catch::Contains("[default0]:out\n"));
  CHECK_THAT(p.err(), Catch::Contains("[default0]:err\n"));
  CHECK(p.err().find("worker logs") == std::string::npos);
  // The error file lived in launch's private folder, removed at exit: nothing is left.
  CHECK(std::filesystem::is_empty(tmp.path()));
  CHECK(std::filesystem::is_character_file("/dev/null"));
}

TEST_CASE("launch: --rdzv_conf takes torchrun's pass-through keys and quotes, warning once",
          "[launch][compat]") {
  Proc p({kLaunch, "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", "--nnodes=1",
          "--rdzv_conf='join_timeout=5,last_call_timeout=1,timeout=5,use_libuv=1'", "/bin/echo",
          "HI"});
  REQUIRE(p.wait() == 0);
  CHECK(p.out() == "[default0]:HI\n");
  CHECK(p.err() == "[launch] warning: --rdzv_conf: timeout, use_libuv do nothing in launch; "
                   "ignored\n");
}

TEST_CASE("launch: --rdzv_endpoint=localhost:0 picks a free port, two such jobs run together",
          "[launch][compat]") {
  TempDir a, b;
  const std::vector<std::string> flags{"--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0",
                                       "--nnodes=1", "--nproc_per_node=2"};
  auto with_id = [&](const std::string& id) {
    std::vector<std::string> f = flags;
    f.push_back("--rdzv_id=" + id);
    return f;
  };
  Proc pa(launch_args(with_id("job-a"), {"env", a.path()}));
  Proc pb(launch_args(with_id("job-b"), {"env", b.path()}));
  REQUIRE(pa.wait() == 0);
  REQUIRE(pb.wait() == 0);
  auto ea = read_env_file(a.file("env.1"));
  auto eb = read_env_file(b.file("env.1"));
  CHECK(ea["TORCHELASTIC_RUN_ID"] == "job-a");
  CHECK(eb["TORCHELASTIC_RUN_ID"] == "job-b");
  CHECK(ea["WORLD_SIZE"] == "2");
  CHECK(ea["MUSTER_STORE_ADDR"] != eb["MUSTER_STORE_ADDR"]);  // a server each
  Proc many({kLaunch, "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", "--nnodes=1:2",
             "/bin/echo", "HI"});
  CHECK(many.wait() == 2);
  CHECK_THAT(many.err(), Catch::StartsWith("launch: error: --rdzv_endpoint: port 0"));
}

TEST_CASE("launch: TORCH_ELASTIC_SHUTDOWN_TIMEOUT sets the grace, the flag wins",
          "[launch][compat]") {
  TempDir dir;
  auto stop_after = [&](const std::vector<std::string>& flags, const std::string& env_value) {
    std::vector<std::string> f{"--standalone", "--nproc_per_node=1"};
    f.insert(f.end(), flags.begin(), flags.end());
    Proc p(launch_args(f, {"term", dir.path(), "ignore"}),
           Env{{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", env_value}});
    REQUIRE(p.wait_output(has_ready(1), 30s));
    auto t0 = std::chrono::steady_clock::now();
    ::kill(p.pid(), SIGTERM);
    REQUIRE(p.wait(60s) == 143);
    return std::chrono::steady_clock::now() - t0;
  };
  SECTION("the variable alone: 2 s, not 30") {
    auto took = stop_after({}, "2");
    CHECK(took >= 1900ms);
    CHECK(took < scaled(15s));
  }
  SECTION("the flag over the variable") {
    auto took = stop_after({"--shutdown_timeout=0"}, "600");
    CHECK(took < scaled(15s));
  }
}

TEST_CASE("launch: LOGLEVEL sets launch's log level, MUSTER_LOG_LEVEL wins", "[launch][compat]") {
  Proc info({kLaunch, "--standalone", "/bin/true"},
            Env{{"LOGLEVEL", "INFO"}, {"MUSTER_LOG_LEVEL", std::nullopt}});
  REQUIRE(info.wait() == 0);
  CHECK_THAT(info.err(), Catch::Contains("[launch] info: "));
  Proc quiet({kLaunch, "--standalone", "/bin/true"},
             Env{{"LOGLEVEL", "INFO"}, {"MUSTER_LOG_LEVEL", "error"}});
  REQUIRE(quiet.wait() == 0);
  CHECK(quiet.err().empty());
  Proc bad({kLaunch, "--standalone", "/bin/true"},
           Env{{"LOGLEVEL", "loud"}, {"MUSTER_LOG_LEVEL", std::nullopt}});
  CHECK(bad.wait() == 2);
  CHECK(bad.err() ==
        "launch: error: LOGLEVEL: 'loud' is not a log level (DEBUG, INFO, WARNING, ERROR, "
        "CRITICAL)\n");
}

TEST_CASE("launch: TORCHELASTIC_SIGNALS_TO_HANDLE is --signals_to_handle as given",
          "[launch][compat]") {
  TempDir a, b;
  Proc dflt(launch_args({"--standalone"}, {"env", a.path()}));
  REQUIRE(dflt.wait() == 0);
  CHECK(read_env_file(a.file("env.0"))["TORCHELASTIC_SIGNALS_TO_HANDLE"] ==
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT");
  Proc mine(launch_args({"--standalone", "--signals-to-handle=SIGTERM,SIGUSR1"}, {"env", b.path()}));
  REQUIRE(mine.wait() == 0);
  CHECK(read_env_file(b.file("env.0"))["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGUSR1");
}

TEST_CASE("launch: --event-log-handler=dynamic_rendezvous runs, --nproc-per-node=hpu is refused",
          "[launch][compat]") {
  Proc ok({kLaunch, "--standalone", "--event-log-handler=dynamic_rendezvous", "/bin/echo", "HI"});
  REQUIRE(ok.wait() == 0);
  CHECK(ok.out() == "[default0]:HI\n");
  Proc hpu({kLaunch, "--standalone", "--nproc-per-node=hpu", "/bin/echo", "HI"});
  CHECK(hpu.wait() == 2);
  CHECK(hpu.err() ==
        "launch: error: --nproc_per_node=hpu: launch counts CUDA devices (gpu), Intel GPUs (xpu), "
        "either (auto) and CPUs (cpu); give the number of workers\n");
  CHECK(hpu.out().empty());
}

TEST_CASE("launch: --virtual-local-rank: LOCAL_RANK 0 and one device per worker",
          "[launch][compat]") {
  SECTION("no CUDA_VISIBLE_DEVICES: each worker sees its local rank's device") {
    TempDir dir;
    Proc p(launch_args({"--standalone", "--nproc_per_node=3", "--virtual-local-rank"},
                       {"env", dir.path()}),
           Env{{"CUDA_VISIBLE_DEVICES", std::nullopt}});
    REQUIRE(p.wait() == 0);
    for (int r = 0; r < 3; ++r) {
      auto env = read_env_file(dir.file("env." + std::to_string(r)));
      INFO("rank " << r);
      CHECK(env["RANK"] == std::to_string(r));
      CHECK(env["LOCAL_RANK"] == "0");
      CHECK(env["CUDA_VISIBLE_DEVICES"] == std::to_string(r));
    }
  }
  SECTION("launch's CUDA_VISIBLE_DEVICES: each worker its entry") {
    TempDir dir;
    Proc p(launch_args({"--standalone", "--nproc_per_node=2", "--virtual_local_rank"},
                       {"env", dir.path()}),
           Env{{"CUDA_VISIBLE_DEVICES", "6,GPU-1234"}});
    REQUIRE(p.wait() == 0);
    CHECK(read_env_file(dir.file("env.0"))["CUDA_VISIBLE_DEVICES"] == "6");
    CHECK(read_env_file(dir.file("env.1"))["CUDA_VISIBLE_DEVICES"] == "GPU-1234");
    CHECK(read_env_file(dir.file("env.1"))["LOCAL_RANK"] == "0");
  }
  SECTION("too few devices listed: a usage error, nothing started") {
    TempDir dir;
    Proc p(launch_args({"--standalone", "--nproc_per_node=3", "--virtual_local_rank"},
                       {"env", dir.path()}),
           Env{{"CUDA_VISIBLE_DEVICES", "0,1"}});
    CHECK(p.wait() == 2);
    CHECK(p.err() ==
          "launch: error: --virtual_local_rank: local rank 2 has no device in "
          "CUDA_VISIBLE_DEVICES=0,1\n");
    CHECK(std::filesystem::is_empty(dir.path()));
  }
  SECTION("off: LOCAL_RANK is the local rank, CUDA_VISIBLE_DEVICES inherited") {
    TempDir dir;
    Proc p(launch_args({"--standalone", "--nproc_per_node=2"}, {"env", dir.path()}),
           Env{{"CUDA_VISIBLE_DEVICES", "6,7"}});
    REQUIRE(p.wait() == 0);
    CHECK(read_env_file(dir.file("env.1"))["LOCAL_RANK"] == "1");
    CHECK(read_env_file(dir.file("env.1"))["CUDA_VISIBLE_DEVICES"] == "6,7");
  }
}

TEST_CASE("launch: --duplicate-stdout-filters / --duplicate-stderr-filters copy matching lines",
          "[launch][logs][compat]") {
  TempDir logs;
  // Each worker prints matching and non-matching lines on both streams.
  const std::string script =
      "echo \"loss=1 r$RANK\"; echo \"noise r$RANK\"; echo \"a,b r$RANK\"; "
      "echo \"WARN disk r$RANK\" >&2; echo \"quiet r$RANK\" >&2; printf \"loss tail r$RANK\"";
  Proc p({kLaunch, "--standalone", "--nproc_per_node=2", "--log_dir=" + logs.path(),
          "--duplicate-stdout-filters", "loss,a,,b", "--duplicate_stderr_filters=WARN",
          "/bin/sh", "-c", script});
  REQUIRE(p.wait() == 0);
  // The console still has every line.
  for (int r = 0; r < 2; ++r) {
    const std::string pre = "[default" + std::to_string(r) + "]:";
    const std::string rs = " r" + std::to_string(r);
    CHECK_THAT(p.out(), Catch::Contains(pre + "loss=1" + rs + "\n"));
    CHECK_THAT(p.out(), Catch::Contains(pre + "noise" + rs + "\n"));
    CHECK_THAT(p.out(), Catch::Contains(pre + "a,b" + rs + "\n"));
    CHECK_THAT(p.out(), Catch::Contains(pre + "loss tail" + rs + "\n"));
    CHECK_THAT(p.err(), Catch::Contains(pre + "WARN disk" + rs + "\n"));
    CHECK_THAT(p.err(), Catch::Contains(pre + "quiet" + rs + "\n"));
  }
  // The attempt's filtered files hold exactly the matching lines, whole and prefixed as on the
  // console (the ranks' lines in the order they came).
  const std::string attempt = run_log_dir(logs.path()) + "/attempt_0";
  auto lines_of = [](const std::string& text) {
    std::multiset<std::string> lines;
    std::istringstream in(text);
    for (std::string l; std::getline(in, l);) lines.insert(l);
    return lines;
  };
  const std::string out = read_file(attempt + "/filtered_stdout.log");
  CHECK(out.back() == '\n');
  CHECK(lines_of(out) == std::multiset<std::string>{
                             "[default0]:loss=1 r0", "[default0]:a,b r0", "[default0]:loss tail r0",
                             "[default1]:loss=1 r1", "[default1]:a,b r1", "[default1]:loss tail r1"});
  CHECK(lines_of(read_file(attempt + "/filtered_stderr.log")) ==
        std::multiset<std::string>{"[default0]:WARN disk r0", "[default1]:WARN disk r1"});
  // No filters, no file.
  TempDir plain;
  Proc q({kLaunch, "--standalone", "--log_dir=" + plain.path(), "/bin/echo", "loss"});
  REQUIRE(q.wait() == 0);
  CHECK_FALSE(std::filesystem::exists(run_log_dir(plain.path()) + "/attempt_0/filtered_stdout.log"));
}

namespace {

std::set<int> cpu_set_of(const std::string& list) {
  std::set<int> out;
  std::stringstream in(list);
  for (std::string item; std::getline(in, item, ',');) {
    if (item.empty()) continue;
    const auto dash = item.find('-');
    const int lo = std::stoi(item.substr(0, dash));
    const int hi = dash == std::string::npos ? lo : std::stoi(item.substr(dash + 1));
    for (int c = lo; c <= hi; ++c) out.insert(c);
  }
  return out;
}

std::string first_line(const std::string& path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}

// The NUMA nodes that have CPUs, from /sys.
std::map<int, std::set<int>> numa_nodes() {
  std::map<int, std::set<int>> nodes;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/sys/devices/system/node", ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("node", 0) != 0 || name.size() < 5 || !std::isdigit(name[4])) continue;
    auto cpus = cpu_set_of(first_line((e.path() / "cpulist").string()));
    if (!cpus.empty()) nodes[std::stoi(name.substr(4))] = cpus;
  }
  return nodes;
}

std::set<int> my_cpus() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("Cpus_allowed_list:", 0) == 0) {
      return cpu_set_of(line.substr(line.find_first_not_of(" \t", 18)));
    }
  }
  return {};
}

// Runs nproc workers in `numa DIR` mode under --numa-binding=mode; each rank's allowed CPUs.
std::vector<std::set<int>> bound_cpus(const std::string& mode, int nproc) {
  TempDir dir;
  Proc p(launch_args({"--standalone", "--nproc_per_node=" + std::to_string(nproc),
                      "--numa-binding=" + mode},
                     {"numa", dir.path()}));
  REQUIRE(p.wait() == 0);
  std::vector<std::set<int>> out;
  for (int r = 0; r < nproc; ++r) {
    auto seen = read_env_file(dir.file("numa." + std::to_string(r)));
    INFO(mode << " rank " << r);
    // Mems_allowed is the cpuset's, which a memory policy leaves as it is.
    CHECK_FALSE(seen["Mems_allowed_list"].empty());
    // The memory policy prefers the rank's node (on one node: node 0), unless the kernel
    // refused it (launch's binding of memory is best effort).
    CHECK((seen["mempolicy"] == "preferred:0" || seen["mempolicy"] == "default:"));
    out.push_back(cpu_set_of(seen["Cpus_allowed_list"]));
  }
  return out;
}

}  // namespace

TEST_CASE("launch: --numa-binding binds each worker's CPUs as the mode says (one node)",
          "[launch][numa][compat]") {
  const auto nodes = numa_nodes();
  if (nodes.size() != 1) {
    MUSTER_SKIP("this host has " << nodes.size()
                                  << " NUMA nodes with CPUs; this case's checks are for one");
  }
  std::set<int> node;  // the node's CPUs launch may use
  for (int c : nodes.begin()->second) {
    if (my_cpus().count(c) != 0) node.insert(c);
  }
  REQUIRE_FALSE(node.empty());
  const int nproc = std::min<int>(4, static_cast<int>(node.size()));
  SECTION("node and socket: every CPU of the node") {
    for (const std::string mode : {"node", "socket"}) {
      for (const auto& cpus : bound_cpus(mode, 3)) CHECK(cpus == node);
    }
  }
  SECTION("exclusive: disjoint sets that cover the node") {
    const auto sets = bound_cpus("exclusive", nproc);
    std::set<int> all;
    std::size_t total = 0;
    for (const auto& cpus : sets) {
      CHECK_FALSE(cpus.empty());
      all.insert(cpus.begin(), cpus.end());
      total += cpus.size();
    }
    CHECK(total == all.size());  // disjoint
    CHECK(all == node);
  }
  SECTION("core-complex: a group sharing the last-level cache, a different one per rank") {
    // The groups: shared_cpu_list of each CPU's L3 (index3), larger groups first.
    std::map<int, std::set<int>> by_first;
    for (int c : node) {
      auto shared = cpu_set_of(first_line("/sys/devices/system/cpu/cpu" + std::to_string(c) +
                                          "/cache/index3/shared_cpu_list"));
      std::set<int> mine;
      for (int s : shared) {
        if (node.count(s) != 0) mine.insert(s);
      }
      if (mine.empty()) mine = node;  // no L3 information: the node is one group
      by_first[*mine.begin()] = mine;
    }
    std::vector<std::set<int>> groups;
    for (const auto& [first, g] : by_first) groups.push_back(g);
    std::stable_sort(groups.begin(), groups.end(),
                     [](const auto& a, const auto& b) { return a.size() > b.size(); });
    const auto sets = bound_cpus("core-complex", 2);
    for (int r = 0; r < 2; ++r) CHECK(sets[r] == groups[r % groups.size()]);
  }
  SECTION("exclusive with more ranks than CPUs, or a bad mode: one line, exit 2") {
    TempDir dir;
    Proc p(launch_args({"--standalone", "--nproc_per_node=" + std::to_string(node.size() + 1),
                        "--numa-binding=exclusive"},
                       {"numa", dir.path()}));
    CHECK(p.wait() == 2);
    CHECK_THAT(p.err(), Catch::StartsWith("launch: error: --numa_binding=exclusive: NUMA node "));
    CHECK(std::count(p.err().begin(), p.err().end(), '\n') == 1);
    Proc bad(launch_args({"--standalone", "--numa_binding=numa"}, {"numa", dir.path()}));
    CHECK(bad.wait() == 2);
    CHECK(bad.err() ==
          "launch: error: --numa_binding: 'numa' is not a mode (node, socket, exclusive, "
          "core-complex)\n");
    CHECK(std::filesystem::is_empty(dir.path()));
  }
  SECTION("off: workers keep launch's CPUs") {
    TempDir dir;
    Proc p(launch_args({"--standalone", "--nproc_per_node=2"}, {"numa", dir.path()}));
    REQUIRE(p.wait() == 0);
    CHECK(cpu_set_of(read_env_file(dir.file("numa.1"))["Cpus_allowed_list"]) == my_cpus());
    CHECK(read_env_file(dir.file("numa.1"))["mempolicy"] == "default:");
  }
}

// --- issue 12: the interpreter, torch.distributed.launch, the edges --------------------

TEST_CASE("launch: a ModuleNotFoundError names the interpreter and PYTHON_EXEC",
          "[launch][python]") {
  REQUIRE(::access("/usr/bin/python3", X_OK) == 0);  // scripts/setup installs it
  TempDir dir;
  std::ofstream(dir.file("job.py")) << "import no_such_module_for_launch_tests\n";
  Proc p({kLaunch, "--standalone", "--nproc_per_node=2", dir.file("job.py")},
         Env{{"PATH", "/usr/bin:/bin"}, {"PYTHON_EXEC", std::nullopt},
             {"VIRTUAL_ENV", std::nullopt}, {"MUSTER_LOG_LEVEL", "info"}});
  REQUIRE(p.wait() == 1);
  CHECK_THAT(p.err(), Catch::Contains("python: " + dir.file("job.py") +
                                      " runs under /usr/bin/python3 (python3 from PATH)"));
  CHECK_THAT(p.err(), Catch::Contains("failed with ModuleNotFoundError: No module named "
                                      "'no_such_module_for_launch_tests'\n"));
  CHECK_THAT(p.err(), Catch::Contains("it ran under /usr/bin/python3 (python3 from PATH)"));
  CHECK_THAT(p.err(), Catch::Contains("set PYTHON_EXEC"));
  // The hint follows the summary.
  CHECK(p.err().rfind("set PYTHON_EXEC") > p.err().rfind("Root Cause"));
}

TEST_CASE("launch: --legacy_launch passes --local-rank=N unless --use_env",
          "[launch][compat]") {
  REQUIRE(::access("/usr/bin/python3", X_OK) == 0);  // scripts/setup installs it
  TempDir dir;
  std::ofstream(dir.file("args.py")) << "import os, sys\nprint(os.environ['LOCAL_RANK'], "
                                        "' '.join(sys.argv[1:]))\n";
  Env env{{"PYTHON_EXEC", "/usr/bin/python3"}};
  Proc legacy({kLaunch, "--legacy_launch", "--nproc_per_node=2", dir.file("args.py"), "--lr",
               "1"},
              env);
  REQUIRE(legacy.wait() == 0);
  CHECK_THAT(legacy.out(), Catch::Contains("[default0]:0 --local-rank=0 --lr 1\n"));
  CHECK_THAT(legacy.out(), Catch::Contains("[default1]:1 --local-rank=1 --lr 1\n"));
  Proc use_env({kLaunch, "--legacy_launch", "--use-env", "--nproc_per_node=2",
                dir.file("args.py"), "--lr", "1"},
               env);
  REQUIRE(use_env.wait() == 0);
  CHECK_THAT(use_env.out(), Catch::Contains("[default1]:1 --lr 1\n"));
  // torchrun's macro works in any argument.
  Proc macro({kLaunch, "--standalone", "--nproc_per_node=2", "/bin/echo", "rank=${local_rank}"});
  REQUIRE(macro.wait() == 0);
  CHECK_THAT(macro.out(), Catch::Contains("[default1]:rank=1\n"));
}

TEST_CASE("launch: signalled, it writes torch's SignalException to its own error file",
          "[launch][signals][compat]") {
  TempDir dir, own;
  const std::string own_file = own.file("launch_error.json");
  Proc p(launch_args({"--standalone", "--nproc_per_node=2"}, {"term", dir.path(), "handle"}),
         Env{{"TORCHELASTIC_ERROR_FILE", own_file}});
  REQUIRE(p.wait_output(has_ready(2), 30s));
  ::kill(p.pid(), SIGTERM);
  REQUIRE(p.wait() == 128 + SIGTERM);
  const std::string record = read_file(own_file);
  CHECK_THAT(record, Catch::Contains(R"("message":"SignalException: Process )" +
                                     std::to_string(p.pid()) + " got signal: 15\""));
  CHECK_THAT(record, Catch::Contains(R"("py_callstack":)"));
  CHECK_THAT(record, Catch::Contains(R"("timestamp":)"));
}

TEST_CASE("launch: a failed job keeps the error file its summary names", "[launch][logs]") {
  TempDir tmp;
  Proc p(launch_args({"--standalone", "--nproc_per_node=1"}, {"errfile", "ValueError: bad"}),
         Env{{"TMPDIR", tmp.path()}});
  REQUIRE(p.wait() == 1);
  static const std::regex re(R"(  error_file: (\S+))");
  std::smatch m;
  const std::string err = p.err();
  REQUIRE(std::regex_search(err, m, re));
  const std::string named = m[1].str();
  CHECK(named.rfind(tmp.path(), 0) == 0);
  CHECK_THAT(read_file(named), Catch::Contains("ValueError: bad"));
  CHECK_THAT(err, Catch::Contains("error files are kept in " + tmp.path() + "/muster_"));
  // A failure without an error file (nothing to name) leaves nothing behind.
  TempDir tmp2;
  Proc q(launch_args({"--standalone"}, {"exit", "3", "0"}), Env{{"TMPDIR", tmp2.path()}});
  REQUIRE(q.wait() == 1);
  CHECK(std::filesystem::is_empty(tmp2.path()));
}

namespace {

// A cgroup v1 freezer group of the test's own: a frozen process is in state D and does not die
// on SIGKILL until it is thawed (then the pending SIGKILL ends it). Thawed and removed at the
// end, whatever happened.
struct Freezer {
  std::string dir;
  bool ok = false;
  Freezer() {
    dir = "/sys/fs/cgroup/freezer/muster-test-" + std::to_string(::getpid());
    std::error_code ec;
    ok = std::filesystem::is_directory("/sys/fs/cgroup/freezer") &&
         std::filesystem::create_directory(dir, ec);
  }
  pid_t frozen = -1;
  int frozen_fd = -1;  // its pidfd, for the end
  bool freeze(pid_t pid) {
    frozen = pid;
    frozen_fd = open_pidfd(pid);
    std::ofstream(dir + "/cgroup.procs") << pid << "\n";
    std::ofstream(dir + "/freezer.state") << "FROZEN\n";
    for (int i = 0; i < 200; ++i) {  // FREEZING until every task is frozen
      if (read_file(dir + "/freezer.state") == "FROZEN\n") return true;
      ::usleep(10000);
    }
    return false;
  }
  void thaw() { std::ofstream(dir + "/freezer.state") << "THAWED\n"; }
  ~Freezer() {
    if (!ok) return;
    // Whatever happened, the frozen worker (it ignores SIGTERM) is ended by its pid.
    if (frozen > 0) ::kill(frozen, SIGKILL);
    thaw();
    if (frozen_fd >= 0) {
      wait_pidfd(frozen_fd, 10s);
      ::close(frozen_fd);
    }
    // The group empties once its last task is reaped; cgroup v1 has no event for that.
    for (int i = 0; i < 200 && ::rmdir(dir.c_str()) != 0; ++i) ::usleep(10000);
  }
};

}  // namespace

TEST_CASE("launch: a worker stuck in the kernel (state D) is left behind and named",
          "[launch][dstate]") {
  Freezer freezer;
  if (!freezer.ok) {
    MUSTER_SKIP("no writable cgroup v1 freezer here (needs root), so no process in state D");
  }
  TempDir dir;
  Proc p(launch_args({"--standalone", "--nproc_per_node=2", "--shutdown_timeout=1"},
                     {"term", dir.path(), "ignore"}));
  REQUIRE(p.wait_output(has_ready(2), 30s));
  std::smatch m;
  const std::string out = p.out();
  REQUIRE(std::regex_search(out, m, std::regex(R"(\[default(\d)\]:ready (\d+))")));
  const std::string rank = m[1];
  const pid_t stuck = static_cast<pid_t>(std::stoi(m[2]));
  const int fd = open_pidfd(stuck);
  REQUIRE(freezer.freeze(stuck));
  auto t0 = std::chrono::steady_clock::now();
  ::kill(p.pid(), SIGTERM);
  // The grace (1 s), SIGKILL, then kUnkillableWait (5 s): launch ends without the stuck worker.
  REQUIRE(p.wait(40s) == 143);
  CHECK(std::chrono::steady_clock::now() - t0 >= 5s);
  const std::string pid = std::to_string(stuck);
  CHECK_THAT(p.err(), Catch::Contains("worker rank " + rank + " (pid " + pid +
                                      ") is stuck in the kernel (state D, wchan __refrigerator): "
                                      "it does not die on SIGKILL; going on without it"));
  CHECK_THAT(p.err(), Catch::Contains("[<0>] __refrigerator"));  // its kernel stack
  CHECK_THAT(p.err(), Catch::Contains("worker rank " + rank + " (pid " + pid +
                                      ") is stuck in the kernel (state D, wchan __refrigerator) "
                                      "and was left behind"));
  CHECK_FALSE(wait_pidfd(fd, 0ms));  // still there, frozen
  freezer.thaw();                    // the pending SIGKILL ends it now
  CHECK(wait_pidfd(fd, 10s));
  ::close(fd);
}
