// `rdzvd status`, `launch status` and rdzvd's --event_log against a real rdzvd with real
// agents (launch processes running tests/support/test_worker) on 127.0.0.1.
#include <signal.h>

#include <catch2/catch.hpp>
#include <fstream>
#include <map>
#include <regex>
#include <set>

#include "helpers.h"
#include "rdzvd_proc.h"

using namespace muster::testing;

namespace {

// Runs a Python 3 script (stdlib json) on `args`; its stdout. The JSON is parsed by a real
// parser, not matched as text.
std::string python(const std::string& script, const std::vector<std::string>& args) {
  std::vector<std::string> argv{"/usr/bin/python3", "-c", script};
  argv.insert(argv.end(), args.begin(), args.end());
  Proc py(argv);
  const auto code = py.wait(60s);
  INFO(py.err());
  REQUIRE(code == 0);
  return py.out();
}

// One line per run and per member of a status document, from its parsed JSON (phase_age_ms
// left out: it differs between two calls).
const char* const kSummarize = R"PY(
import json, sys
d = json.loads(sys.argv[1])
assert isinstance(d["store"]["parked_waits"], int)
assert d["server"]["version"].count(".") == 2 and d["server"]["commit"], d["server"]
for r in d["runs"]:
    f = r["last_failure"]
    print("run", r["run_id"], r["phase"], r.get("result", "-"), r["round"], r["world_size"],
          "%d/%d" % (r["restart_count"], r["max_restarts"]), "%d:%d" % (r["min_nodes"], r["max_nodes"]),
          "waiting", len(r["waiting"]), "age_ok", isinstance(r["phase_age_ms"], int) and r["phase_age_ms"] >= 0)
    for m in r["members"]:
        print("member", m["group_rank"], m["node_id"], m["host"], "%d-%d" % (m["first_rank"], m["last_rank"]),
              m["local_world_size"])
    if f is not None:
        print("failure", f["round"], f["rank"], f["host"], f["exit_code"], f["signal"], f["reason"])
)PY";

std::string node_of(const Proc& agent) { return "127.0.0.1:" + std::to_string(agent.pid()); }

void stop(Proc& agent) {
  ::kill(agent.pid(), SIGTERM);
  CHECK(agent.wait(30s) == 128 + SIGTERM);
}

}  // namespace

TEST_CASE("status: rdzvd status and launch status show runs, members with host and ranks",
          "[status]") {
  RdzvdProc server;
  Proc a(launch_args(agent_flags(server.endpoint, "2", 2, "job"), {"wait"}));
  Proc b(launch_args(agent_flags(server.endpoint, "2", 2, "job"), {"wait"}));
  Proc solo(launch_args(agent_flags(server.endpoint, "1", 1, "solo"), {"wait"}));
  REQUIRE(a.wait_output(has_ready(2, "world 4 round 1"), 30s));
  REQUIRE(b.wait_output(has_ready(2, "world 4 round 1"), 30s));
  REQUIRE(solo.wait_output(has_ready(1, "world 1 round 1"), 30s));
  const std::set<std::string> job_nodes{node_of(a), node_of(b)};

  {  // the table: a line per run, its members with group rank, ranks, host and node
    Proc st({kRdzvd, "status", "--endpoint", server.endpoint});
    REQUIRE(st.wait(30s) == 0);
    const std::string& out = st.out();
    INFO(out);
    CHECK(st.err().empty());
    CHECK(std::regex_search(out, std::regex(R"((^|\n)RUN +PHASE +ROUND +RESTARTS +NODES +WORLD)")));
    CHECK(std::regex_search(out, std::regex(R"((^|\n)job +running +1 +0/0 +2:2 +4 +\S+\n)")));
    CHECK(std::regex_search(out, std::regex(R"((^|\n)solo +running +1 +0/0 +1:1 +1 +\S+\n)")));
    std::map<std::string, std::string> ranks_by_node;
    std::set<std::string> groups;
    static const std::regex member(R"(\n  member +(\d) +(\S+) +127\.0\.0\.1 +(127\.0\.0\.1:\d+)(?=\n))");
    for (auto it = std::sregex_iterator(out.begin(), out.end(), member);
         it != std::sregex_iterator(); ++it) {
      ranks_by_node[(*it)[3]] = (*it)[1].str() + " " + (*it)[2].str();
    }
    REQUIRE(ranks_by_node.size() == 3);  // a, b and solo's agent
    CHECK(ranks_by_node[node_of(solo)] == "0 0");
    // Which of a and b got group rank 0 is join order; each group rank has its ranks.
    std::set<std::string> job_ranks{ranks_by_node[node_of(a)], ranks_by_node[node_of(b)]};
    CHECK(job_ranks == std::set<std::string>{"0 0-1", "1 2-3"});
  }

  {  // --run filters; --json from rdzvd and launch parse to the same run
    Proc only({kRdzvd, "status", "--endpoint", server.endpoint, "--run", "job"});
    REQUIRE(only.wait(30s) == 0);
    CHECK_THAT(only.out(), Catch::Contains("job "));
    CHECK_THAT(only.out(), !Catch::Contains("solo"));

    Proc rj({kRdzvd, "status", "--endpoint", server.endpoint, "--run", "job", "--json"});
    REQUIRE(rj.wait(30s) == 0);
    CHECK(count_lines_with(rj.out(), "{") == 1);  // one document, one line
    const std::string summary = python(kSummarize, {rj.out()});
    INFO(summary);
    CHECK_THAT(summary, Catch::StartsWith("run job running - 1 4 0/0 2:2 waiting 0 age_ok True\n"));
    std::set<std::string> members;
    std::istringstream lines(summary);
    for (std::string line; std::getline(lines, line);) {
      if (line.rfind("member ", 0) == 0) members.insert(line);
    }
    REQUIRE(members.size() == 2);
    // Group rank 0 holds ranks 0-1, group rank 1 ranks 2-3, each one of the two agents.
    std::set<std::string> nodes;
    for (const std::string& m : members) {
      std::smatch g;
      REQUIRE(std::regex_match(m, g, std::regex(R"(member (\d) (\S+) 127\.0\.0\.1 (\d-\d) 2)")));
      CHECK(g[3].str() == (g[1].str() == "0" ? "0-1" : "2-3"));
      nodes.insert(g[2].str());
    }
    CHECK(nodes == job_nodes);

    Proc lj({kLaunch, "status", "--rdzv_endpoint", server.endpoint, "--rdzv_id", "job", "--json"});
    REQUIRE(lj.wait(30s) == 0);
    CHECK(python(kSummarize, {lj.out()}) == summary);

    Proc all({kRdzvd, "status", "--endpoint", server.endpoint, "--json"});
    REQUIRE(all.wait(30s) == 0);
    const std::string both = python(kSummarize, {all.out()});
    CHECK_THAT(both, Catch::Contains("run job running"));
    CHECK_THAT(both, Catch::Contains("run solo running - 1 1 0/0 1:1"));
  }

  {  // errors: unknown run, unreachable server, usage (one line each)
    Proc unknown({kRdzvd, "status", "--endpoint", server.endpoint, "--run", "nope"});
    CHECK(unknown.wait(30s) == 1);
    CHECK(unknown.out().empty());
    CHECK(unknown.err() ==
          "rdzvd: error: the rendezvous server at " + server.endpoint + " holds no run 'nope'\n");
    Proc lunknown({kLaunch, "status", "--rdzv_endpoint", server.endpoint, "--rdzv_id", "nope"});
    CHECK(lunknown.wait(30s) == 1);
    CHECK(lunknown.err() ==
          "launch: error: the rendezvous server at " + server.endpoint + " holds no run 'nope'\n");

    const std::string nobody = "127.0.0.1:" + std::to_string(free_port());
    Proc unreachable({kRdzvd, "status", "--endpoint", nobody});
    CHECK(unreachable.wait(30s) == 1);
    CHECK_THAT(unreachable.err(),
               Catch::StartsWith("rdzvd: error: cannot reach the rendezvous server at " + nobody));
    CHECK(count_lines_with(unreachable.err(), "") == 1);
    Proc lunreachable({kLaunch, "status", "--rdzv_endpoint", nobody});
    CHECK(lunreachable.wait(30s) == 1);
    CHECK_THAT(lunreachable.err(), Catch::StartsWith("launch: error: cannot reach"));

    Proc bad_flag({kRdzvd, "status", "--bogus"});
    CHECK(bad_flag.wait(30s) == 2);
    CHECK_THAT(bad_flag.err(), Catch::StartsWith("rdzvd: error: "));
    Proc bad_endpoint({kRdzvd, "status", "--endpoint", "127.0.0.1:notaport"});
    CHECK(bad_endpoint.wait(30s) == 2);
    CHECK_THAT(bad_endpoint.err(), Catch::StartsWith("rdzvd: error: endpoint '127.0.0.1:notaport'"));
    Proc no_endpoint({kLaunch, "status"}, {{"PET_RDZV_ENDPOINT", std::nullopt}});
    CHECK(no_endpoint.wait(30s) == 2);
    CHECK_THAT(no_endpoint.err(), Catch::StartsWith("launch: error: --rdzv_endpoint"));
  }
  stop(a);
  stop(b);
  stop(solo);
}

TEST_CASE("status: a server with a token refuses a status call without it", "[status]") {
  RdzvdProc server({"--token", "s3cret"});
  const std::map<std::string, std::optional<std::string>> no_env{{"MUSTER_RDZV_TOKEN", std::nullopt}};
  Proc refused({kRdzvd, "status", "--endpoint", server.endpoint}, no_env);
  CHECK(refused.wait(30s) == 1);
  CHECK_THAT(refused.err(), Catch::StartsWith("rdzvd: error: the rendezvous server at " +
                                              server.endpoint + " refused the status call"));
  Proc wrong({kRdzvd, "status", "--endpoint", server.endpoint, "--token", "guess"}, no_env);
  CHECK(wrong.wait(30s) == 1);
  Proc flag({kRdzvd, "status", "--endpoint", server.endpoint, "--token", "s3cret"}, no_env);
  CHECK(flag.wait(30s) == 0);
  CHECK(flag.out() == "no runs\n");
  Proc env({kLaunch, "status", "--rdzv_endpoint", server.endpoint},
           {{"MUSTER_RDZV_TOKEN", std::string("s3cret")}});
  CHECK(env.wait(30s) == 0);
  CHECK(env.out() == "no runs\n");
}

// Each line of an event log, parsed: name and the fields that apply, in order; checks the
// time fields of every line agree.
const char* const kEventLines = R"PY(
import datetime, json, sys
for line in open(sys.argv[1]):
    e = json.loads(line)
    if e["event"] == "earlier":
        print("earlier"); continue
    t = datetime.datetime.strptime(e["time"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.timezone.utc)
    assert len(e["time"]) == 24, e["time"]
    assert abs(t.timestamp() * 1000 - e["unix_ms"]) < 1, (e["time"], e["unix_ms"])
    keys = [k for k in e if k not in ("event", "time", "unix_ms", "source", "run", "round",
                                  "restart_count")]
    assert e["source"] == "server", e
    print(e["event"], e["run"], e["round"], e["restart_count"],
          " ".join("%s=%s" % (k, json.dumps(e[k])) for k in sorted(keys)))
)PY";

TEST_CASE("status: rdzvd --event_log writes a JSON line per event of a run that restarts",
          "[status][event_log]") {
  TempDir dir;
  const std::string log = dir.file("events.jsonl");
  { std::ofstream(log) << "{\"event\":\"earlier\"}\n"; }  // opened for append: this stays
  RdzvdProc server({"--event_log", log});
  // Rank 0 fails (exit 3) in the first round; the run restarts once and then succeeds.
  Proc a(launch_args(agent_flags(server.endpoint, "2", 2, "job", {"--max_restarts=1"}),
                     {"restart", dir.path(), "1"}));
  Proc b(launch_args(agent_flags(server.endpoint, "2", 2, "job", {"--max_restarts=1"}),
                     {"restart", dir.path(), "1"}));
  REQUIRE(a.wait(60s) == 0);
  REQUIRE(b.wait(60s) == 0);

  const std::string lines = python(kEventLines, {log});
  INFO(lines);
  std::vector<std::string> got;
  std::istringstream in(lines);
  for (std::string line; std::getline(in, line);) got.push_back(line);
  const std::set<std::string> nodes{node_of(a), node_of(b)};
  REQUIRE(got.size() == 8);
  CHECK(got[0] == "earlier");
  std::smatch m;
  for (int i : {1, 2}) {
    REQUIRE(std::regex_match(got[i], m,
                             std::regex(R"re(node_joined job 0 0 host="127\.0\.0\.1" node="([^"]+)")re")));
    CHECK(nodes.count(m[1].str()) == 1);
  }
  CHECK(got[1] != got[2]);
  CHECK(got[3] == "round_formed job 1 0 nodes=2 spares=0 world_size=4");
  REQUIRE(std::regex_match(
      got[4], m,
      std::regex(R"re(worker_failed job 1 0 exit_code=3 host="127\.0\.0\.1" node="([^"]+)" rank=0)re")));
  CHECK(nodes.count(m[1].str()) == 1);
  CHECK(std::regex_match(got[5], std::regex(R"(restart job 1 1 cause="worker_failure" counts=true )"
                                            R"re(reason="worker rank 0 on 127\.0\.0\.1 failed; restart 1 of 1")re")));
  CHECK(std::regex_match(got[6],
                         std::regex(R"(round_formed job 2 1 in_place=0 nodes=2 spares=0 took_ms=\d+ world_size=4)")));
  CHECK(got[7] == "succeeded job 2 1 ");

  // The finished run (kept for the grace) shows how it ended and its last failure.
  Proc st({kRdzvd, "status", "--endpoint", server.endpoint, "--run", "job", "--json"});
  REQUIRE(st.wait(30s) == 0);
  const std::string summary = python(kSummarize, {st.out()});
  CHECK_THAT(summary, Catch::StartsWith("run job finished succeeded 2 0 1/1 2:2 waiting 0"));
  CHECK_THAT(summary, Catch::Contains(
                          "failure 1 0 127.0.0.1 3 0 worker rank 0 on 127.0.0.1 failed; restart 1 of 1\n"));
  Proc table({kRdzvd, "status", "--endpoint", server.endpoint, "--run", "job"});
  REQUIRE(table.wait(30s) == 0);
  CHECK(std::regex_search(table.out(),
                          std::regex(R"(\n  last failure: rank 0 on 127\.0\.0\.1, exit code 3, round 1, )"
                                     R"(\S+ ago: worker rank 0 on 127\.0\.0\.1 failed; restart 1 of 1\n)")));
}

TEST_CASE("status: --event_log - writes to stderr, and a path that cannot be opened is a usage error",
          "[status][event_log]") {
  SECTION("stderr") {
    RdzvdProc server({"--event_log", "-"});
    TempDir dir;
    Proc a(launch_args(agent_flags(server.endpoint, "1", 1, "one"), {"env", dir.path()}));
    REQUIRE(a.wait(60s) == 0);
    REQUIRE(server.proc->wait_output(
        [](const std::string&, const std::string& err) {
          return err.find("{\"event\":\"succeeded\"") != std::string::npos;
        },
        30s));
    const std::string& err = server.proc->err();
    const auto joined = err.find("{\"event\":\"node_joined\"");
    const auto formed = err.find("{\"event\":\"round_formed\"");
    const auto done = err.find("{\"event\":\"succeeded\"");
    CHECK(joined < formed);
    CHECK(formed < done);
  }
  SECTION("bad path") {
    Proc bad({kRdzvd, "--listen", "127.0.0.1:0", "--event_log", "/nonexistent/dir/events.log"});
    CHECK(bad.wait(30s) == 2);
    CHECK(bad.out().empty());
    CHECK(bad.err() == "rdzvd: error: --event_log: cannot open '/nonexistent/dir/events.log' for "
                       "append: No such file or directory\n");
  }
}
