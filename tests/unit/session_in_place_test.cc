// In-place recovery in the agent's session rules (agent/session_machine.h, "In-place
// recovery"; session_in_place.cc), with a fake clock: the survivors are aborted, never
// stopped; the node rejoins at once; the new world goes to them and only the dead are
// replaced; a round that does not report resumed in time falls back to the full restart.
#include <catch2/catch.hpp>

#include <map>
#include <random>
#include <set>

#include "session_fixture.h"

namespace {

// In round `round` (its workers running, both declared in-place support).
void declared_running(Node& n, int round = 1) {
  n.running(round);
  n.go(n.m->on_worker_declared(0, n.t));
  n.go(n.m->on_worker_declared(1, n.t));
}

Actions& fail_worker(Node& n, int local_rank) {
  v1::WorkerFailure f = failure(2 + local_rank, 3);
  f.set_local_rank(local_rank);
  return n.go(n.m->on_worker_failed(f, n.t));
}

}  // namespace

TEST_CASE("in place: without --in_place a declared worker's failure stops the group as before") {
  Node n;
  declared_running(n);
  Actions& a = fail_worker(n, 1);
  CHECK(has<session::StopWorkers>(a));
  CHECK_FALSE(has<session::AbortWorkers>(a));
  CHECK(n.m->phase() == Phase::kStopping);
}

TEST_CASE("in place: workers that never declared support get the full restart") {
  Node n;
  n.in_place();
  n.running();
  n.go(n.m->on_worker_declared(0, n.t));  // local rank 1 never says it
  Actions& a = fail_worker(n, 0);
  CHECK(has<session::StopWorkers>(a));
  CHECK_FALSE(has<session::AbortWorkers>(a));
  n.restart();
  CHECK_FALSE(has<session::AbortWorkers>(n.last));
  CHECK(n.m->phase() == Phase::kStopping);
}

TEST_CASE("in place: a failed worker is reported, the survivor aborted, nothing stopped, and the "
          "next round re-forms it and replaces only the dead one") {
  Node n;
  n.in_place();
  declared_running(n);
  Actions& a = fail_worker(n, 1);
  REQUIRE(sent(a, v1::AgentMsg::kFailure) != nullptr);
  CHECK_FALSE(sent(a, v1::AgentMsg::kFailure)->msg.failure().in_place_fallback());
  REQUIRE(has<session::AbortWorkers>(a));
  CHECK_FALSE(has<session::StopWorkers>(a));
  CHECK(n.m->phase() == Phase::kRecovering);

  n.advance(3ms);
  Actions& r = n.restart("worker rank 3 failed");
  CHECK(has<session::AbortWorkers>(r));
  CHECK_FALSE(has<session::StopWorkers>(r));
  const auto* join = sent(r, v1::AgentMsg::kJoin);
  REQUIRE(join != nullptr);
  CHECK(join->msg.join().reattach_round() == 0);
  CHECK(join->msg.join().in_place());  // the server counts this node as in place
  CHECK(n.m->phase() == Phase::kReforming);
  CHECK(logged(r, session::Level::kWarn, "recovering in place: worker rank 3 failed"));

  n.advance(2ms);
  Actions& f = n.hear(assignment(2, 0, 1));
  const auto* reform = first<session::ReformWorkers>(f);
  REQUIRE(reform != nullptr);
  CHECK(reform->assignment.round() == 2);
  CHECK_FALSE(has<session::StartWorkers>(f));
  const auto* due = armed(f, session::Timer::kInPlace);
  REQUIRE(due != nullptr);
  CHECK(due->at == n.t + 2s);
  CHECK(n.m->phase() == Phase::kRunning);
  CHECK(emitted(f, AgentEvent::Kind::kRoundFormed) != nullptr);

  n.advance(20ms);
  CHECK(n.go(n.m->on_worker_resumed(0, 2, n.t)).empty());  // one of two
  n.advance(5ms);
  Actions& done = n.go(n.m->on_worker_resumed(1, 2, n.t));
  const auto* e = emitted(done, AgentEvent::Kind::kInPlaceResumed);
  REQUIRE(e != nullptr);
  REQUIRE(e->event.recovery);
  const auto& rec = *e->event.recovery;
  CHECK(rec.in_place);
  CHECK(rec.cause == "worker_failure");
  CHECK(rec.stopped - rec.noticed == 0ms);    // aborted at once
  CHECK(rec.formed - rec.stopped == 5ms);     // restart 3 ms + assignment 2 ms
  CHECK(rec.started - rec.formed == 25ms);    // every worker resumed
  // The server hears of it, with the same phases (its status and live page show them).
  const auto* back = sent(done, v1::AgentMsg::kResumed);
  REQUIRE(back != nullptr);
  CHECK(back->msg.resumed().round() == 2);
  CHECK(back->msg.resumed().workers() == 2);
  CHECK(back->msg.resumed().abort_ms() == 0);
  CHECK(back->msg.resumed().rendezvous_ms() == 5);
  CHECK(back->msg.resumed().reform_ms() == 25);
  bool cancelled = false;
  for (const auto* c : all<session::CancelTimer>(done)) cancelled |= c->timer == session::Timer::kInPlace;
  CHECK(cancelled);
  // The timer, had it fired anyway, does nothing now.
  CHECK_FALSE(has<session::StopWorkers>(n.timer(session::Timer::kInPlace)));
  CHECK(sent(n.go(n.m->on_worker_resumed(1, 2, n.t)), v1::AgentMsg::kResumed) == nullptr);  // once
}

TEST_CASE("in place: another node's loss (the server's Restart) keeps every worker running") {
  Node n;
  n.in_place();
  declared_running(n);
  Actions& r = n.restart("node n2 left the run");
  CHECK(has<session::AbortWorkers>(r));
  CHECK_FALSE(has<session::StopWorkers>(r));
  CHECK(n.m->phase() == Phase::kReforming);
  // Nothing is dead: the re-formed round replaces nobody, and every worker must resume.
  n.hear(assignment(2, 0, 0));
  REQUIRE(has<session::ReformWorkers>(n.last));
  n.go(n.m->on_worker_resumed(0, 2, n.t));
  n.go(n.m->on_worker_resumed(1, 2, n.t));
  const auto* e = emitted(n.last, AgentEvent::Kind::kInPlaceResumed);
  REQUIRE(e != nullptr);
  CHECK(e->event.recovery->cause == "restart");
}

TEST_CASE("in place: a late answer for the round before the re-form is ignored, the "
          "recovery completes with this round's answers") {
  Node n;
  n.in_place();
  declared_running(n);
  n.restart();
  n.hear(assignment(2));
  // Local rank 0 finished its first step of round 1 as round 2's abort was on its way.
  CHECK(n.go(n.m->on_worker_resumed(0, 1, n.t)).empty());
  n.go(n.m->on_worker_resumed(0, 2, n.t));
  Actions& done = n.go(n.m->on_worker_resumed(1, 2, n.t));
  CHECK(emitted(done, AgentEvent::Kind::kInPlaceResumed) != nullptr);
  CHECK(emitted(done, AgentEvent::Kind::kInPlaceFallback) == nullptr);
  CHECK(sent(done, v1::AgentMsg::kResumed) != nullptr);
}

TEST_CASE("in place: a worker that answers for a round the node was not given makes the node "
          "fall back") {
  Node n;
  n.in_place();
  declared_running(n);
  n.restart();
  n.hear(assignment(2));
  Actions& a = n.go(n.m->on_worker_resumed(0, 3, n.t));
  const auto* e = emitted(a, AgentEvent::Kind::kInPlaceFallback);
  REQUIRE(e != nullptr);
  CHECK_THAT(e->event.reason, Catch::Contains("reported resumed for round 3, not round 2"));
  const auto* rep = sent(a, v1::AgentMsg::kFailure);
  REQUIRE(rep != nullptr);
  CHECK(rep->msg.failure().round() == 2);
  CHECK_THAT(rep->msg.failure().root_cause().message(), Catch::Contains("falling back to a full restart"));
  CHECK(rep->msg.failure().in_place_fallback());  // the server counts the fallback
  CHECK(sent(a, v1::AgentMsg::kResumed) == nullptr);
  CHECK(has<session::StopWorkers>(a));
  // The restart that follows is the full one: the workers stop, the node rejoins after.
  n.gone();
  Actions& r = n.restart();
  CHECK_FALSE(has<session::AbortWorkers>(r));
  n.gone();
  REQUIRE(sent(n.last, v1::AgentMsg::kJoin) != nullptr);
  CHECK_FALSE(sent(n.last, v1::AgentMsg::kJoin)->msg.join().in_place());
  n.hear(assignment(3));
  CHECK(has<session::StartWorkers>(n.last));  // new processes, in-place allowed again
}

TEST_CASE("in place: no resumed within the timeout falls back and names who is missing") {
  Node n;
  n.in_place(1500ms);
  declared_running(n);
  fail_worker(n, 0);
  n.restart();
  n.hear(assignment(2));
  n.go(n.m->on_worker_resumed(1, 2, n.t));
  n.advance(1500ms);
  Actions& a = n.timer(session::Timer::kInPlace);
  CHECK(logged(a, session::Level::kWarn, "local rank(s) 0 did not report resumed within 1.5 s"));
  CHECK(emitted(a, AgentEvent::Kind::kInPlaceFallback) != nullptr);
  CHECK(has<session::StopWorkers>(a));
  CHECK(sent(a, v1::AgentMsg::kFailure) != nullptr);
}

TEST_CASE("in place: a failure during the re-form starts the recovery over") {
  Node n;
  n.in_place();
  declared_running(n);
  fail_worker(n, 1);
  n.restart();
  n.hear(assignment(2));
  n.go(n.m->on_worker_declared(1, n.t));  // the replacement declares
  Actions& a = fail_worker(n, 0);         // a survivor dies before resuming
  CHECK(has<session::AbortWorkers>(a));
  CHECK_FALSE(has<session::StopWorkers>(a));
  const auto* rep = sent(a, v1::AgentMsg::kFailure);
  REQUIRE(rep != nullptr);
  CHECK(rep->msg.failure().round() == 2);
  CHECK(n.m->phase() == Phase::kRecovering);
  // The old wait is over; the next round's is armed afresh.
  n.advance(5s);
  CHECK_FALSE(has<session::StopWorkers>(n.timer(session::Timer::kInPlace)));
  n.restart();
  n.hear(assignment(3));
  CHECK(has<session::ReformWorkers>(n.last));
}

TEST_CASE("in place: a replacement still starting counts as ready: a second failure recovers in "
          "place and replaces it too") {
  Node n;
  n.in_place();
  declared_running(n);
  fail_worker(n, 1);
  n.restart();
  n.hear(assignment(2));
  const auto* reform = first<session::ReformWorkers>(n.last);
  REQUIRE(reform != nullptr);
  CHECK(reform->replace.empty());  // rank 1 is dead: a new process, not a replacement of a live one
  // Local rank 1's new process is still importing (no hello yet) when local rank 0 dies.
  Actions& a = fail_worker(n, 0);
  CHECK(has<session::AbortWorkers>(a));
  CHECK_FALSE(has<session::StopWorkers>(a));
  n.restart();
  n.hear(assignment(3));
  const auto* again = first<session::ReformWorkers>(n.last);
  REQUIRE(again != nullptr);
  CHECK(again->replace == std::vector<int>{1});  // started again in round 3's world
  // Both are new processes now: each must declare before the next recovery counts on it,
  // and both must resume.
  n.go(n.m->on_worker_declared(0, n.t));
  n.go(n.m->on_worker_resumed(0, 3, n.t));
  CHECK(emitted(n.last, AgentEvent::Kind::kInPlaceResumed) == nullptr);
  n.go(n.m->on_worker_resumed(1, 3, n.t));
  CHECK(emitted(n.last, AgentEvent::Kind::kInPlaceResumed) != nullptr);
}

TEST_CASE("in place: a program whose workers never declared is not helped by the rule for "
          "starting replacements") {
  Node n;
  n.in_place();
  n.running(1);  // nobody declared: not in place
  Actions& a = fail_worker(n, 1);
  CHECK(has<session::StopWorkers>(a));
  CHECK_FALSE(has<session::AbortWorkers>(a));
}

TEST_CASE("in place: a worker lost while re-forming is one more to replace, not a report") {
  Node n;
  n.in_place();
  declared_running(n);
  n.restart();
  REQUIRE(n.m->phase() == Phase::kReforming);
  Actions& a = fail_worker(n, 1);
  CHECK(sent(a, v1::AgentMsg::kFailure) == nullptr);  // round 1 is over already
  CHECK_FALSE(has<session::StopWorkers>(a));
  CHECK(emitted(a, AgentEvent::Kind::kWorkerFailed) != nullptr);
  CHECK(n.m->phase() == Phase::kReforming);
  n.gone(0);  // with both gone the group is empty; the node still waits for its round
  CHECK(n.m->phase() == Phase::kReforming);
  n.hear(assignment(2));
  CHECK(has<session::ReformWorkers>(n.last));
}

TEST_CASE("in place: a signal or the server's Fail while re-forming stops the workers") {
  Node n;
  n.in_place();
  declared_running(n);
  n.restart();
  Actions& a = n.signal(SIGTERM);
  CHECK(has<session::StopWorkers>(a));
  n.gone();
  CHECK(n.m->exiting());
  CHECK(n.m->exit_code() == 128 + SIGTERM);

  Node f;
  f.in_place();
  declared_running(f);
  fail_worker(f, 0);
  v1::ServerMsg fail;
  fail.mutable_fail()->set_reason("budget spent");
  CHECK(has<session::StopWorkers>(f.hear(fail)));
  f.gone();
  CHECK(f.m->failed());
}

// Random failures, restarts, rounds, answers and timers: whatever the order, a round's workers
// are started or re-formed once, a re-form always follows an abort of the round before, a node
// reports at most one failure per round, and every in-place recovery ends once (resumed or
// fallen back).
TEST_CASE("in place: property: one world per round, an abort before every re-form, one report "
          "per round") {
  int reforms = 0, fallbacks = 0, resumes = 0;  // the sequences do reach every branch
  for (std::uint32_t seed = 1; seed <= 300; ++seed) {
    std::mt19937 rng(seed);
    Node n;
    n.in_place(1s);
    declared_running(n);
    int round = 1;
    std::map<int, int> worlds, reports;
    worlds[1] = 1;
    bool aborted = false;
    int recoveries = 0, ended = 0;
    for (int step = 0; step < 60 && !n.m->exiting(); ++step) {
      n.advance(std::chrono::milliseconds(rng() % 400));
      const int lr = static_cast<int>(rng() % 2);
      switch (rng() % 8) {
        case 0: fail_worker(n, lr); break;
        case 1: n.restart(); break;
        case 2: n.hear(assignment(round + 1)); break;
        case 3: {
          // Mostly for the round at hand, sometimes for a wrong one; often both ranks.
          const int which = round + (rng() % 5 == 0);
          Actions both = n.m->on_worker_resumed(lr, which, n.t);
          if (rng() % 2 == 0) {
            for (auto& x : n.m->on_worker_resumed(1 - lr, which, n.t)) both.push_back(std::move(x));
          }
          n.go(std::move(both));
          break;
        }
        case 4: n.go(n.m->on_worker_declared(lr, n.t)); break;
        case 5: n.timer(session::Timer::kInPlace); break;
        case 6: n.gone(); break;
        default: n.keep_alive_answer(); break;
      }
      const Actions& a = n.last;
      if (has<session::AbortWorkers>(a)) {
        if (!aborted) ++recoveries;
        aborted = true;
      }
      for (const auto* r : all<session::ReformWorkers>(a)) {
        INFO("seed " << seed << " step " << step);
        CHECK(aborted);
        CHECK(++worlds[r->assignment.round()] == 1);
        round = r->assignment.round();
        aborted = false;
        ++reforms;
      }
      for (const auto* s : all<session::StartWorkers>(a)) {
        INFO("seed " << seed << " step " << step);
        CHECK(++worlds[s->assignment.round()] == 1);
        round = s->assignment.round();
        aborted = false;
      }
      for (const auto* s : all<session::Send>(a)) {
        if (!s->msg.has_failure()) continue;
        INFO("seed " << seed << " step " << step);
        CHECK(++reports[s->msg.failure().round()] == 1);
      }
      resumes += emitted(a, AgentEvent::Kind::kInPlaceResumed) != nullptr;
      fallbacks += emitted(a, AgentEvent::Kind::kInPlaceFallback) != nullptr;
      ended += emitted(a, AgentEvent::Kind::kInPlaceResumed) != nullptr;
      ended += emitted(a, AgentEvent::Kind::kInPlaceFallback) != nullptr;
      const Phase p = n.m->phase();
      if (p == Phase::kRecovering || p == Phase::kReforming) {
        INFO("seed " << seed << " step " << step);
        CHECK(aborted);
      }
    }
    CHECK(ended <= recoveries);
  }
  CHECK(reforms > 100);
  CHECK(resumes > 10);
  CHECK(fallbacks > 5);
}

// Exclusion (docs/stragglers.md, "Exclusion"): a Restart with excluded_ms is not an in-place
// recovery for this node: its workers stop, it waits out the cool-down connected (its
// keep-alives go on) and running nothing, then joins again; a run that finishes meanwhile
// ends it with exit 0.
TEST_CASE("in place: a node excluded as a straggler stops its workers, waits out its "
          "cool-down, then joins again") {
  Node n;
  n.in_place();
  declared_running(n);
  v1::ServerMsg x;
  x.mutable_restart()->set_reason("node n1 excluded as a straggler: rank 2 ...");
  x.mutable_restart()->set_excluded_ms(30'000);
  Actions& a = n.hear(x);
  CHECK(logged(a, session::Level::kWarn, "excluded as a straggler"));
  REQUIRE(has<session::StopWorkers>(a));  // not AbortWorkers: this node's workers leave
  CHECK_FALSE(has<session::AbortWorkers>(a));
  CHECK(sent(a, v1::AgentMsg::kJoin) == nullptr);
  n.advance(100ms);
  Actions& b = n.gone();
  CHECK(has<session::ReleaseWorkers>(b));
  CHECK(sent(b, v1::AgentMsg::kJoin) == nullptr);
  REQUIRE(has<session::ArmTimer>(b));
  const auto* armed = first<session::ArmTimer>(b);
  CHECK(armed->timer == session::Timer::kCooldown);
  CHECK(armed->at == n.t + 30s);
  CHECK(n.m->cooling());
  CHECK(n.m->phase() == Phase::kJoining);
  // Still connected meanwhile: its keep-alives go out.
  CHECK(sent(n.timer(session::Timer::kKeepAlive), v1::AgentMsg::kKeepAlive) != nullptr);
  n.advance(30s);
  Actions& c = n.timer(session::Timer::kCooldown);
  REQUIRE(sent(c, v1::AgentMsg::kJoin) != nullptr);
  CHECK_FALSE(sent(c, v1::AgentMsg::kJoin)->msg.join().in_place());  // a newcomer: new workers
  CHECK_FALSE(n.m->cooling());
  // A round then starts its workers afresh.
  n.hear(assignment(3));
  CHECK(has<session::StartWorkers>(n.last));
}

TEST_CASE("in place: a run that finishes while this node is excluded ends it with exit 0") {
  Node n;
  n.in_place();
  declared_running(n);
  v1::ServerMsg x;
  x.mutable_restart()->set_reason("excluded");
  x.mutable_restart()->set_excluded_ms(30'000);
  n.hear(x);
  n.gone();
  REQUIRE(n.m->cooling());
  Actions& d = n.done();
  REQUIRE(has<session::Exit>(d));
  CHECK(first<session::Exit>(d)->code == 0);
}
