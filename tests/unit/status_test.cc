// What operators read: the state machine's RunStatus (members with ranks, waiting nodes, the
// last failure, ages, with a fake clock), the JSON writer, and the status/event formats.
#include <catch2/catch.hpp>
#include <string>

#include "join_msg.h"
#include "muster/ops/json.h"
#include "muster/status/status_format.h"
#include "muster/rendezvous/state_machine.h"

using namespace std::chrono_literals;
using muster::rendezvous::RunEvent;
using muster::rendezvous::StateMachine;
using muster::rendezvous::TimePoint;
namespace v1 = muster::v1;
namespace ops = muster::ops;
using muster::testing::join_msg;

namespace {


v1::AgentMsg failure(int round, int rank, int exit_code, int signal) {
  v1::AgentMsg m;
  m.mutable_failure()->set_round(round);
  v1::WorkerFailure* f = m.mutable_failure()->mutable_root_cause();
  f->set_rank(rank);
  f->set_host("host-b");
  f->set_exit_code(exit_code);
  f->set_signal(signal);
  f->set_timestamp_ms(1700000000123);
  return m;
}

muster::rendezvous::RendezvousTimeouts quiet() {
  muster::rendezvous::RendezvousTimeouts t;
  t.keep_alive_interval = std::chrono::hours(1);
  t.last_call_timeout = 1s;
  return t;
}

}  // namespace

TEST_CASE("status: members by group rank with their global ranks, spares waiting, ages",
          "[status]") {
  StateMachine sm(quiet());
  TimePoint now{};
  sm.on_message(1, join_msg("a", 1, 2, 1, 2), now);  // 1:2, so the round closes after the last call
  sm.on_message(2, join_msg("b", 1, 2, 1, 3), now);  // max reached: round 1 closes at once
  now += 1500ms;
  sm.on_message(3, join_msg("c", 1, 2, 1, 1), now);  // a spare
  now += 500ms;
  auto st = sm.status("run", now);
  REQUIRE(st.size() == 1);
  const v1::RunStatus& s = st[0];
  CHECK(s.phase() == "running");
  CHECK(s.result().empty());
  CHECK(s.phase_age_ms() == 2000);
  CHECK(s.world_size() == 5);
  REQUIRE(s.member_nodes_size() == 2);
  CHECK(s.member_nodes(0).node_id() == "a");
  CHECK(s.member_nodes(0).host() == "host-a");
  CHECK(s.member_nodes(0).group_rank() == 0);
  CHECK(s.member_nodes(0).first_rank() == 0);
  CHECK(s.member_nodes(0).local_world_size() == 2);
  CHECK(s.member_nodes(1).node_id() == "b");
  CHECK(s.member_nodes(1).group_rank() == 1);
  CHECK(s.member_nodes(1).first_rank() == 2);  // after a's 2 ranks: b holds 2..4
  REQUIRE(s.waiting_nodes_size() == 1);
  CHECK(s.waiting_nodes(0).node_id() == "c");
  CHECK(s.waiting_nodes(0).group_rank() == -1);
  CHECK(s.waiting() == 1);
  CHECK_FALSE(s.has_last_failure());
  CHECK(sm.status("run")[0].phase_age_ms() == 0);  // without `now`: no ages
}

TEST_CASE("status: the last failure, with the restart's reason, then the Fail's", "[status]") {
  StateMachine sm(quiet());
  TimePoint now{};
  sm.on_message(1, join_msg("a", 2, 2, 1, 2), now);
  sm.on_message(2, join_msg("b", 2, 2, 1, 2), now);
  now += 1s;
  sm.on_message(2, failure(1, 3, 7, 0), now);
  now += 250ms;
  auto st = sm.status("run", now);
  REQUIRE(st[0].has_last_failure());
  const v1::FailureStatus& f = st[0].last_failure();
  CHECK(f.round() == 1);
  CHECK(f.rank() == 3);
  CHECK(f.host() == "host-b");
  CHECK(f.node_id() == "b");
  CHECK(f.exit_code() == 7);
  CHECK(f.signal() == 0);
  CHECK(f.timestamp_ms() == 1700000000123);
  CHECK(f.age_ms() == 250);
  CHECK(f.reason() == "worker rank 3 on host-b failed; restart 1 of 1");
  CHECK(st[0].phase() == "joining");
  CHECK(st[0].phase_age_ms() == 250);  // since the restart

  // Both rejoin, round 2 fails by a signal: the budget is spent and the run ends failed.
  sm.on_message(1, join_msg("a", 2, 2, 1, 2), now);
  sm.on_message(2, join_msg("b", 2, 2, 1, 2), now);
  REQUIRE(sm.status("run", now)[0].round() == 2);
  now += 1s;
  sm.on_message(1, failure(2, 0, 0, 9), now);
  st = sm.status("run", now);
  CHECK(st[0].phase() == "finished");
  CHECK(st[0].result() == "failed");
  CHECK(st[0].member_nodes_size() == 0);
  CHECK(st[0].last_failure().round() == 2);
  CHECK(st[0].last_failure().signal() == 9);
  CHECK(st[0].last_failure().reason() == "a worker failed and all 1 restarts are spent");
}

TEST_CASE("json: arrays of JSON items, what is not UTF-8 becomes U+FFFD", "[status][json]") {
  CHECK(ops::json_array({}) == "[]");
  CHECK(ops::json_array({"1", ops::JsonObject().add("k", "v").str(), "null"}) ==
        "[1,{\"k\":\"v\"},null]");
  const std::string fffd = "\xEF\xBF\xBD";
  CHECK(ops::json_string("\xFF") == "\"" + fffd + "\"");                           // never UTF-8
  CHECK(ops::json_string("\xF4\x90\x80\x80") == "\"" + fffd + fffd + fffd + fffd + "\"");  // > U+10FFFF
  CHECK(ops::json_string("\xC3") == "\"" + fffd + "\"");                           // cut short
}

TEST_CASE("status format: the JSON document and the table", "[status]") {
  v1::StatusReply reply;
  v1::RunStatus* r = reply.add_runs();
  r->set_run_id("job\n1");
  r->set_phase("running");
  r->set_round(2);
  r->set_restart_count(1);
  r->set_max_restarts(3);
  r->set_min_nodes(1);
  r->set_max_nodes(4);
  r->set_world_size(3);
  r->set_phase_age_ms(61'500);
  for (int g = 0; g < 2; ++g) {
    v1::NodeStatus* n = r->add_member_nodes();
    n->set_node_id("n" + std::to_string(g));
    n->set_host("h" + std::to_string(g));
    n->set_group_rank(g);
    n->set_local_world_size(g == 0 ? 2 : 1);
    n->set_first_rank(g == 0 ? 0 : 2);
  }
  v1::NodeStatus* w = r->add_waiting_nodes();
  w->set_node_id("spare");
  w->set_host("h9");
  w->set_local_world_size(4);
  w->set_group_rank(-1);
  w->set_first_rank(-1);
  v1::FailureStatus* f = r->mutable_last_failure();
  f->set_round(1);
  f->set_rank(2);
  f->set_host("h1");
  f->set_node_id("n1");
  f->set_signal(9);
  f->set_timestamp_ms(1700000000123);
  f->set_age_ms(4200);
  f->set_reason("worker rank 2 on h1 failed; restart 1 of 3");
  reply.mutable_store()->set_parked_waits(5);

  CHECK(muster::status::status_json(reply) ==
        "{\"runs\":[{\"run_id\":\"job\\n1\",\"phase\":\"running\",\"round\":2,\"phase_age_ms\":61500,"
        "\"restart_count\":1,\"max_restarts\":3,\"min_nodes\":1,\"max_nodes\":4,\"world_size\":3,"
        "\"members\":[{\"node_id\":\"n0\",\"host\":\"h0\",\"group_rank\":0,\"local_world_size\":2,"
        "\"first_rank\":0,\"last_rank\":1},{\"node_id\":\"n1\",\"host\":\"h1\",\"group_rank\":1,"
        "\"local_world_size\":1,\"first_rank\":2,\"last_rank\":2}],"
        "\"waiting\":[{\"node_id\":\"spare\",\"host\":\"h9\",\"local_world_size\":4}],"
        "\"last_failure\":{\"round\":1,\"rank\":2,\"host\":\"h1\",\"node_id\":\"n1\",\"exit_code\":0,"
        "\"signal\":9,\"time\":\"2023-11-14T22:13:20.123Z\",\"unix_ms\":1700000000123,"
        "\"age_ms\":4200,\"reason\":\"worker rank 2 on h1 failed; restart 1 of 3\"},"
        "\"in_place_recoveries\":0,\"in_place_fallbacks\":0,\"last_recovery\":null}],"
        "\"store\":{\"parked_waits\":5}}");

  CHECK(muster::status::status_table(reply) ==
        "RUN    PHASE    ROUND  RESTARTS  NODES  WORLD  IN PHASE\n"
        "job?1  running  2      1/3       1:4    3      1m01s\n"
        "  STATE    GROUP  RANKS  HOST  NODE\n"
        "  member   0      0-1    h0    n0\n"
        "  member   1      2      h1    n1\n"
        "  waiting  -      (4)    h9    spare\n"
        "  last failure: rank 2 on h1, signal 9, round 1, 4.2s ago: worker rank 2 on h1 failed; "
        "restart 1 of 3\n");
  CHECK(muster::status::status_table(v1::StatusReply()) == "no runs\n");
  CHECK(muster::status::status_json(v1::StatusReply()) == "{\"runs\":[],\"store\":{\"parked_waits\":0}}");
  v1::StatusReply built;
  built.set_server_version("0.1.0");
  built.set_server_commit("0123456789ab");
  CHECK(muster::status::status_json(built) ==
        "{\"runs\":[],\"store\":{\"parked_waits\":0},"
        "\"server\":{\"version\":\"0.1.0\",\"commit\":\"0123456789ab\"}}");
}

TEST_CASE("status format: an event as JSON has only the fields of its kind", "[status]") {
  const auto wall = std::chrono::system_clock::time_point(std::chrono::milliseconds(1700000000123));
  RunEvent e;
  e.kind = RunEvent::Kind::kRoundFormed;
  e.run_id = "job";
  e.round = 2;
  e.restart_count = 1;
  e.nodes = 2;
  e.world_size = 4;
  e.spares = 1;
  e.took = 850ms;
  e.node_id = "ignored";
  CHECK(muster::status::event_json(e, wall) ==
        "{\"event\":\"round_formed\",\"time\":\"2023-11-14T22:13:20.123Z\",\"unix_ms\":1700000000123,"
        "\"source\":\"server\",\"run\":\"job\",\"round\":2,\"restart_count\":1,\"nodes\":2,\"world_size\":4,\"spares\":1,"
        "\"took_ms\":850,\"in_place\":0}");
  e.round = 1;  // a first round: no restart to time it from
  CHECK(muster::status::event_json(e, wall).find("took_ms") == std::string::npos);

  RunEvent f;
  f.kind = RunEvent::Kind::kWorkerFailed;
  f.run_id = "job";
  f.round = 1;
  f.node_id = "n";
  f.host = "h";
  f.rank = 3;
  f.signal = 9;
  CHECK(muster::status::event_json(f, wall, 7) ==
        "{\"seq\":7,\"event\":\"worker_failed\",\"time\":\"2023-11-14T22:13:20.123Z\","
        "\"unix_ms\":1700000000123,\"source\":\"server\",\"run\":\"job\",\"round\":1,\"restart_count\":0,\"node\":\"n\","
        "\"host\":\"h\",\"rank\":3,\"signal\":9}");

  RunEvent l;
  l.kind = RunEvent::Kind::kNodeLost;
  l.run_id = "job";
  l.node_id = "n";
  l.cause = "silent";
  l.member = true;
  CHECK_THAT(muster::status::event_json(l, wall), Catch::EndsWith("\"node\":\"n\",\"cause\":\"silent\",\"member\":true}"));

  RunEvent r;
  r.kind = RunEvent::Kind::kRestart;
  r.run_id = "job";
  r.cause = "worker_failure";
  r.counts = true;
  r.reason = "why";
  CHECK_THAT(muster::status::event_json(r, wall),
             Catch::EndsWith("\"cause\":\"worker_failure\",\"counts\":true,\"reason\":\"why\"}"));
  CHECK(muster::status::iso8601_ms(std::chrono::system_clock::time_point(std::chrono::milliseconds(-1))) ==
        "1969-12-31T23:59:59.999Z");
}

namespace {

v1::AgentMsg in_place_join(const std::string& node, bool in_place) {
  v1::AgentMsg m = join_msg(node, 1, 3, 3, 2);
  m.mutable_join()->set_in_place(in_place);
  return m;
}

v1::AgentMsg resumed(int round, int abort_ms, int rendezvous_ms, int reform_ms) {
  v1::AgentMsg m;
  v1::ReportResumed* r = m.mutable_resumed();
  r->set_round(round);
  r->set_workers(2);
  r->set_abort_ms(abort_ms);
  r->set_rendezvous_ms(rendezvous_ms);
  r->set_reform_ms(reform_ms);
  return m;
}

const RunEvent* find_event(const std::vector<RunEvent>& events, RunEvent::Kind kind) {
  for (const RunEvent& e : events) {
    if (e.kind == kind) return &e;
  }
  return nullptr;
}

}  // namespace

TEST_CASE("status: an in-place recovery with its phases (noticed, formed, resumed), next to "
          "a fallback and a full restart",
          "[status][in_place]") {
  StateMachine sm(quiet());
  TimePoint now{};
  for (int s = 1; s <= 3; ++s) sm.on_message(s, in_place_join(std::string(1, 'a' + s - 1), false), now);
  REQUIRE(sm.status("run", now).at(0).round() == 1);
  CHECK_FALSE(sm.status("run", now).at(0).has_last_recovery());  // no restart yet

  // b is lost; a and c come back with their workers kept.
  now += 1s;
  sm.on_stream_closed(2, now);
  now += 12ms;
  sm.on_message(1, in_place_join("a", true), now);
  now += 8ms;
  auto formed = sm.on_message(3, in_place_join("c", true), now);
  const RunEvent* round = find_event(formed.events, RunEvent::Kind::kRoundFormed);
  REQUIRE(round != nullptr);
  CHECK(round->in_place == 2);
  CHECK(round->took == 20ms);
  v1::RunStatus st = sm.status("run", now).at(0);
  REQUIRE(st.has_last_recovery());
  CHECK(st.last_recovery().round() == 2);
  CHECK(st.last_recovery().cause() == "node_lost");
  CHECK(st.last_recovery().nodes() == 2);
  CHECK(st.last_recovery().nodes_in_place() == 2);
  CHECK(st.last_recovery().nodes_resumed() == 0);
  CHECK(st.last_recovery().formed_ms() == 20);
  CHECK(st.last_recovery().resumed_ms() == 0);
  CHECK(muster::status::recovery_mode(st.last_recovery()) == "in_place");
  CHECK(st.in_place_recoveries() == 0);

  // Each node's report: the first is one of two; a repeat and another round's are stale.
  now += 10ms;
  auto first = sm.on_message(1, resumed(2, 1, 19, 8), now);
  const RunEvent* back = find_event(first.events, RunEvent::Kind::kInPlaceResumed);
  REQUIRE(back != nullptr);
  CHECK(back->node_id == "a");
  CHECK(back->resumed == 1);
  CHECK(back->in_place == 2);
  CHECK(back->took == 30ms);
  CHECK(back->reform == 8ms);
  CHECK(sm.on_message(1, resumed(2, 1, 19, 8), now).events.empty());
  CHECK(sm.on_message(3, resumed(1, 1, 1, 1), now).events.empty());
  now += 5ms;
  auto last = sm.on_message(3, resumed(2, 3, 17, 12), now);
  back = find_event(last.events, RunEvent::Kind::kInPlaceResumed);
  REQUIRE(back != nullptr);
  CHECK(back->resumed == 2);  // the last: the run's recovery is done
  CHECK(back->in_place == 2);
  CHECK(back->took == 35ms);
  CHECK(muster::status::event_json(*back, std::chrono::system_clock::time_point()) ==
        "{\"event\":\"in_place_resumed\",\"time\":\"1970-01-01T00:00:00.000Z\",\"unix_ms\":0,"
        "\"source\":\"server\",\"run\":\"run\",\"round\":2,\"restart_count\":0,\"node\":\"c\","
        "\"host\":\"host-c\",\"resumed\":2,\"in_place\":2,\"took_ms\":35,\"abort_ms\":3,"
        "\"rendezvous_ms\":17,\"reform_ms\":12}");
  now += 2s;
  v1::StatusReply reply;
  *reply.add_runs() = sm.status("run", now).at(0);
  const v1::RecoveryStatus& rec = reply.runs(0).last_recovery();
  CHECK(rec.nodes_resumed() == 2);
  CHECK(rec.resumed_ms() == 35);
  CHECK(rec.abort_ms() == 3);   // the slowest node's
  CHECK(rec.reform_ms() == 12);
  CHECK(rec.age_ms() == 2015);
  CHECK(reply.runs(0).in_place_recoveries() == 1);
  const std::string table = muster::status::status_table(reply);
  CHECK_THAT(table, Catch::Contains("0/3 (1 in place)"));
  CHECK_THAT(table, Catch::Contains(
                        "  last recovery: round 2 after a restart (node_lost), 2.0s ago: in place "
                        "on 2 of 2 node(s); noticed -> round formed 20ms -> resumed 35ms (slowest "
                        "node: abort 3ms, re-form 12ms)\n"));
  CHECK_THAT(muster::status::status_json(reply),
             Catch::Contains("\"in_place_recoveries\":1,\"in_place_fallbacks\":0,\"last_recovery\":"
                             "{\"round\":2,\"cause\":\"node_lost\",\"mode\":\"in_place\",\"nodes\":2,"
                             "\"nodes_in_place\":2,\"nodes_resumed\":2,\"formed_ms\":20,"
                             "\"resumed_ms\":35,\"abort_ms\":3,\"reform_ms\":12,\"age_ms\":2015}"));

  // c's next recovery does not complete: its failure report says so. c then restarts in
  // full while a keeps its workers: a mixed round.
  v1::AgentMsg fell = failure(2, 5, 1, 0);
  fell.mutable_failure()->set_in_place_fallback(true);
  fell.mutable_failure()->mutable_root_cause()->set_message("in-place recovery of round 2 failed");
  auto fb = sm.on_message(3, fell, now);
  const RunEvent* fallback = find_event(fb.events, RunEvent::Kind::kInPlaceFallback);
  REQUIRE(fallback != nullptr);
  CHECK(fallback->node_id == "c");
  CHECK(fallback->reason == "in-place recovery of round 2 failed");
  CHECK(find_event(fb.events, RunEvent::Kind::kRestart) != nullptr);  // counted as ever
  sm.on_message(1, in_place_join("a", true), now);
  now += 300ms;
  sm.on_message(3, in_place_join("c", false), now);
  st = sm.status("run", now).at(0);
  CHECK(st.restart_count() == 1);
  CHECK(st.in_place_fallbacks() == 1);
  CHECK(st.last_recovery().round() == 3);
  CHECK(st.last_recovery().cause() == "worker_failure");
  CHECK(st.last_recovery().nodes_in_place() == 1);
  CHECK(muster::status::recovery_mode(st.last_recovery()) == "mixed");
  CHECK_THAT(muster::status::recovery_line(st.last_recovery()),
             Catch::EndsWith("in place on 1 of 2 node(s); noticed -> round formed 300ms -> 0 of 1 "
                             "node(s) resumed so far"));
  // A node that did not join in place has nothing to report: its report changes nothing.
  CHECK(sm.on_message(3, resumed(3, 0, 0, 0), now).events.empty());
  CHECK(sm.status("run", now).at(0).last_recovery().nodes_resumed() == 0);
  reply.clear_runs();
  *reply.add_runs() = st;
  CHECK_THAT(muster::status::status_table(reply), Catch::Contains("1/3 (1 in place, 1 fell back)"));

  // A full restart: nobody kept workers.
  sm.on_message(1, failure(3, 0, 1, 0), now);
  now += 40ms;
  sm.on_message(1, in_place_join("a", false), now);
  sm.on_message(3, in_place_join("c", false), now);
  st = sm.status("run", now).at(0);
  CHECK(st.last_recovery().round() == 4);
  CHECK(muster::status::recovery_mode(st.last_recovery()) == "full");
  CHECK_THAT(muster::status::recovery_line(st.last_recovery()),
             Catch::EndsWith("full restart, every worker new; round formed 40ms after the restart"));
  CHECK(st.in_place_recoveries() == 1);
  REQUIRE(sm.check_invariants().ok());
}

TEST_CASE("status: a resumed report with a negative time is refused with a clear error",
          "[status][in_place]") {
  StateMachine sm(quiet());
  TimePoint now{};
  sm.on_message(1, in_place_join("a", false), now);
  auto d = sm.on_message(1, resumed(1, -5, 0, 0), now);
  REQUIRE(d.messages.size() == 1);
  CHECK(d.messages[0].close);
  CHECK(d.messages[0].status.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(d.messages[0].status.message()), Catch::Contains("must be 0 or more"));
}
