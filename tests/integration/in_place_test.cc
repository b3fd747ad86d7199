// In-place recovery (docs/in_place.md) with real launches, workers and sockets on 127.0.0.1:
// a worker crash replaces only that worker and the run ends exactly where one that never
// failed ends; kill -9 of a node leaves the survivors' processes running in a smaller world;
// a program that never declared support gets the full restart.
#include <signal.h>

#include <catch2/catch.hpp>
#include <map>
#include <regex>
#include <set>

#include "helpers.h"
#include "rdzvd_proc.h"

using namespace muster::testing;

namespace {

const std::string kTrain = TRAIN_BIN;

// "rank R: pid P in place, round N" lines: pid by (round, rank).
std::map<std::pair<int, int>, int> started(const std::string& out) {
  std::map<std::pair<int, int>, int> pids;
  static const std::regex re(R"(\]:rank (\d+): pid (\d+) in place, round (\d+))");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator();
       ++it) {
    pids[{std::stoi((*it)[3]), std::stoi((*it)[1])}] = std::stoi((*it)[2]);
  }
  return pids;
}

// "rank R: pid P re-formed in place as rank S of W, round N" lines: the pids.
std::set<int> reformed(const std::string& out, const std::string& as) {
  std::set<int> pids;
  const std::regex re(R"(\]:rank \d+: pid (\d+) re-formed in place as )" + as);
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator();
       ++it) {
    pids.insert(std::stoi((*it)[1]));
  }
  return pids;
}

std::string final_loss(const std::string& out) {
  std::smatch m;
  static const std::regex re(R"(final loss (\S+) steps)");
  return std::regex_search(out, m, re) ? m[1].str() : "";
}

std::vector<std::string> standalone(int nproc, const std::vector<std::string>& launch_flags,
                                    const std::vector<std::string>& train_flags) {
  std::vector<std::string> argv{kLaunch, "--standalone", "--nproc_per_node=" + std::to_string(nproc)};
  argv.insert(argv.end(), launch_flags.begin(), launch_flags.end());
  argv.push_back(kTrain);
  argv.insert(argv.end(), train_flags.begin(), train_flags.end());
  return argv;
}

}  // namespace

TEST_CASE("in place: a worker crash replaces only it and the run ends where an unbroken one "
          "does", "[in_place]") {
  TempDir dir;
  const std::vector<std::string> steps{"--steps", "60", "--log-every", "20"};
  Proc plain(standalone(3, {}, steps));
  INFO(plain.err());
  REQUIRE(plain.wait(120s) == 0);
  std::vector<std::string> faulty_flags = steps;
  faulty_flags.insert(faulty_flags.end(), {"--fail-at-step", "30", "--fail-rank", "1"});
  Proc faulty(standalone(3, {"--in_place", "--max_restarts=1", "--event_log=" + dir.file("events")},
                         faulty_flags));
  INFO(faulty.out() << faulty.err());
  REQUIRE(faulty.wait(120s) == 0);
  const auto pids = started(faulty.out());
  // Round 1's three workers, then one new process (rank 1) in round 2: nobody else started.
  REQUIRE(pids.size() == 4);
  REQUIRE(pids.count({2, 1}) == 1);
  // The survivors re-formed in the same processes, as the same ranks.
  CHECK(reformed(faulty.out(), "rank 0 of 3, round 2") == std::set<int>{pids.at({1, 0})});
  CHECK(reformed(faulty.out(), "rank 2 of 3, round 2") == std::set<int>{pids.at({1, 2})});
  CHECK(pids.at({2, 1}) != pids.at({1, 1}));
  CHECK_THAT(faulty.out(), Catch::Contains("resuming after step 29 (state from rank 0)"));
  // Step 30 is done again by the same world on the same data: the same end, bit for bit.
  REQUIRE_FALSE(final_loss(plain.out()).empty());
  CHECK(final_loss(faulty.out()) == final_loss(plain.out()));
  const std::string events = read_file(dir.file("events"));
  CHECK_THAT(events, Catch::Contains(R"("event":"in_place_resumed")"));
  CHECK_THAT(events, Catch::Contains(R"("cause":"worker_failure","in_place":true)"));
  CHECK_THAT(events, Catch::Contains(R"("restart_count":1,"cause":"worker_failure","counts":true)"));
}

TEST_CASE("in place: kill -9 of a node: the survivors go on in their own processes, world 2",
          "[in_place]") {
  RdzvdProc server;
  // Round 1 closes when all three are in (max nodes); after the loss the survivors need no
  // last call: the round closes once every survivor is back.
  const std::vector<std::string> conf{"--rdzv_conf=last_call_timeout=60", "--in_place",
                                      "--max_restarts=1"};
  auto agent = [&] {
    std::vector<std::string> argv = c10d(server.endpoint, "2:3", 1, "ip", conf);
    argv.insert(argv.begin(), kLaunch);
    argv.insert(argv.end(), {kTrain, "--steps", "100000", "--log-every", "1000"});
    return std::make_unique<Proc>(argv);
  };
  auto a = agent(), b = agent(), c = agent();
  auto in_round_1 = [](const std::string& out, const std::string&) {
    return out.find("in place, round 1") != std::string::npos;
  };
  for (auto* p : {a.get(), b.get(), c.get()}) REQUIRE(p->wait_output(in_round_1, 60s));
  const auto b_ranks = started(b->out());
  REQUIRE(b_ranks.size() == 1);
  const int b_rank = b_ranks.begin()->first.second;  // its one worker's global rank
  ::kill(b->pid(), SIGKILL);
  REQUIRE(b->wait() == 128 + SIGKILL);
  auto reformed_in_2 = [](const std::string& out, const std::string&) {
    return out.find("of 2, round 2") != std::string::npos;
  };
  for (Proc* p : {a.get(), c.get()}) {
    const bool ok = p->wait_output(reformed_in_2, 30s);
    INFO(p->out() << p->err());
    REQUIRE(ok);
  }
  for (Proc* p : {a.get(), c.get()}) {
    INFO(p->out() << p->err());
    const auto pids = started(p->out());
    REQUIRE(pids.size() == 1);  // nothing new started on a survivor
    CHECK(reformed(p->out(), R"(rank \d of 2, round 2)") == std::set<int>{pids.begin()->second});
    // The world message named the rank that went with b.
    CHECK_THAT(p->out(), Catch::Contains("round 2 (lost: " + std::to_string(b_rank) + ")"));
  }
  // The server's status shows the recovery with its phases once both survivors' resumed
  // reports are in: asked until it does (nothing here signals that moment), within a bound.
  std::string table;
  const auto until = std::chrono::steady_clock::now() + scaled(30s);
  do {
    Proc status({kRdzvd, "status", "--endpoint", server.endpoint, "--run", "ip"});
    REQUIRE(status.wait(30s) == 0);
    table = status.out();
  } while (table.find("-> resumed") == std::string::npos && std::chrono::steady_clock::now() < until);
  INFO(table);
  CHECK_THAT(table, Catch::Contains("0/1 (1 in place)"));  // a node lost: not from the budget
  CHECK(std::regex_search(
      table, std::regex(R"(last recovery: round 2 after a restart \(node_lost\), \S+ ago: in place on 2 )"
                        R"(of 2 node\(s\); noticed -> round formed \S+ -> resumed \S+ \(slowest node: )"
                        R"(abort \S+, re-form \S+\))")));
  // They train on: the ranks of the world of two both say so, and leave on a signal.
  for (Proc* p : {a.get(), c.get()}) ::kill(p->pid(), SIGTERM);
  CHECK(a->wait() == 143);
  CHECK(c->wait() == 143);
}

namespace {

// `n` agents of one c10d run on `server` (one train worker each, in place, --nnodes=nnodes).
std::vector<std::unique_ptr<Proc>> train_agents(const RdzvdProc& server, const std::string& nnodes,
                                                int n) {
  const std::vector<std::string> conf{"--rdzv_conf=last_call_timeout=60", "--in_place",
                                      "--max_restarts=1"};
  std::vector<std::unique_ptr<Proc>> out;
  for (int i = 0; i < n; ++i) {
    std::vector<std::string> argv = c10d(server.endpoint, nnodes, 1, "ip", conf);
    argv.insert(argv.begin(), kLaunch);
    argv.insert(argv.end(), {kTrain, "--steps", "100000", "--log-every", "1000"});
    out.push_back(std::make_unique<Proc>(argv));
  }
  return out;
}

// Of four agents, 1 and 2 were killed -9: 0 and 3 re-form in a world of two, in the processes
// they started with (whatever round that took), then leave on SIGTERM.
void survivors_reformed_in_two(std::vector<std::unique_ptr<Proc>>& agents) {
  CHECK(agents[1]->wait() == 128 + SIGKILL);
  CHECK(agents[2]->wait() == 128 + SIGKILL);
  for (int i : {0, 3}) {
    Proc& p = *agents[i];
    const bool ok = p.wait_output(out_has("of 2, round"), 30s);
    INFO(p.out() << p.err());
    REQUIRE(ok);
    const auto pids = started(p.out());
    REQUIRE(pids.size() == 1);  // no new process on a survivor
    CHECK(reformed(p.out(), R"(rank \d of 2, round \d+)") == std::set<int>{pids.begin()->second});
  }
  for (int i : {0, 3}) ::kill(agents[i]->pid(), SIGTERM);
  CHECK(agents[0]->wait() == 143);
  CHECK(agents[3]->wait() == 143);
}

}  // namespace

TEST_CASE("in place: a node whose link to the server goes silent (no FIN, no RST) is dropped "
          "and the survivors re-form in their own processes",
          "[in_place]") {
  RdzvdProc server;
  // b reaches the server only through a proxy that black-holes on SIGUSR1.
  Proc proxy({FAULT_PROXY_BIN, "--listen", "127.0.0.1:0", "--target", server.endpoint});
  REQUIRE(proxy.wait_output(out_has("listening on "), 10s));
  std::smatch m;
  const std::string proxy_out = proxy.out();
  REQUIRE(std::regex_search(proxy_out, m, std::regex(R"(listening on (\d+))")));
  const std::string via_proxy = "127.0.0.1:" + m[1].str();
  // A 2 s liveness window; round 1 closes when all three are in.
  const std::vector<std::string> conf{
      "--rdzv_conf=last_call_timeout=60,keep_alive_interval=0.5,keep_alive_max_attempt=4",
      "--in_place", "--max_restarts=1"};
  auto agent = [&](const std::string& endpoint) {
    std::vector<std::string> argv = c10d(endpoint, "2:3", 1, "silent", conf);
    argv.insert(argv.begin(), kLaunch);
    argv.insert(argv.end(), {kTrain, "--steps", "100000", "--log-every", "1000"});
    return std::make_unique<Proc>(argv);
  };
  auto a = agent(server.endpoint), b = agent(via_proxy), c = agent(server.endpoint);
  for (auto* p : {a.get(), b.get(), c.get()}) REQUIRE(p->wait_output(out_has("in place, round 1"), 60s));
  ::kill(proxy.pid(), SIGUSR1);
  REQUIRE(proxy.wait_output(out_has("blackhole on"), 10s));
  for (Proc* p : {a.get(), c.get()}) {
    const bool ok = p->wait_output(out_has("of 2, round 2"), 30s);
    INFO(p->out() << p->err());
    REQUIRE(ok);
    const auto pids = started(p->out());
    REQUIRE(pids.size() == 1);  // nothing new started on a survivor
    CHECK(reformed(p->out(), R"(rank \d of 2, round 2)") == std::set<int>{pids.begin()->second});
  }
  for (Proc* p : {a.get(), b.get(), c.get()}) ::kill(p->pid(), SIGTERM);
  CHECK(a->wait() == 143);
  CHECK(c->wait() == 143);
  CHECK(b->wait() == 143);
  ::kill(proxy.pid(), SIGTERM);
  CHECK(proxy.wait() == 0);
}

TEST_CASE("in place: two nodes lost at once: the two survivors re-form once, in their own "
          "processes", "[in_place]") {
  RdzvdProc server;
  auto agents = train_agents(server, "2:4", 4);
  for (auto& p : agents) REQUIRE(p->wait_output(out_has("in place, round 1"), 60s));
  ::kill(agents[1]->pid(), SIGKILL);
  ::kill(agents[2]->pid(), SIGKILL);
  survivors_reformed_in_two(agents);
}

TEST_CASE("in place: a second node lost while the first loss is being recovered: the "
          "survivors still re-form in their own processes", "[in_place]") {
  RdzvdProc server;
  auto agents = train_agents(server, "2:4", 4);
  for (auto& p : agents) REQUIRE(p->wait_output(out_has("in place, round 1"), 60s));
  ::kill(agents[1]->pid(), SIGKILL);
  // The recovery is under way on a survivor (the server's Restart reached it): now the next.
  REQUIRE(agents[0]->wait_output(
      [](const std::string&, const std::string& err) {
        return err.find("recovering in place") != std::string::npos;  // launch's own log
      },
      30s));
  ::kill(agents[2]->pid(), SIGKILL);
  survivors_reformed_in_two(agents);
}

TEST_CASE("in place: a newcomer within MIN:MAX joins the running group, which keeps its "
          "processes and hands it the state", "[in_place]") {
  RdzvdProc server;
  // Two of up to three: the first round closes after the last call (1 s), without a third.
  std::vector<std::unique_ptr<Proc>> agents;
  const std::vector<std::string> conf{"--rdzv_conf=last_call_timeout=1", "--in_place",
                                      "--max_restarts=1"};
  auto one = [&] {
    std::vector<std::string> argv = c10d(server.endpoint, "2:3", 1, "grow", conf);
    argv.insert(argv.begin(), kLaunch);
    argv.insert(argv.end(), {kTrain, "--steps", "100000", "--log-every", "1000"});
    return std::make_unique<Proc>(argv);
  };
  agents.push_back(one());
  agents.push_back(one());
  for (auto& p : agents) REQUIRE(p->wait_output(out_has("in place, round 1"), 60s));
  // Round 1 has trained a step before the newcomer comes (else the state it receives may be
  // step 0's, which the check below tells from a restart's).
  Proc& first_rank0 = agents[0]->out().find("]:rank 0: pid") != std::string::npos ? *agents[0] : *agents[1];
  REQUIRE(first_rank0.wait_output(out_has("step 1 loss"), 60s));
  agents.push_back(one());
  Proc& newcomer = *agents[2];
  REQUIRE(newcomer.wait_output(out_has("in place, round 2"), 60s));
  for (int i : {0, 1}) {
    Proc& p = *agents[i];
    const bool ok = p.wait_output(out_has("of 3, round 2"), 30s);
    INFO(p.out() << p.err());
    REQUIRE(ok);
    const auto pids = started(p.out());
    REQUIRE(pids.size() == 1);
    CHECK(reformed(p.out(), R"(rank \d of 3, round 2)") == std::set<int>{pids.begin()->second});
  }
  // Rank 0 (a survivor) says where the world of three goes on from: its own state, not step 0.
  Proc& rank0 = agents[0]->out().find("as rank 0 of 3") != std::string::npos ? *agents[0] : *agents[1];
  REQUIRE(rank0.wait_output(out_has("in place: 3 rank(s), resuming after step"), 30s));
  std::smatch m;
  const std::string out = rank0.out();
  REQUIRE(std::regex_search(out, m, std::regex(R"(in place: 3 rank\(s\), resuming after step (\d+))")));
  CHECK(std::stoi(m[1]) > 0);
  for (auto& p : agents) ::kill(p->pid(), SIGTERM);
  for (auto& p : agents) CHECK(p->wait() == 143);
}

TEST_CASE("in place: a program that never declares support gets the full restart",
          "[in_place]") {
  TempDir dir;
  Proc p(launch_args({"--standalone", "--nproc_per_node=2", "--in_place", "--max_restarts=1"},
                     {"signals", dir.path()}));
  REQUIRE(p.wait_output(has_ready(2), 30s));
  const std::vector<pid_t> first = ready_pids(p.out());
  REQUIRE(first.size() == 2);
  ::kill(first[1], SIGUSR2);  // that worker exits 3
  REQUIRE(p.wait_output(has_ready(4), 30s));
  const std::vector<pid_t> all = ready_pids(p.out());
  // Both ranks are new processes: the one that never failed was not kept.
  const std::set<pid_t> second(all.begin() + 2, all.end());
  CHECK(second.count(first[0]) == 0);
  CHECK(second.count(first[1]) == 0);
  for (pid_t pid : second) ::kill(pid, SIGUSR1);
  INFO(p.out() << p.err());
  CHECK(p.wait(30s) == 0);
  CHECK(read_file(dir.file("starts.0")).find(" 1\n") != std::string::npos);  // restart count 1
}
