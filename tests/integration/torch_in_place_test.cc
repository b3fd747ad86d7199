// PyTorch DDP in place (docs/in_place_torch.md): examples/python/ddp_in_place.py with Debian's
// python3-torch (gloo) under real launches on 127.0.0.1. A worker crash replaces only it; kill
// -9 of a node leaves the survivors' processes in a smaller world; a newcomer gets the
// survivors' state; without --in_place the script is an ordinary DDP job. After each recovery
// every rank holds the same parameters (a digest each prints), and the run finishes.
#include <signal.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <map>
#include <regex>
#include <set>

#include "helpers.h"
#include "rdzvd_proc.h"
#include "skip.h"

using namespace muster::testing;

namespace {

const std::string kScript = DDP_IN_PLACE_PY;

// Every match of `re`'s first group, in order.
std::vector<std::string> all_of(const std::string& out, const std::string& re) {
  std::vector<std::string> found;
  const std::regex r(re);
  for (auto it = std::sregex_iterator(out.begin(), out.end(), r); it != std::sregex_iterator(); ++it) {
    found.push_back((*it)[1].str());
  }
  return found;
}

// "rank R: pid P in place, round N": the pids that started, by (round, rank).
std::map<std::pair<int, int>, std::string> started(const std::string& out) {
  std::map<std::pair<int, int>, std::string> pids;
  static const std::regex re(R"(rank (\d+): pid (\d+) in place, round (\d+))");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator();
       ++it) {
    pids[{std::stoi((*it)[3]), std::stoi((*it)[1])}] = (*it)[2].str();
  }
  return pids;
}

// gloo may leave a survivor's collective blocked after the abort of a round (a send queued on
// a connection its peer reset): that survivor says so after the stuck wait and exits, and its
// agent starts the rank anew (docs/in_place_torch.md, "A collective the abort cannot end").
bool gave_up(const std::string& out, const std::string& err) {
  return (out + err).find("still blocked") != std::string::npos;
}

std::set<std::string> distinct(const std::vector<std::string>& v) { return {v.begin(), v.end()}; }

// One line first in a failure's message (a CI summary may keep only that): what the agent
// said of restarts, fallbacks and failures, joined.
std::string what_happened(const std::string& err) {
  static const std::regex re(R"([^\n]*(restart|falling back|failed|gave up|still blocked|spent)[^\n]*)");
  std::string line;
  for (auto it = std::sregex_iterator(err.begin(), err.end(), re); it != std::sregex_iterator();
       ++it) {
    line += (line.empty() ? "" : " | ") + it->str().substr(0, 200);
  }
  return line.empty() ? "(no restart, fallback or failure said)" : line;
}

// Every "round N params D" line in `all` names one digest per round, and there is one.
void check_rounds_agree(const std::string& all) {
  std::map<std::string, std::set<std::string>> by_round;
  static const std::regex round_params(R"(round (\d+) params (\S+))");
  for (auto it = std::sregex_iterator(all.begin(), all.end(), round_params); it != std::sregex_iterator(); ++it) {
    by_round[(*it)[1].str()].insert((*it)[2].str());
  }
  CHECK(!by_round.empty());
  for (const auto& [round, digests] : by_round) {
    INFO("round " << round);
    CHECK(digests.size() == 1);
  }
}

std::vector<std::string> script(const std::vector<std::string>& flags) {
  std::vector<std::string> argv{kPython, kScript};
  argv.insert(argv.end(), flags.begin(), flags.end());
  return argv;
}

std::vector<std::string> standalone(int nproc, std::vector<std::string> launch_flags,
                                    const std::vector<std::string>& flags) {
  std::vector<std::string> argv{kLaunch, "--standalone", "--nproc_per_node=" + std::to_string(nproc)};
  argv.insert(argv.end(), launch_flags.begin(), launch_flags.end());
  for (const std::string& a : script(flags)) argv.push_back(a);
  return argv;
}

const std::map<std::string, std::optional<std::string>> kEnv{{"PYTHONPATH", std::nullopt}};

// Until the agent whose worker is rank 0 (it logs the steps) says `what`.
bool rank0_said(const std::vector<Proc*>& agents, const std::string& what) {
  for (Proc* p : agents) {
    if (p->out().find("rank 0: pid") != std::string::npos) return p->wait_output(out_has(what), 120s);
  }
  return false;
}

}  // namespace

TEST_CASE("torch in place: a worker crash replaces only it, the survivors keep their pids and "
          "every rank ends with the same parameters, an unbroken run's up to rounding",
          "[torch][in_place]") {
  if (!torch_importable()) MUSTER_SKIP(kPython + " cannot import torch (install python3-torch)");
  const std::vector<std::string> steps{"--steps", "120", "--log-every", "40"};
  Proc plain(standalone(3, {"--in_place"}, steps), kEnv);
  INFO(plain.out() << plain.err());
  REQUIRE(plain.wait(180s) == 0);
  const auto plain_params = distinct(all_of(plain.out(), R"(final loss \S+ steps 120 params (\S+))"));
  REQUIRE(plain_params.size() == 1);

  std::vector<std::string> faulty_flags = steps;
  faulty_flags.insert(faulty_flags.end(), {"--fail-at-step", "60", "--fail-rank", "1"});
  Proc faulty(standalone(3, {"--in_place", "--max_restarts=1"}, faulty_flags), kEnv);
  INFO(faulty.out() << faulty.err());
  REQUIRE(faulty.wait(180s) == 0);
  const auto pids = started(faulty.out());
  // Round 1's three workers, then one new process for rank 1 in round 2; nobody else.
  REQUIRE(pids.size() == 4);
  REQUIRE(pids.count({2, 1}) == 1);
  CHECK(pids.at({2, 1}) != pids.at({1, 1}));
  for (int r : {0, 2}) {
    CHECK(all_of(faulty.out(), "rank " + std::to_string(r) +
                                   R"(: pid (\d+) re-formed in place as rank )" + std::to_string(r) +
                                   " of 3, round 2") == std::vector<std::string>{pids.at({1, r})});
  }
  // The survivors agree at once; the replacement got their state (step 60 redone by the
  // same world on the same data): every rank ends with the same parameters, where the
  // unbroken run ends up to rounding (the new DDP wrapper buckets the gradients in another
  // order at first, so gloo sums them in another order).
  CHECK(distinct(all_of(faulty.out(), R"(round 2 params (\S+) at step 60)")).size() == 1);
  const auto faulty_params = distinct(all_of(faulty.out(), R"(final loss \S+ steps 120 params (\S+))"));
  REQUIRE(faulty_params.size() == 1);
  const double got = std::stod(*faulty_params.begin()), want = std::stod(*plain_params.begin());
  CHECK(std::abs(got - want) <= 1e-9 * std::abs(want));
  CHECK(count_lines_with(faulty.out(), "final loss") == 3);
}

TEST_CASE("torch in place: a second worker lost while the first is being recovered is replaced "
          "too, and the survivor keeps its process",
          "[torch][in_place]") {
  if (!torch_importable()) MUSTER_SKIP(kPython + " cannot import torch (install python3-torch)");
  Proc p(standalone(3, {"--in_place", "--max_restarts=2"},
                    {"--steps", "120", "--log-every", "40", "--fail-at-step", "60", "--fail-rank", "1"}),
         kEnv);
  REQUIRE(p.wait_output(out_has("failing at step 60 as asked"), 180s));
  // Rank 1 is gone and the survivors are recovering (the replacement is still importing
  // torch): rank 2 dies too.
  const auto first = started(p.out());
  REQUIRE(first.count({1, 2}) == 1);
  ::kill(std::stoi(first.at({1, 2})), SIGKILL);
  const auto rc = p.wait(180s);
  INFO(p.out() << p.err());
  REQUIRE(rc == 0);
  // Rank 0 re-formed in its own process (once or twice, by how the losses fell); ranks 1 and
  // 2 are new processes; every rank ends with the same parameters.
  const auto pids = started(p.out());
  std::set<std::string> rank0;
  for (const auto& [key, pid] : pids) {
    if (key.second == 0) rank0.insert(pid);
  }
  CHECK(rank0 == std::set<std::string>{first.at({1, 0})});
  const auto reformed = distinct(all_of(p.out(), R"(rank 0: pid (\d+) re-formed in place as rank 0 of 3)"));
  CHECK(reformed == std::set<std::string>{first.at({1, 0})});
  std::set<std::string> rank2;
  for (const auto& [key, pid] : pids) {
    if (key.second == 2) rank2.insert(pid);
  }
  CHECK(rank2.size() == 2);  // the first, and its replacement
  CHECK(count_lines_with(p.out(), "final loss") == 3);
  CHECK(distinct(all_of(p.out(), R"(final loss \S+ steps 120 params (\S+))")).size() == 1);
}

TEST_CASE("torch in place: a replacement killed while it starts is replaced again, and the "
          "survivors keep their processes and finish with the same parameters",
          "[torch][in_place]") {
  if (!torch_importable()) MUSTER_SKIP(kPython + " cannot import torch (install python3-torch)");
  auto env = kEnv;
  env["MUSTER_LOG_LEVEL"] = "info";  // the replacement's start
  Proc p(standalone(3, {"--in_place", "--max_restarts=3"},
                    {"--steps", "200", "--log-every", "50", "--fail-at-step", "60", "--fail-rank", "1"}),
         env);
  // Rank 1 exits; the agent starts its replacement, which imports torch (over a second)
  // while the survivors wait in the new group: it is killed there.
  static const std::string kNew = R"(local rank 1 \(rank 1\) starts in a new process \(pid (\d+)\))";
  REQUIRE(p.wait_output([](const std::string&, const std::string& err) {
    return !all_of(err, kNew).empty();
  }, 180s));
  const std::string starting = all_of(p.err(), kNew).front();
  const auto first = started(p.out());
  REQUIRE(first.size() == 3);
  ::kill(std::stoi(starting), SIGKILL);
  const auto rc = p.wait(180s);
  INFO(p.out() << p.err());
  REQUIRE(rc == 0);
  const auto pids = started(p.out());
  // It never reached its round (killed while it started); another process holds rank 1.
  for (const auto& [key, pid] : pids) CHECK(pid != starting);
  std::set<std::string> rank1;
  for (const auto& [key, pid] : pids) {
    if (key.second == 1) rank1.insert(pid);
  }
  CHECK(rank1.size() == 2);  // the first, and the replacement that started
  CHECK(rank1.count(first.at({1, 1})) == 1);
  // The survivors kept their processes through both re-forms.
  for (int r : {0, 2}) {
    std::set<std::string> mine;
    for (const auto& [key, pid] : pids) {
      if (key.second == r) mine.insert(pid);
    }
    CHECK(mine == std::set<std::string>{first.at({1, r})});
  }
  CHECK(count_lines_with(p.out(), "final loss") == 3);
  CHECK(distinct(all_of(p.out(), R"(final loss \S+ steps 200 params (\S+))")).size() == 1);
}

TEST_CASE("torch in place: kill -9 of a node: the survivors go on in their own processes in a "
          "world of two, with the same parameters, and finish",
          "[torch][in_place]") {
  if (!torch_importable()) MUSTER_SKIP(kPython + " cannot import torch (install python3-torch)");
  RdzvdProc server;
  const std::vector<std::string> conf{"--rdzv_conf=last_call_timeout=60", "--in_place",
                                      "--max_restarts=1"};
  auto agent = [&] {
    std::vector<std::string> argv = c10d(server.endpoint, "2:3", 1, "tip", conf);
    argv.insert(argv.begin(), kLaunch);
    for (const std::string& a : script({"--steps", "400", "--log-every", "100", "--step-sleep-ms", "10"})) {
      argv.push_back(a);
    }
    return std::make_unique<Proc>(argv, kEnv);
  };
  auto a = agent(), b = agent(), c = agent();
  auto stepping = [](const std::string& out, const std::string&) {
    return out.find("in place, round 1") != std::string::npos;
  };
  for (auto* p : {a.get(), b.get(), c.get()}) REQUIRE(p->wait_output(stepping, 120s));
  // Rank 0 logs step 0 once every rank is in the training loop.
  REQUIRE(rank0_said({a.get(), b.get(), c.get()}, "step 0: loss"));
  ::kill(b->pid(), SIGKILL);
  REQUIRE(b->wait() == 128 + SIGKILL);
  for (Proc* p : {a.get(), c.get()}) {
    const auto rc = p->wait(180s);
    INFO(p->out() << p->err());
    CHECK(rc == 0);
    const auto pids = started(p->out());
    REQUIRE(pids.size() == 1);  // nothing new started on a survivor
    CHECK(all_of(p->out(), R"(: pid (\d+) re-formed in place as rank \d of 2, round 2)") ==
          std::vector<std::string>{pids.begin()->second});
    CHECK(count_lines_with(p->out(), "final loss") == 1);
  }
  // Both survivors hold the same parameters after the re-form and at the end.
  const std::string both = a->out() + c->out();
  CHECK(all_of(both, R"(round 2 params (\S+))").size() == 2);
  CHECK(distinct(all_of(both, R"(round 2 params (\S+))")).size() == 1);
  CHECK(distinct(all_of(both, R"(final loss \S+ steps 400 params (\S+))")).size() == 1);
}

TEST_CASE("torch in place: a newcomer within MIN:MAX receives the survivors' state, and they keep "
          "their processes",
          "[torch][in_place]") {
  if (!torch_importable()) MUSTER_SKIP(kPython + " cannot import torch (install python3-torch)");
  RdzvdProc server;
  const std::vector<std::string> conf{"--rdzv_conf=last_call_timeout=0.5", "--in_place",
                                      "--max_restarts=1"};
  auto agent = [&] {
    std::vector<std::string> argv = c10d(server.endpoint, "2:3", 1, "tnew", conf);
    argv.insert(argv.begin(), kLaunch);
    for (const std::string& a : script({"--steps", "400", "--log-every", "100", "--step-sleep-ms", "10"})) {
      argv.push_back(a);
    }
    auto env = kEnv;
    env["MUSTER_LOG_LEVEL"] = "info";  // the agents' steps, should the test fail
    return std::make_unique<Proc>(argv, env);
  };
  auto a = agent(), b = agent();
  for (auto* p : {a.get(), b.get()}) REQUIRE(p->wait_output(out_has("in place, round 1"), 120s));
  REQUIRE(rank0_said({a.get(), b.get()}, "step 100: loss"));
  auto c = agent();  // joins the running job: round 2 has three nodes
  for (Proc* p : {a.get(), b.get(), c.get()}) {
    const auto rc = p->wait(180s);
    INFO(p->out() << p->err());
    CHECK(rc == 0);
  }
  bool any_gave_up = false;
  for (Proc* p : {a.get(), b.get()}) {
    INFO(p->out() << p->err());  // a second start on a survivor: its agent says why
    INFO("the newcomer:\n" << c->out() << c->err());
    const auto pids = started(p->out());
    // Only a survivor gloo left blocked (gave_up) has a second process.
    if (gave_up(p->out(), p->err())) {
      any_gave_up = true;
      CHECK(pids.size() == 2);
      continue;
    }
    REQUIRE(pids.size() == 1);
    CHECK(all_of(p->out(), R"(: pid (\d+) re-formed in place as rank \d of 3, round \d)").size() >= 1);
    for (const std::string& pid : all_of(p->out(), R"(: pid (\d+) re-formed in place)")) {
      CHECK(pid == pids.begin()->second);
    }
  }
  if (!any_gave_up) {
    for (Proc* p : {a.get(), b.get()}) {
      CHECK(all_of(p->out(), R"(: pid \d+ re-formed in place as rank \d of 3, round (\d+))") ==
            std::vector<std::string>{"2"});
    }
    CHECK_THAT(c->out(), Catch::Contains("in place, round 2"));
  }
  // At every re-form the ranks agree on their state; the newcomer took it (the end is the
  // same on all three).
  const std::string all = a->out() + b->out() + c->out();
  check_rounds_agree(all);
  CHECK(all_of(all, R"(final loss \S+ steps 400 params (\S+))").size() == 3);
  CHECK(distinct(all_of(all, R"(final loss \S+ steps 400 params (\S+))")).size() == 1);
}

TEST_CASE("torch in place: without --in_place the script is an ordinary DDP job: a failure "
          "restarts every worker, which resume from the checkpoint",
          "[torch][in_place]") {
  if (!torch_importable()) MUSTER_SKIP(kPython + " cannot import torch (install python3-torch)");
  TempDir dir;
  Proc p(standalone(2, {"--max_restarts=1"},
                    {"--steps", "120", "--log-every", "40", "--fail-at-step", "70", "--fail-rank",
                     "0", "--checkpoint", dir.file("ck.pt"), "--checkpoint-every", "50"}),
         kEnv);
  INFO(p.out() << p.err());
  REQUIRE(p.wait(180s) == 0);
  CHECK(started(p.out()).empty());  // no control channel: not in place
  CHECK_THAT(p.out(), Catch::Contains("failing at step 70"));
  CHECK(count_lines_with(p.out(), "re-formed in place") == 0);
  CHECK(distinct(all_of(p.out(), R"(final loss \S+ steps 120 params (\S+))")).size() == 1);
  CHECK(count_lines_with(p.out(), "final loss") == 2);
  CHECK_THAT(p.err(), Catch::Contains("restarting workers"));
}

namespace {

// "--spares: spare pid N is ready" lines of launch's log, in order.
std::vector<std::string> ready_spares(const std::string& err) {
  return all_of(err, R"(--spares: spare pid (\d+) is ready)");
}

// The spares started beside running workers (not the warm-up's, which become the first
// workers) that are ready, in order.
std::vector<std::string> ready_extra_spares(const std::string& err) {
  const auto extra = distinct(all_of(err, R"(--spares: spare started \(pid (\d+)\))"));
  std::vector<std::string> out;
  for (const std::string& pid : ready_spares(err)) {
    if (extra.count(pid) != 0) out.push_back(pid);
  }
  return out;
}

// A launch of the script with --in_place --spares=1 (2:3 nodes of one worker, info logs) on
// `server`'s run `run`, training until the test ends it.
std::unique_ptr<Proc> spare_agent(const RdzvdProc& server, const std::string& run, int max_restarts) {
  auto env = kEnv;
  env["MUSTER_LOG_LEVEL"] = "info";
  std::vector<std::string> argv =
      c10d(server.endpoint, "2:3", 1, run,
           {"--rdzv_conf=last_call_timeout=0.5", "--in_place", "--spares=1",
            "--max_restarts=" + std::to_string(max_restarts)});
  argv.insert(argv.begin(), kLaunch);
  // Long enough for a newcomer's warm-up on a loaded machine (the test ends it).
  for (const std::string& a : script({"--steps", "1000000", "--log-every", "100", "--step-sleep-ms", "10"})) {
    argv.push_back(a);
  }
  return std::make_unique<Proc>(argv, env);
}

// Two such agents, in their first round and past rank 0's step 100.
std::pair<std::unique_ptr<Proc>, std::unique_ptr<Proc>> two_training(const RdzvdProc& server,
                                                                      const std::string& run,
                                                                      int max_restarts) {
  auto a = spare_agent(server, run, max_restarts), b = spare_agent(server, run, max_restarts);
  for (auto* p : {a.get(), b.get()}) REQUIRE(p->wait_output(out_has("in place, round 1"), 120s));
  REQUIRE(rank0_said({a.get(), b.get()}, "step 100: loss"));
  return {std::move(a), std::move(b)};
}

// two_training's two agents, once each has a spare ready beside its running worker.
std::pair<std::unique_ptr<Proc>, std::unique_ptr<Proc>> two_training_with_spares(
    const RdzvdProc& server, const std::string& run, int max_restarts) {
  auto both = two_training(server, run, max_restarts);
  for (Proc* p : {both.first.get(), both.second.get()}) {
    const bool ready = p->wait_output(
        [](const std::string&, const std::string& err) { return !ready_extra_spares(err).empty(); },
        120s);
    INFO(p->out() << p->err());
    REQUIRE(ready);
  }
  return both;
}

}  // namespace

TEST_CASE("torch in place with --spares: a spare that dies while it waits is started again, and "
          "a worker crash is taken by the warm spare while the survivors keep their processes "
          "and agree on their parameters",
          "[torch][in_place][spares]") {
  if (!torch_importable()) MUSTER_SKIP(kPython + " cannot import torch (install python3-torch)");
  auto env = kEnv;
  env["MUSTER_LOG_LEVEL"] = "info";  // the spares' lines
  // Long enough for any spare's start on a loaded machine (the test ends it with SIGTERM).
  Proc p(standalone(3, {"--in_place", "--spares=1", "--max_restarts=2"},
                    {"--steps", "1000000", "--log-every", "100", "--step-sleep-ms", "10"}),
         env);
  auto spares_ready = [](std::size_t n) {
    return [n](const std::string&, const std::string& err) {
      return ready_extra_spares(err).size() >= n;
    };
  };
  REQUIRE(p.wait_output(spares_ready(1), 120s));
  // The node's own workers started warm: each was a spare, taken when the round formed.
  const auto first = started(p.out());
  REQUIRE(first.count({1, 1}) == 1);
  CHECK_THAT(p.err(), Catch::Contains("--spares: spare pid " + first.at({1, 1}) + " takes local rank 1"));
  // The extra spare dies (it held no rank): another is started, nobody else is touched.
  const std::string first_spare = ready_extra_spares(p.err()).front();
  ::kill(std::stoi(first_spare), SIGKILL);
  REQUIRE(p.wait_output(spares_ready(2), 120s));
  const std::string spare = ready_extra_spares(p.err()).back();
  CHECK(spare != first_spare);
  CHECK_THAT(p.err(), Catch::Contains("exited (signal 9); starting another"));
  REQUIRE(p.wait_output(out_has("step 100: loss"), 120s));
  // A worker crash: the ready spare becomes rank 1 of round 2 (no new interpreter).
  ::kill(std::stoi(first.at({1, 1})), SIGKILL);
  const bool took = p.wait_output(
      [&](const std::string& out, const std::string& err) {
        return started(out).count({2, 1}) == 1 && all_of(out, R"(round 2 params (\S+))").size() == 2 &&
               ready_extra_spares(err).size() >= 3;
      },
      120s);
  INFO(p.out() << p.err());
  REQUIRE(took);
  const auto pids = started(p.out());
  REQUIRE(pids.count({2, 1}) == 1);
  CHECK(pids.at({2, 1}) == spare);
  CHECK_THAT(p.err(), Catch::Contains("--spares: spare pid " + spare + " takes local rank 1"));
  CHECK(pids.size() == 4);  // round 1's three, then the spare as rank 1: nobody else started
  CHECK(pids.at({2, 1}) != first.at({1, 1}));
  for (int r : {0, 2}) {
    CHECK(all_of(p.out(), "rank " + std::to_string(r) + R"(: pid (\d+) re-formed in place as rank )" +
                              std::to_string(r) + " of 3, round 2") ==
          std::vector<std::string>{pids.at({1, r})});
  }
  // The survivors agree on the state the spare received at the re-form; a new spare was made
  // ready after the take (the next crash finds one).
  CHECK(distinct(all_of(p.out(), R"(round 2 params (\S+))")).size() == 1);
  ::kill(p.pid(), SIGTERM);
  CHECK(p.wait(60s) == 143);
}

TEST_CASE("launch --spares: it needs --in_place (one line, exit 2), and a program that never waits as a "
          "spare is started as usual after one warm-up, with no spare beside it",
          "[in_place][spares]") {
  Proc bad({kLaunch, "--standalone", "--nproc_per_node=1", "--spares=1", "/bin/true"});
  CHECK(bad.wait() == 2);
  CHECK_THAT(bad.err(), Catch::Contains("--spares needs --in_place"));
  CHECK(count_lines_with(bad.err(), "error") == 1);
  // /bin/true exits before it could wait as a spare: the warm-up says so in one line, the
  // workers start as usual, the job ends 0, and no spare is started beside them.
  Proc quiet({kLaunch, "--standalone", "--nproc_per_node=2", "--in_place", "--spares=2", "/bin/true"},
             {{"MUSTER_LOG_LEVEL", "info"}});
  CHECK(quiet.wait() == 0);
  CHECK(count_lines_with(quiet.err(), "the program cannot wait as a spare; its workers start as usual") == 1);
  CHECK_THAT(quiet.err(), !Catch::Contains("spare started"));
  CHECK_THAT(quiet.err(), !Catch::Contains("takes local rank"));
}

TEST_CASE("torch in place with --spares: a newcomer within MIN:MAX joins only once its worker "
          "waits warm, takes it for its rank, and the survivors keep their processes",
          "[torch][in_place][spares]") {
  if (!torch_importable()) MUSTER_SKIP(kPython + " cannot import torch (install python3-torch)");
  RdzvdProc server;
  auto [a, b] = two_training(server, "tspare", 1);
  auto c = spare_agent(server, "tspare", 1);
  {
    const bool joined = c->wait_output(out_has("in place, round"), 120s);
    INFO(c->out() << c->err());
    REQUIRE(joined);
  }
  // A survivor gloo left blocked at the newcomer's round (gave_up) has its spare take its rank.
  for (Proc* p : {a.get(), b.get()}) {
    const bool ok = p->wait_output(
        [](const std::string& out, const std::string& err) {
          for (const std::string& r : all_of(out, R"(round (\d+) params)")) {
            if (std::stoi(r) >= 2) return true;
          }
          return gave_up(out, err) && started(out).size() == 2;
        },
        60s);
    INFO(p->out() << p->err());
    REQUIRE(ok);
  }
  for (Proc* p : {a.get(), b.get(), c.get()}) ::kill(p->pid(), SIGTERM);
  for (Proc* p : {a.get(), b.get(), c.get()}) {
    const auto rc = p->wait(60s);
    INFO(p->out() << p->err());
    CHECK(rc == 143);
  }
  // The newcomer's worker was a spare that waited before the node joined: the take names it.
  const auto mine = started(c->out());
  REQUIRE(mine.size() == 1);
  CHECK(mine.begin()->first.first >= 2);
  CHECK_THAT(c->err(), Catch::Contains("--spares: spare pid " + mine.begin()->second +
                                       " takes local rank 0"));
  for (Proc* p : {a.get(), b.get()}) {
    INFO(p->out() << p->err());
    const auto pids = started(p->out());
    if (gave_up(p->out(), p->err())) {
      // Its second process is its spare, taken for the rank it gave up.
      REQUIRE(pids.size() == 2);
      CHECK_THAT(p->err(), Catch::Contains("--spares: spare pid " + pids.rbegin()->second +
                                           " takes local rank 0"));
      continue;
    }
    REQUIRE(pids.size() == 1);
    const auto reformed = all_of(p->out(), R"(: pid (\d+) re-formed in place as rank \d of 3, round \d+)");
    CHECK(!reformed.empty());
    CHECK(distinct(reformed) == std::set<std::string>{pids.begin()->second});
  }
  // At every re-form the ranks agree on their state (the newcomer received it).
  const std::string all = a->out() + b->out() + c->out();
  check_rounds_agree(all);
}

TEST_CASE("torch in place with --spares: the only worker of a node crashes and the node's spare "
          "takes its rank (the clean-up after a node's last worker leaves the waiting spare "
          "alone), while the other node keeps its process",
          "[torch][in_place][spares]") {
  if (!torch_importable()) MUSTER_SKIP(kPython + " cannot import torch (install python3-torch)");
  RdzvdProc server;
  // Two restarts: one for the crash, one should gloo leave the survivor blocked (it says so).
  auto [a, b] = two_training_with_spares(server, "tonly", 2);
  // The node of rank 1 loses its one worker; rank 0's node logs the steps on.
  const bool a_has_1 = a->out().find("rank 1: pid") != std::string::npos;
  Proc& hit = a_has_1 ? *a : *b;
  Proc& other = a_has_1 ? *b : *a;
  const auto before = started(hit.out());
  REQUIRE(before.count({1, 1}) == 1);
  const std::string victim = before.at({1, 1});
  const std::string spare = ready_extra_spares(hit.err()).front();
  ::kill(std::stoi(victim), SIGKILL);
  {
    // The spare took the rank and answered for its first round: the node's recovery is done
    // (not left to fall back to a full restart after the in-place timeout).
    const bool took = hit.wait_output(
        [&](const std::string& out, const std::string& err) {
          return out.find("pid " + spare + " in place, round") != std::string::npos &&
                 err.find("in-place recovery done") != std::string::npos;
        },
        120s);
    INFO(hit.out() << hit.err());
    REQUIRE(took);
  }
  const std::string step_now = all_of(other.out() + hit.out(), R"(step (\d+): loss)").back();
  const int after = std::stoi(step_now) + 200;
  REQUIRE(rank0_said({a.get(), b.get()}, "step " + std::to_string(after - after % 100) + ": loss"));
  for (Proc* p : {a.get(), b.get()}) ::kill(p->pid(), SIGTERM);
  for (Proc* p : {a.get(), b.get()}) {
    const auto rc = p->wait(60s);
    INFO(p->out() << p->err());
    CHECK(rc == 143);
  }
  INFO(hit.out() << hit.err());
  // The crash is the node's one failure: the spare it had waiting took the rank and lived.
  CHECK_THAT(hit.err(), Catch::Contains("--spares: spare pid " + spare + " takes local rank 0 (rank 1)"));
  CHECK(count_lines_with(hit.err(), " failed: ") == 1);
  CHECK_THAT(hit.err(), Catch::Contains("pid " + victim + ") failed: SIGKILL"));
  // The other node kept its process, unless gloo left it blocked and it said so.
  INFO(other.out() << other.err());
  if ((other.out() + other.err()).find("still blocked") == std::string::npos) {
    const auto pids = started(other.out());
    REQUIRE(pids.size() == 1);
    const auto reformed = all_of(other.out(), R"(: pid (\d+) re-formed in place as rank 0 of 2)");
    CHECK(!reformed.empty());
    CHECK(distinct(reformed) == std::set<std::string>{pids.begin()->second});
  }
}

TEST_CASE("torch in place with --spares: a spare killed as it takes a dead worker's rank is "
          "replaced by a new process, which answers for its first round: the node's recovery "
          "completes",
          "[torch][in_place][spares]") {
  if (!torch_importable()) MUSTER_SKIP(kPython + " cannot import torch (install python3-torch)");
  RdzvdProc server;
  // Three restarts: the crash, the spare's death, one should gloo leave the survivor blocked.
  auto [a, b] = two_training_with_spares(server, "tnew", 3);
  Proc& hit = a->out().find("rank 1: pid") != std::string::npos ? *a : *b;
  const std::string spare = ready_extra_spares(hit.err()).front();
  ::kill(std::stoi(started(hit.out()).at({1, 1})), SIGKILL);
  REQUIRE(hit.wait_output(
      [&](const std::string&, const std::string& err) {
        return err.find("spare pid " + spare + " takes local rank 0") != std::string::npos;
      },
      120s));
  ::kill(std::stoi(spare), SIGKILL);
  // No spare is ready at once (the next one is still importing torch): a new process takes the
  // rank, and once it has stepped, the node says its recovery is done.
  const bool done = hit.wait_output(
      [](const std::string&, const std::string& err) {
        const auto at = err.find("starts in a new process");
        return at != std::string::npos &&
               err.find("in-place recovery done", at) != std::string::npos;
      },
      120s);
  INFO(hit.out() << hit.err());
  REQUIRE(done);
  CHECK_THAT(hit.err(), !Catch::Contains("falling back"));
  const auto pid = all_of(hit.err(), R"(starts in a new process \(pid (\d+)\))");
  REQUIRE(pid.size() == 1);
  CHECK_THAT(hit.out(), Catch::Contains("rank 1: pid " + pid.front() + " in place, round"));
  for (Proc* p : {a.get(), b.get()}) ::kill(p->pid(), SIGTERM);
  for (Proc* p : {a.get(), b.get()}) {
    const auto rc = p->wait(60s);
    INFO(p->out() << p->err());
    CHECK(rc == 143);
  }
}

TEST_CASE("torch in place with --spares: a node lost while it joins leaves the others training in "
          "their own processes in the world they had",
          "[torch][in_place][spares]") {
  if (!torch_importable()) MUSTER_SKIP(kPython + " cannot import torch (install python3-torch)");
  RdzvdProc server;
  auto [a, b] = two_training(server, "tjoin", 2);
  // The newcomer's round forms: its warm worker is taken for its rank and is joining the
  // others' group when its node dies.
  auto c = spare_agent(server, "tjoin", 2);
  REQUIRE(c->wait_output([](const std::string&, const std::string& err) {
    return err.find("takes local rank 0") != std::string::npos;
  }, 120s));
  ::kill(c->pid(), SIGKILL);
  REQUIRE(c->wait() == 128 + SIGKILL);
  // The two go on in a world of two, each in its own process, with the same parameters, and
  // train on (rank 0 logs a step of a round after the newcomer's).
  for (Proc* p : {a.get(), b.get()}) {
    const bool ok = p->wait_output(
        [](const std::string& out, const std::string& err) {
          // One gloo left blocked at the newcomer's round: its spare takes its rank.
          if (gave_up(out, err)) return started(out).size() == 2;
          for (const std::string& r : all_of(out, R"(re-formed in place as rank \d of 2, round (\d+))")) {
            if (std::stoi(r) >= 3) return true;
          }
          return false;
        },
        120s);
    INFO(what_happened(p->err()) << "\n" << p->out() << p->err());
    REQUIRE(ok);
  }
  auto largest = [](const std::vector<std::string>& v) {
    int m = -1;
    for (const std::string& x : v) m = std::max(m, std::stoi(x));
    return m;
  };
  const std::string both_before = a->out() + b->out();
  const std::string round =
      std::to_string(largest(all_of(both_before, R"(re-formed in place as rank \d of 2, round (\d+))")));
  const int after = largest(all_of(both_before, R"(step (\d+): loss)")) + 200;
  REQUIRE(rank0_said({a.get(), b.get()}, "step " + std::to_string(after - after % 100) + ": loss"));
  for (Proc* p : {a.get(), b.get()}) ::kill(p->pid(), SIGTERM);
  bool any_gave_up = false;
  for (Proc* p : {a.get(), b.get()}) {
    const auto rc = p->wait(60s);
    INFO(p->out() << p->err());
    CHECK(rc == 143);
    const auto pids = started(p->out());
    if (gave_up(p->out(), p->err())) {
      any_gave_up = true;
      REQUIRE(pids.size() == 2);
      CHECK_THAT(p->err(), Catch::Contains("--spares: spare pid " + pids.rbegin()->second +
                                           " takes local rank 0"));
      continue;
    }
    REQUIRE(pids.size() == 1);  // nothing new started on a survivor
    CHECK(distinct(all_of(p->out(), R"(: pid (\d+) re-formed in place as rank)")) ==
          std::set<std::string>{pids.begin()->second});
  }
  // Each survivor that re-formed says the state it holds (a new process says nothing).
  const auto params = all_of(a->out() + b->out(), "round " + round + R"( params (\S+))");
  CHECK(params.size() == (any_gave_up ? 1u : 2u));
  CHECK(distinct(params).size() == 1);
}
