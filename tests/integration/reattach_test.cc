// Restarting rdzvd without restarting workers (rdzvd --state_dir): real launch and rdzvd
// processes on 127.0.0.1, every process ended by its pid.
#include <signal.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <memory>
#include <regex>
#include <sstream>

#include "helpers.h"
#include "rdzvd_proc.h"
#include "muster/rendezvous/client.h"
#include "muster/rendezvous/grpc_store.h"

using namespace muster::testing;

namespace {


auto has(const std::string& text) {
  return [text](const std::string& out, const std::string& err) {
    return out.find(text) != std::string::npos || err.find(text) != std::string::npos;
  };
}

// rdzvd with --state_dir on `listen` (port 0 the first time; the same port after a kill).
struct Daemon {
  std::unique_ptr<Proc> proc;
  int port = 0;
  Daemon(const std::string& listen, const std::string& state_dir,
         std::vector<std::string> extra = {}) {
    std::vector<std::string> argv{kRdzvd, "--listen", listen, "--state_dir", state_dir};
    argv.insert(argv.end(), extra.begin(), extra.end());
    proc = std::make_unique<Proc>(argv);
    REQUIRE(proc->wait_output(has("rdzvd: restored"), 30s));
    std::smatch m;
    REQUIRE(std::regex_search(proc->out(), m, std::regex(R"(listening on port (\d+))")));
    port = std::stoi(m[1].str());
  }
  std::string endpoint() const { return "127.0.0.1:" + std::to_string(port); }
  void kill9() {
    ::kill(proc->pid(), SIGKILL);
    REQUIRE(proc->wait(10s) == 128 + SIGKILL);
  }
  void stop() {
    ::kill(proc->pid(), SIGTERM);
    CHECK(proc->wait(30s) == 0);
  }
};

}  // namespace

TEST_CASE("reattach: kill -9 of rdzvd while workers run: no worker restarts, a failure after "
          "costs exactly one restart",
          "[reattach]") {
  TempDir state, work;
  auto server = std::make_unique<Daemon>("127.0.0.1:0", state.path());
  const std::string ep = server->endpoint();
  const int port = server->port;
  const std::vector<std::string> conf{"--max_restarts=2", "--rdzv_conf=reattach_timeout=20"};
  Proc a(launch_args(c10d(ep, "2", 2, "job", conf), {"signals", work.path()}));
  Proc b(launch_args(c10d(ep, "2", 2, "job", conf), {"signals", work.path()}));
  REQUIRE(a.wait_output(has_ready(2, "world 4 round 1 restart 0"), 30s));
  REQUIRE(b.wait_output(has_ready(2, "world 4 round 1 restart 0"), 30s));
  std::vector<int> fds;  // the workers must outlive the server's restart
  for (Proc* p : {&a, &b}) {
    for (pid_t pid : ready_pids(p->out())) fds.push_back(open_pidfd(pid));
  }

  server->kill9();
  for (Proc* p : {&a, &b}) {
    REQUIRE(p->wait_output(has("the workers keep running while this node re-attaches to run job"),
                           10s));
  }
  server = std::make_unique<Daemon>("127.0.0.1:" + std::to_string(port), state.path());
  CHECK_THAT(server->proc->out(), Catch::Contains("restored 1 runs"));
  for (Proc* p : {&a, &b}) {
    REQUIRE(p->wait_output(has("re-attached to run job round 1"), 30s));
  }
  for (int fd : fds) {
    CHECK_FALSE(wait_pidfd(fd, 0ms));  // still running
    ::close(fd);
  }
  auto st = muster::rendezvous::get_status(ep, "job", "", 10s);
  REQUIRE(st.ok());
  REQUIRE(st->runs_size() == 1);
  CHECK(st->runs(0).phase() == "running");
  CHECK(st->runs(0).round() == 1);
  CHECK(st->runs(0).restart_count() == 0);
  CHECK(st->runs(0).members_size() == 2);
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    auto s = starts(work, r);
    REQUIRE(s.size() == 1);  // started once: the restart of the server restarted no worker
    CHECK_THAT(s[0], Catch::EndsWith(" 0"));
  }

  // A worker failure after the restart: one counted restart, and the job finishes.
  fail_once_then_finish(a, b, work);
  server->stop();
}

TEST_CASE("reattach: SIGTERM of rdzvd keeps its runs: restarted on the same folder, its agents "
          "re-attach and no worker restarts",
          "[reattach]") {
  TempDir state, work;
  auto server = std::make_unique<Daemon>("127.0.0.1:0", state.path());
  const std::string ep = server->endpoint();
  const int port = server->port;
  const std::vector<std::string> conf{"--rdzv_conf=is_host=false,reattach_timeout=20"};
  Proc a(launch_args(c10d(ep, "2", 1, "kept", conf), {"signals", work.path()}));
  Proc b(launch_args(c10d(ep, "2", 1, "kept", conf), {"signals", work.path()}));
  REQUIRE(a.wait_output(has_ready(1, "round 1 restart 0"), 30s));
  REQUIRE(b.wait_output(has_ready(1, "round 1 restart 0"), 30s));
  server->stop();  // SIGTERM, exit 0: the streams it ends are not losses
  server = std::make_unique<Daemon>("127.0.0.1:" + std::to_string(port), state.path());
  CHECK_THAT(server->proc->out(), Catch::Contains("restored 1 runs"));
  for (Proc* p : {&a, &b}) REQUIRE(p->wait_output(has("re-attached to run kept round 1"), 30s));
  release_workers({&a, &b});
  CHECK(starts(work, 0).size() == 1);
  CHECK(starts(work, 1).size() == 1);
  server->stop();
}

TEST_CASE("reattach: a list of endpoints: the agent moves to the next when one is dead",
          "[reattach]") {
  SECTION("the first endpoint is dead from the start") {
    TempDir state, work;
    Daemon server("127.0.0.1:0", state.path());
    const std::string list = "127.0.0.1:" + std::to_string(free_port()) + "," + server.endpoint();
    // is_host: the first endpoint is this machine, but these agents must not host it.
    const std::vector<std::string> conf{"--rdzv_conf=is_host=false"};
    Proc a(launch_args(c10d(list, "2", 1, "two", conf), {"env", work.path()}));
    Proc b(launch_args(c10d(list, "2", 1, "two", conf), {"env", work.path()}));
    CHECK(a.wait(60s) == 0);
    CHECK(b.wait(60s) == 0);
    CHECK(read_env_file(work.file("env.0"))["WORLD_SIZE"] == "2");
    CHECK(read_env_file(work.file("env.1"))["WORLD_SIZE"] == "2");
    server.stop();
  }
  SECTION("rdzvd killed and started at the next address on the same state folder") {
    TempDir state, work;
    auto server = std::make_unique<Daemon>("127.0.0.1:0", state.path());
    const int next_port = free_port();
    const std::string list = server->endpoint() + ",127.0.0.1:" + std::to_string(next_port);
    const std::vector<std::string> conf{"--rdzv_conf=is_host=false,reattach_timeout=20"};
    Proc a(launch_args(c10d(list, "2", 1, "moved", conf), {"signals", work.path()}));
    Proc b(launch_args(c10d(list, "2", 1, "moved", conf), {"signals", work.path()}));
    REQUIRE(a.wait_output(has_ready(1, "round 1 restart 0"), 30s));
    REQUIRE(b.wait_output(has_ready(1, "round 1 restart 0"), 30s));
    server->kill9();
    server = std::make_unique<Daemon>("127.0.0.1:" + std::to_string(next_port), state.path());
    const std::string at = "at 127.0.0.1:" + std::to_string(next_port);
    for (Proc* p : {&a, &b}) {
      REQUIRE(p->wait_output(has("re-attached to run moved round 1 " + at), 30s));
    }
    release_workers({&a, &b});
    CHECK(starts(work, 0).size() == 1);
    CHECK(starts(work, 1).size() == 1);
    server->stop();
  }
}

TEST_CASE("reattach: a worker's store client reaches the restarted rdzvd on its next call, the "
          "keys set before are gone",
          "[reattach]") {
  TempDir state, work;
  auto server = std::make_unique<Daemon>("127.0.0.1:0", state.path());
  const std::string ep = server->endpoint();
  const int port = server->port;
  Proc a(launch_args(c10d(ep, "1", 1, "kv", {"--rdzv_conf=is_host=false"}),
                     {"signals", work.path()}));
  REQUIRE(a.wait_output(has_ready(1, "round 1"), 30s));
  muster::rendezvous::GrpcStore store({ep, "kv", ""});
  REQUIRE(store.set("before", "1").ok());
  REQUIRE(store.get("before", 1s).ok());
  server->kill9();
  auto down = store.get("before", 1s);
  CHECK(down.status().code() == absl::StatusCode::kUnavailable);
  server = std::make_unique<Daemon>("127.0.0.1:" + std::to_string(port), state.path());
  REQUIRE(a.wait_output(has("re-attached to run kv round 1"), 30s));
  // The store's channel reconnects within its backoff (at most 1 s); its state cannot be
  // seen from here, so the call is what is waited on: a few, bounded.
  absl::Status st;
  const auto until = std::chrono::steady_clock::now() + 5s;
  do {
    st = store.set("after", "2");
    if (!st.ok()) REQUIRE(st.code() == absl::StatusCode::kUnavailable);
  } while (!st.ok() && std::chrono::steady_clock::now() < until);
  REQUIRE(st.ok());
  CHECK(store.get("after", 1s).value() == "2");
  CHECK(store.get("before", 100ms).status().code() == absl::StatusCode::kDeadlineExceeded);
  release_workers({&a});
  server->stop();
}

TEST_CASE("reattach: rdzvd --state_dir refuses a missing folder, a file, a folder in use",
          "[reattach]") {
  TempDir dir;
  {
    Proc p({kRdzvd, "--listen", "127.0.0.1:0", "--state_dir", dir.file("missing")});
    CHECK(p.wait(30s) == 2);
    CHECK_THAT(p.err(), Catch::StartsWith("rdzvd: error: --state_dir: state folder " +
                                          dir.file("missing")));
    CHECK(std::count(p.err().begin(), p.err().end(), '\n') == 1);
  }
  {
    std::ofstream(dir.file("plain")) << "x";
    Proc p({kRdzvd, "--listen", "127.0.0.1:0", "--state_dir", dir.file("plain")});
    CHECK(p.wait(30s) == 2);
    CHECK_THAT(p.err(), Catch::Contains("Not a directory"));
  }
  {
    Daemon first("127.0.0.1:0", dir.path());
    Proc p({kRdzvd, "--listen", "127.0.0.1:0", "--state_dir", dir.path()});
    CHECK(p.wait(30s) == 2);
    CHECK_THAT(p.err(), Catch::Contains("in use by another server"));
    first.stop();
  }
}
