// The session machine's pre-flight (agent/src/session_preflight.cc; docs/stragglers.md,
// "Pre-flight"), with a fake clock: when it runs, and what each verdict makes the node do.
#include "session_fixture.h"

namespace {

// A node with --preflight (a new machine), started and heard, in round `round` of two nodes.
Node preflight_node() {
  Node n;
  n.config.preflight = true;
  n.config.preflight_wait = 30s;
  n.m = std::make_unique<SessionMachine>(n.config);
  n.start();
  n.ready();
  return n;
}

session::PreflightVerdict named_other() {
  session::PreflightVerdict v;
  v.named_others = {"node 0 (its link moved 1.0 MB/s at best, the nodes' median is 90.0 MB/s)"};
  return v;
}

}  // namespace

TEST_CASE("pre-flight: the first round of several nodes measures before its workers start, "
          "once a run",
          "[session][preflight]") {
  Node n = preflight_node();
  n.hear(assignment(1));
  const auto* run = first<session::RunPreflight>(n.last);
  REQUIRE(run != nullptr);
  CHECK(run->assignment.round() == 1);
  CHECK_FALSE(has<session::StartWorkers>(n.last));
  CHECK(n.m->phase() == Phase::kRunning);
  // Nothing named: the workers start.
  n.go(n.m->on_preflight_done(1, {}, n.t));
  CHECK(has<session::StartWorkers>(n.last));
  n.go(n.m->on_workers_started(2, n.t));
  // A later round (a restart) starts its workers at once.
  n.restart();
  n.gone();
  n.hear(assignment(2));
  CHECK(has<session::StartWorkers>(n.last));
  CHECK_FALSE(has<session::RunPreflight>(n.last));
}

TEST_CASE("pre-flight: not for a round of one node, nor without --preflight", "[session][preflight]") {
  Node n = preflight_node();
  v1::ServerMsg alone = assignment(1);
  alone.mutable_assignment()->set_group_world_size(1);
  n.hear(alone);
  CHECK(has<session::StartWorkers>(n.last));
  CHECK_FALSE(has<session::RunPreflight>(n.last));

  Node plain;
  plain.start();
  plain.ready();
  plain.hear(assignment(1));
  CHECK(has<session::StartWorkers>(plain.last));
  CHECK_FALSE(has<session::RunPreflight>(plain.last));
}

TEST_CASE("pre-flight: a node it names leaves with one line and exit 1, its workers never "
          "started",
          "[session][preflight]") {
  Node n = preflight_node();
  n.hear(assignment(1));
  session::PreflightVerdict v;
  v.named_me = "pre-flight failed on h1: its compute scored 10, the nodes' median is 100; "
               "this node leaves the run";
  n.go(n.m->on_preflight_done(1, v, n.t));
  CHECK(logged(n.last, session::Level::kError, "pre-flight failed on h1"));
  CHECK_FALSE(has<session::StartWorkers>(n.last));
  n.gone(0);  // nothing ran
  CHECK(n.m->exiting());
  CHECK(n.m->exit_code() == 1);
  const auto* exit = first<session::Exit>(n.last);
  REQUIRE(exit != nullptr);
  CHECK(exit->code == 1);
}

TEST_CASE("pre-flight: another node named, the workers wait for the round without it, and "
          "start after the wait if it never leaves",
          "[session][preflight]") {
  Node n = preflight_node();
  n.hear(assignment(1));
  n.go(n.m->on_preflight_done(1, named_other(), n.t));
  CHECK(logged(n.last, session::Level::kWarn, "node 0 (its link moved"));
  CHECK_FALSE(has<session::StartWorkers>(n.last));
  const auto* wait = armed(n.last, session::Timer::kPreflight);
  REQUIRE(wait != nullptr);
  CHECK(wait->at == n.t + 30s);
  SECTION("it never leaves: the workers start at the end of the wait") {
    n.advance(30s);
    n.timer(session::Timer::kPreflight);
    CHECK(logged(n.last, session::Level::kWarn, "did not leave"));
    CHECK(has<session::StartWorkers>(n.last));
    n.timer(session::Timer::kPreflight);  // a timer that fires again does nothing more
    CHECK_FALSE(has<session::StartWorkers>(n.last));
  }
  SECTION("it leaves: the server's restart and the round without it; the old wait does nothing") {
    n.restart("node n0 left");
    n.gone(0);
    n.hear(assignment(2));
    CHECK(has<session::StartWorkers>(n.last));
    n.go(n.m->on_workers_started(2, n.t));
    n.advance(30s);
    n.timer(session::Timer::kPreflight);
    CHECK_FALSE(has<session::StartWorkers>(n.last));
  }
}

TEST_CASE("pre-flight: one that could not run names nobody, and a verdict for a round that is "
          "over does nothing",
          "[session][preflight]") {
  Node n = preflight_node();
  n.hear(assignment(1));
  SECTION("could not run") {
    session::PreflightVerdict v;
    v.ran = false;
    v.error = "the store did not answer";
    n.go(n.m->on_preflight_done(1, v, n.t));
    CHECK(logged(n.last, session::Level::kWarn, "could not run (the store did not answer)"));
    CHECK(has<session::StartWorkers>(n.last));
  }
  SECTION("a stale verdict") {
    n.go(n.m->on_preflight_done(7, named_other(), n.t));  // another round's
    CHECK(n.last.empty());
    n.restart();
    n.go(n.m->on_preflight_done(1, {}, n.t));  // the round ended meanwhile
    CHECK_FALSE(has<session::StartWorkers>(n.last));
  }
}
