// The straggler watch (docs/stragglers.md) on a real job: three launches of
// examples/python/ddp_in_place.py (Debian's python3-torch, gloo) on one rdzvd, with
// --watch_stragglers. One worker slowed from outside by a SIGSTOP/SIGCONT duty cycle (50 ms
// stopped in every 100 ms) is named, with its node, in the event log, `rdzvd status --json`
// and /metrics; a job whose ranks are paused 300 ms at random names nobody.
#include <signal.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <random>
#include <regex>
#include <thread>

#include "helpers.h"
#include "http_get.h"
#include "rdzvd_proc.h"
#include "skip.h"

using namespace muster::testing;

namespace {

// Three agents of run `id`, one worker each, training until ended (SIGTERM by the test).
// `flags`: the watch's (--watch_stragglers, or exclusion's); `nnodes` and `log_every` as asked.
struct ThreeAgents {
  std::vector<std::unique_ptr<Proc>> agents;
  std::map<int, pid_t> pid_of;  // rank -> worker pid
  std::map<int, Proc*> agent_of;  // rank -> its agent

  ThreeAgents(const std::string& endpoint, const std::string& id,
              std::vector<std::string> flags = {"--watch_stragglers"},
              const std::string& nnodes = "3", const std::string& log_every = "1000000") {
    for (int i = 0; i < 3; ++i) {
      std::vector<std::string> argv{kLaunch, "--nnodes=" + nnodes, "--nproc_per_node=1",
                                    "--rdzv_backend=c10d", "--rdzv_endpoint=" + endpoint,
                                    "--rdzv_id=" + id, "--in_place"};
      argv.insert(argv.end(), flags.begin(), flags.end());
      for (const char* a : {DDP_IN_PLACE_PY, "--steps", "1000000", "--step-sleep-ms", "20",
                            "--log-every"}) {
        argv.push_back(a);
      }
      argv.push_back(log_every);
      // One worker a node, so launch (as torchrun) leaves OMP_NUM_THREADS alone; but the three
      // "nodes" share this machine's cores, and torch 2.x's OpenMP threads spin after each
      // parallel op: three ranks' spinners on two cores made 1.3-1.8x noise in the ranks' own
      // work (a straggler named in a job that has none). One thread a rank, as on a real node
      // with cores of its own.
      agents.push_back(std::make_unique<Proc>(
          argv, std::map<std::string, std::optional<std::string>>{{"PYTHONPATH", std::nullopt},
                                                                   {"OMP_NUM_THREADS", "1"}}));
    }
    static const std::regex pid_re(R"(rank (\d+): pid (\d+) in place, round 1)");
    for (auto& a : agents) {
      REQUIRE(a->wait_output(out_has("in place, round 1"), 120s));
      std::smatch m;
      const std::string out = a->out();
      REQUIRE(std::regex_search(out, m, pid_re));
      pid_of[std::stoi(m[1])] = static_cast<pid_t>(std::stoi(m[2]));
      agent_of[std::stoi(m[1])] = a.get();
    }
    REQUIRE(pid_of.size() == 3);
  }
  ~ThreeAgents() {
    for (auto& a : agents) ::kill(a->pid(), SIGTERM);
    for (auto& a : agents) a->wait(60s);
  }
};

// Runs `body` (a fault: stopping and continuing workers) on a thread of its own until
// destroyed; `body` returns once its flag is set.
class Slower {
 public:
  explicit Slower(std::function<void(std::atomic<bool>&)> body)
      : t_([this, body] { body(done_); }) {}
  ~Slower() {
    done_ = true;
    t_.join();
  }

 private:
  std::atomic<bool> done_{false};
  std::thread t_;
};

// The fault: `pid` stopped 50 ms in every 100 ms (SIGSTOP/SIGCONT from outside) until done.
std::function<void(std::atomic<bool>&)> duty_cycle(pid_t pid) {
  return [pid](std::atomic<bool>& done) {
    while (!done) {
      ::kill(pid, SIGSTOP);
      std::this_thread::sleep_for(50ms);
      ::kill(pid, SIGCONT);
      std::this_thread::sleep_for(50ms);
    }
    ::kill(pid, SIGCONT);
  };
}

std::string run_status_json(const RdzvdProc& server, const std::string& id) {
  Proc status({kRdzvd, "status", "--endpoint", server.endpoint, "--run", id, "--json"});
  REQUIRE(status.wait(30s) == 0);
  return status.out();
}

}  // namespace

TEST_CASE(
    "stragglers: a worker slowed by a SIGSTOP duty cycle is named with its node in the "
    "event log, rdzvd status --json and /metrics",
    "[stragglers][torch]") {
  if (!torch_importable())
    MUSTER_SKIP(kPython + " cannot import torch (install python3-torch)");
  RdzvdProc server({"--event_log", "-", "--metrics_port", "0"});
  ThreeAgents job(server.endpoint, "slow");
  const int slow = 2;
  const pid_t pid = job.pid_of.at(slow);
  {
    Slower duty(duty_cycle(pid));  // the fault itself
    const auto t0 = std::chrono::steady_clock::now();
    const bool named = server.proc->wait_output(
        [](const std::string&, const std::string& err) {
          return err.find("\"event\":\"straggler_named\"") != std::string::npos;
        },
        60s);
    INFO("rdzvd's event log:\n" << server.proc->err());
    REQUIRE(named);
    INFO("named after " << std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::steady_clock::now() - t0)
                               .count()
                        << " ms");
    const std::string log = server.proc->err();
    const std::string line = log.substr(log.find("\"event\":\"straggler_named\""));
    CHECK(line.find("\"rank\":2") != std::string::npos);
    CHECK(line.find("\"cause\":\"compute\"") != std::string::npos);
    // Named only once, and only that rank.
    CHECK(log.find("straggler_named", log.find("straggler_named") + 1) == std::string::npos);

    const std::string status = run_status_json(server, "slow");
    INFO("status: " << status);
    CHECK(status.find("\"stragglers\":[{\"rank\":2,") != std::string::npos);
    std::smatch m;
    REQUIRE(std::regex_search(
        status, m,
        std::regex(R"re("stragglers":\[\{"rank":2,"host":"([^"]*)","node_id":"([^"]+)")re")));
    // The node it names is the one whose agent runs rank 2: its member entry has first rank 2.
    CHECK(std::regex_search(status, std::regex("\"node_id\":\"" + m[2].str() +
                                               "\",\"host\":\"[^\"]*\",\"group_rank\":\\d+,"
                                               "\"local_world_size\":1,\"first_rank\":2")));
    const std::string metrics = http_get(server.metrics_port, "/metrics").body;
    INFO("metrics: " << metrics);
    CHECK(std::regex_search(
        metrics,
        std::regex(
            R"re(muster_straggler_slowdown\{run="slow",rank="2",host="[^"]*",cause="compute"\} [1-9])re")));
    CHECK(metrics.find("muster_stragglers_named_total{cause=\"compute\"} 1") != std::string::npos);
  }
}

// [alone]: ctest runs it with no other test beside it (RUN_SERIAL, tests/CMakeLists.txt): its
// three ranks share two cores, and another test's processes on them slow one rank for real.
TEST_CASE("stragglers: ranks paused 300 ms at random name nobody", "[stragglers][torch][alone]") {
  if (!torch_importable())
    MUSTER_SKIP(kPython + " cannot import torch (install python3-torch)");
  RdzvdProc server({"--event_log", "-"});
  ThreeAgents job(server.endpoint, "noisy");
  std::vector<pid_t> pids;
  for (const auto& [rank, pid] : job.pid_of) pids.push_back(pid);
  {
    Slower pauses([pids](std::atomic<bool>& done) {
      std::mt19937 rng(42);
      std::uniform_int_distribution<std::size_t> pick(0, pids.size() - 1);
      std::uniform_int_distribution<int> gap(1500, 3500);
      while (!done) {  // the noise: a random rank stopped for 300 ms every ~2.5 s (~100 steps)
        const pid_t p = pids[pick(rng)];
        ::kill(p, SIGSTOP);
        std::this_thread::sleep_for(300ms);
        ::kill(p, SIGCONT);
        std::this_thread::sleep_for(std::chrono::milliseconds(gap(rng)));
      }
    });
    // As long as the other case's bound: a name would have come by then. The server's own
    // count of closed windows is not exposed; the status says the watch is on.
    CHECK_FALSE(server.proc->wait_output(
        [](const std::string&, const std::string& err) {
          return err.find("straggler_named") != std::string::npos;
        },
        45s));
  }
  const std::string status = run_status_json(server, "noisy");
  INFO("status: " << status << "\nevent log:\n" << server.proc->err());
  CHECK(status.find("\"stragglers\":[]") != std::string::npos);
}

// Exclusion (docs/stragglers.md, "Exclusion"): with --exclude_stragglers and --nnodes=2:3, the
// slowed worker's node leaves the world; the other two keep their worker processes and train
// on in a world of two; the excluded agent stays connected for its cool-down.
TEST_CASE("stragglers: with --exclude_stragglers a slowed node leaves in place and the other "
          "two train on with their processes",
          "[stragglers][torch]") {
  if (!torch_importable())
    MUSTER_SKIP(kPython + " cannot import torch (install python3-torch)");
  RdzvdProc server({"--event_log", "-", "--metrics_port", "0"});
  ThreeAgents job(server.endpoint, "exclude",
                  {"--exclude_stragglers", "--straggler_cooldown=600"}, "2:3", "20");
  const int slow = 2;
  const pid_t pid = job.pid_of.at(slow);
  {
    Slower duty(duty_cycle(pid));
    const bool excluded = server.proc->wait_output(
        [](const std::string&, const std::string& err) {
          return err.find("\"event\":\"straggler_excluded\"") != std::string::npos;
        },
        60s);
    INFO("rdzvd's event log:\n" << server.proc->err());
    REQUIRE(excluded);
  }
  const std::string log = server.proc->err();
  const std::string line = log.substr(log.find("\"event\":\"straggler_excluded\""));
  INFO("rdzvd's event log:\n" << log);
  CHECK(line.find("\"rank\":2") != std::string::npos);
  CHECK(line.find("\"cooldown_ms\":600000") != std::string::npos);
  // The round after it: the two others, in place.
  REQUIRE(server.proc->wait_output(
      [](const std::string&, const std::string& err) {
        const auto x = err.find("straggler_excluded");
        return x != std::string::npos &&
               err.find("\"event\":\"round_formed\"", x) != std::string::npos;
      },
      30s));
  // Rank 0 trains on in a world of two with its own process; so does rank 1.
  Proc& zero = *job.agent_of.at(0);
  const std::size_t before = zero.out().size();
  REQUIRE(zero.wait_output(
      [before](const std::string& out, const std::string&) {
        return out.find("(2 ranks)", before) != std::string::npos;
      },
      60s));
  // Each survivor's worker is the process it was (alive, and not started again: a new one
  // would say "pid ... in place" once more), and it re-formed into round 2.
  for (int r : {0, 1}) {
    CHECK(::kill(job.pid_of.at(r), 0) == 0);
    CHECK(job.agent_of.at(r)->wait_output(
        out_has("rank " + std::to_string(r) + ": round 2 params"), 30s));
    const std::string out = job.agent_of.at(r)->out();
    const auto first = out.find(" in place, round ");
    CHECK(out.find(" in place, round ", first + 1) == std::string::npos);
  }
  // The excluded node's worker is gone; its agent says why and waits, connected.
  Proc& third = *job.agent_of.at(slow);
  REQUIRE(third.wait_output(
      [](const std::string& out, const std::string& err) {
        return (out + err).find("joins again in 600 s") != std::string::npos;
      },
      30s));
  CHECK_FALSE(third.wait(100ms).has_value());  // still there, in its cool-down
  CHECK(::kill(pid, 0) == -1);
  const std::string status = run_status_json(server, "exclude");
  INFO("status: " << status);
  CHECK(status.find("\"excluding_stragglers\":true") != std::string::npos);
  CHECK(std::regex_search(status, std::regex(R"re("excluded":\[\{"node_id":"[^"]+","host":"[^"]*","times":1,"cooldown_ms":600000,"left_ms":[1-9])re")));
  const std::string metrics = http_get(server.metrics_port, "/metrics").body;
  CHECK(metrics.find("muster_stragglers_excluded_total{cause=\"compute\"} 1") !=
        std::string::npos);
  CHECK(metrics.find("muster_restarts_total{cause=\"straggler_excluded\"} 1") !=
        std::string::npos);
}

TEST_CASE("stragglers: exclusion's flags are checked at the edge, one line each",
          "[stragglers]") {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--exclude_stragglers"},
       "launch: error: --exclude_stragglers needs --in_place (the others keep their workers "
       "when a straggler's node leaves)\n"},
      {{"--in_place", "--exclude_stragglers", "--straggler_cooldown=0.5"},
       "launch: error: --straggler_cooldown: must be at least 1 second\n"},
      {{"--in_place", "--exclude_stragglers", "--straggler_cooldown=nan"},
       "launch: error: --straggler_cooldown: must be at least 1 second\n"},
  };
  for (const auto& [flags, line] : cases) {
    std::vector<std::string> argv{kLaunch, "--standalone", "--nproc_per_node=1"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.push_back("/bin/true");
    Proc bad(argv);
    INFO(flags.back());
    CHECK(bad.wait(30s) == 2);
    CHECK(bad.err() == line);
  }
}
