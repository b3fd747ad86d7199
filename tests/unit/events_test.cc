// The state machine's event feed (events.h), driven with a fake clock.
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "join_msg.h"
#include "muster/rendezvous/state_machine.h"

using namespace std::chrono_literals;
using muster::rendezvous::RunEvent;
using muster::rendezvous::StateMachine;
using muster::rendezvous::TimePoint;
using Kind = RunEvent::Kind;
namespace v1 = muster::v1;
using muster::testing::join_msg;

namespace {


v1::AgentMsg failure(int round) {
  v1::AgentMsg m;
  m.mutable_failure()->set_round(round);
  m.mutable_failure()->mutable_root_cause()->set_rank(3);
  m.mutable_failure()->mutable_root_cause()->set_host("host-b");
  m.mutable_failure()->mutable_root_cause()->set_signal(9);
  return m;
}

std::vector<std::string> names(const std::vector<RunEvent>& events) {
  std::vector<std::string> out;
  for (const auto& e : events) out.emplace_back(muster::rendezvous::event_name(e.kind));
  return out;
}

}  // namespace

TEST_CASE("events: a run's life, in order, with what each decision carried", "[rdzv][events]") {
  muster::rendezvous::RendezvousTimeouts t;
  t.keep_alive_interval = 500ms;
  t.keep_alive_max_attempt = 4;
  StateMachine sm(t);
  TimePoint now{};
  sm.on_message(1, join_msg("a", 2, 2, 1), now);
  sm.on_message(2, join_msg("b", 2, 2, 1), now);
  auto ev = sm.take_events();
  REQUIRE(names(ev) == std::vector<std::string>{"node_joined", "node_joined", "round_formed"});
  CHECK(ev[0].node_id == "a");
  CHECK(ev[1].host == "host-b");
  CHECK(ev[2].round == 1);
  CHECK(ev[2].nodes == 2);
  CHECK(ev[2].world_size == 4);
  CHECK(ev[2].took == 0ms);  // a first round: no restart to recover from
  CHECK(sm.take_events().empty());  // drained

  // A worker failure: worker_failed, then a restart that counts.
  now += 100ms;
  sm.on_message(2, failure(1), now);
  ev = sm.take_events();
  REQUIRE(names(ev) == std::vector<std::string>{"worker_failed", "restart"});
  CHECK(ev[0].rank == 3);
  CHECK(ev[0].signal == 9);
  CHECK(ev[0].node_id == "b");
  CHECK(ev[1].cause == "worker_failure");
  CHECK(ev[1].counts);
  CHECK(ev[1].restart_count == 1);
  // The survivors come back 250 ms later: the new round says how long recovery took.
  now += 250ms;
  sm.on_message(1, join_msg("a", 2, 2, 1), now);
  sm.on_message(2, join_msg("b", 2, 2, 1), now);
  ev = sm.take_events();
  REQUIRE(names(ev) == std::vector<std::string>{"round_formed"});  // rejoins are not newcomers
  CHECK(ev[0].round == 2);
  CHECK(ev[0].took == 250ms);

  // b goes silent: lost after the liveness window (2 s), a restart that does not count.
  v1::AgentMsg ka;
  ka.mutable_keep_alive();
  for (int i = 0; i < 6; ++i) {
    now += 500ms;
    sm.on_message(1, ka, now);
    sm.on_tick(now);
  }
  ev = sm.take_events();
  REQUIRE(names(ev) == std::vector<std::string>{"node_lost", "restart"});
  CHECK(ev[0].node_id == "b");
  CHECK(ev[0].cause == "silent");
  CHECK(ev[0].nodes == 1);  // it was a member
  CHECK(ev[1].cause == "node_lost");
  CHECK_FALSE(ev[1].counts);

  // a's stream ends: the run had no one else, so it goes; its node is lost, not failed.
  sm.on_stream_closed(1, now);
  ev = sm.take_events();
  REQUIRE(names(ev) == std::vector<std::string>{"node_lost"});
  CHECK(ev[0].cause == "stream_closed");
  CHECK(ev[0].nodes == 0);  // waiting, not a member
}

TEST_CASE("events: a spent budget fails the run, success finishes it", "[rdzv][events]") {
  StateMachine sm;
  TimePoint now{};
  sm.on_message(1, join_msg("a", 1, 1, 0), now);
  sm.take_events();
  sm.on_message(1, failure(1), now);
  auto ev = sm.take_events();
  REQUIRE(names(ev) == std::vector<std::string>{"worker_failed", "failed"});
  CHECK(ev[1].cause == "budget_spent");
  CHECK(ev[1].reason == "a worker failed and max_restarts is 0");

  StateMachine ok;
  ok.on_message(1, join_msg("a", 1, 1, 0), now);
  v1::AgentMsg done;
  done.mutable_success()->set_round(1);
  ok.on_message(1, done, now);
  CHECK(names(ok.take_events()) ==
        std::vector<std::string>{"node_joined", "round_formed", "succeeded"});
}

TEST_CASE("events: a join timeout fails the run, a newcomer scales up", "[rdzv][events]") {
  muster::rendezvous::RendezvousTimeouts t;
  t.join_timeout = 1s;
  t.keep_alive_interval = std::chrono::hours(1);
  StateMachine sm(t);
  TimePoint now{};
  sm.on_message(1, join_msg("a", 2, 3, 0), now);
  now += 2s;
  sm.on_tick(now);
  auto ev = sm.take_events();
  REQUIRE(names(ev) == std::vector<std::string>{"node_joined", "failed"});
  CHECK(ev[1].cause == "join_timeout");

  t.last_call_timeout = 0ms;
  StateMachine up(t);
  up.on_message(1, join_msg("a", 1, 2, 0), now);
  now += 1ms;  // the last call's floor
  up.on_tick(now);
  CHECK(names(up.take_events()) == std::vector<std::string>{"node_joined", "round_formed"});
  up.on_message(2, join_msg("b", 1, 2, 0), now);
  ev = up.take_events();
  REQUIRE(names(ev).size() >= 2);
  CHECK(names(ev)[0] == "node_joined");
  CHECK(ev[1].kind == Kind::kRestart);
  CHECK(ev[1].cause == "node_joined");
}
