// The state machine's event feed (events.h), driven with a fake clock.
#include <catch2/catch.hpp>
#include <string>
#include <utility>
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

// A machine and what its decisions said, as the server's event sinks hear it.
struct Feed {
  StateMachine sm;
  std::vector<RunEvent> heard;

  explicit Feed(muster::rendezvous::RendezvousTimeouts t = {}) : sm(t) {}
  void message(muster::rendezvous::SessionId s, const v1::AgentMsg& m, TimePoint now) {
    hear(sm.on_message(s, m, now));
  }
  void tick(TimePoint now) { hear(sm.on_tick(now)); }
  void closed(muster::rendezvous::SessionId s, TimePoint now) {
    hear(sm.on_stream_closed(s, now));
  }
  void hear(muster::rendezvous::Decision d) {
    for (RunEvent& e : d.events) heard.push_back(std::move(e));
  }
  std::vector<RunEvent> take() { return std::exchange(heard, {}); }
};

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
  Feed sm(t);
  TimePoint now{};
  sm.message(1, join_msg("a", 2, 2, 1), now);
  sm.message(2, join_msg("b", 2, 2, 1), now);
  auto ev = sm.take();
  REQUIRE(names(ev) == std::vector<std::string>{"node_joined", "node_joined", "round_formed"});
  CHECK(ev[0].node_id == "a");
  CHECK(ev[1].host == "host-b");
  CHECK(ev[2].round == 1);
  CHECK(ev[2].nodes == 2);
  CHECK(ev[2].world_size == 4);
  CHECK(ev[2].took == 0ms);  // a first round: no restart to recover from
  CHECK(sm.take().empty());  // drained

  // A worker failure: worker_failed, then a restart that counts.
  now += 100ms;
  // One decision carries what it made happen: the Restarts to send and both events.
  muster::rendezvous::Decision failed = sm.sm.on_message(2, failure(1), now);
  CHECK(failed.messages.size() == 2);
  ev = failed.events;
  REQUIRE(names(ev) == std::vector<std::string>{"worker_failed", "restart"});
  CHECK(ev[0].rank == 3);
  CHECK(ev[0].signal == 9);
  CHECK(ev[0].node_id == "b");
  CHECK(ev[1].cause == "worker_failure");
  CHECK(ev[1].counts);
  CHECK(ev[1].restart_count == 1);
  // The survivors come back 250 ms later: the new round says how long recovery took.
  now += 250ms;
  sm.message(1, join_msg("a", 2, 2, 1), now);
  sm.message(2, join_msg("b", 2, 2, 1), now);
  ev = sm.take();
  REQUIRE(names(ev) == std::vector<std::string>{"round_formed"});  // rejoins are not newcomers
  CHECK(ev[0].round == 2);
  CHECK(ev[0].took == 250ms);

  // b goes silent: lost after the liveness window (2 s), a restart that does not count.
  v1::AgentMsg ka;
  ka.mutable_keep_alive();
  for (int i = 0; i < 6; ++i) {
    now += 500ms;
    sm.message(1, ka, now);
    sm.tick(now);
  }
  ev = sm.take();
  REQUIRE(names(ev) == std::vector<std::string>{"node_lost", "restart"});
  CHECK(ev[0].node_id == "b");
  CHECK(ev[0].cause == "silent");
  CHECK(ev[0].member);  // it was a member
  CHECK(ev[1].cause == "node_lost");
  CHECK_FALSE(ev[1].counts);

  // a's stream ends: the run had no one else, so it goes; its node is lost, not failed.
  sm.closed(1, now);
  ev = sm.take();
  REQUIRE(names(ev) == std::vector<std::string>{"node_lost"});
  CHECK(ev[0].cause == "stream_closed");
  CHECK_FALSE(ev[0].member);  // waiting, not a member
}

TEST_CASE("events: a spent budget fails the run, success finishes it", "[rdzv][events]") {
  Feed sm;
  TimePoint now{};
  sm.message(1, join_msg("a", 1, 1, 0), now);
  sm.take();
  sm.message(1, failure(1), now);
  auto ev = sm.take();
  REQUIRE(names(ev) == std::vector<std::string>{"worker_failed", "failed"});
  CHECK(ev[1].cause == "budget_spent");
  CHECK(ev[1].reason == "a worker failed and max_restarts is 0");

  Feed ok;
  ok.message(1, join_msg("a", 1, 1, 0), now);
  v1::AgentMsg done;
  done.mutable_success()->set_round(1);
  ok.message(1, done, now);
  CHECK(names(ok.take()) ==
        std::vector<std::string>{"node_joined", "round_formed", "succeeded"});
}

TEST_CASE("events: a join timeout fails the run, a newcomer scales up", "[rdzv][events]") {
  muster::rendezvous::RendezvousTimeouts t;
  t.join_timeout = 1s;
  t.keep_alive_interval = std::chrono::hours(1);
  Feed sm(t);
  TimePoint now{};
  sm.message(1, join_msg("a", 2, 3, 0), now);
  now += 2s;
  sm.tick(now);
  auto ev = sm.take();
  REQUIRE(names(ev) == std::vector<std::string>{"node_joined", "failed"});
  CHECK(ev[1].cause == "join_timeout");

  t.last_call_timeout = 0ms;
  Feed up(t);
  up.message(1, join_msg("a", 1, 2, 0), now);
  now += 1ms;  // the last call's floor
  up.tick(now);
  CHECK(names(up.take()) == std::vector<std::string>{"node_joined", "round_formed"});
  up.message(2, join_msg("b", 1, 2, 0), now);
  ev = up.take();
  REQUIRE(names(ev).size() >= 2);
  CHECK(names(ev)[0] == "node_joined");
  CHECK(ev[1].kind == Kind::kRestart);
  CHECK(ev[1].cause == "node_joined");
}
