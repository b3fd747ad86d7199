// The agent's session rules (agent/session_machine.h) with a fake clock: every transition,
// including the branches the integration tests reach only with real servers and processes
// (reconnect, re-attach, lost server, rejoin deadline, the first wait over several
// endpoints, shutdown by signal).
#include <catch2/catch.hpp>
#include <csignal>

#include "muster/agent/session_machine.h"
#include "session_fixture.h"


TEST_CASE("session: start opens a stream, sends the Join and arms the keep-alive") {
  Node n;
  Actions& a = n.start();
  const auto* open = first<session::OpenStream>(a);
  REQUIRE(open != nullptr);
  CHECK(open->endpoint.target == "ipv4:10.0.0.1:29400");
  CHECK_FALSE(open->wait_for_ready);
  CHECK(open->connect_timeout == 60s);  // one endpoint: the whole wait
  const auto* join = sent(a, v1::AgentMsg::kJoin);
  REQUIRE(join != nullptr);
  CHECK(join->msg.join().node_id() == "n1");
  CHECK(join->msg.join().reattach_round() == 0);
  const auto* ka = armed(a, session::Timer::kKeepAlive);
  REQUIRE(ka != nullptr);
  CHECK(ka->at == n.t + 100ms);  // a fifth of the 500 ms interval
  CHECK(n.m->phase() == Phase::kJoining);
}

TEST_CASE("session: waiting for the server says so and waits on the stream") {
  Node n(1, true);
  Actions& a = n.start();
  CHECK(logged(a, session::Level::kInfo, "waiting for the rendezvous server at node1:29400"));
  REQUIRE(first<session::OpenStream>(a) != nullptr);
  CHECK(first<session::OpenStream>(a)->wait_for_ready);
}

TEST_CASE("session: keep-alives go out five times an interval until the agent exits") {
  Node n;
  n.start();
  n.advance(100ms);
  Actions& a = n.timer(session::Timer::kKeepAlive);
  CHECK(sent(a, v1::AgentMsg::kKeepAlive) != nullptr);
  REQUIRE(armed(a, session::Timer::kKeepAlive) != nullptr);
  CHECK(armed(a, session::Timer::kKeepAlive)->at == n.t + 100ms);
  n.signal(SIGTERM);  // in Joining: nothing to stop, it exits at once
  REQUIRE(n.m->exiting());
  CHECK(n.timer(session::Timer::kKeepAlive).empty());
}

TEST_CASE("session: a big round's nodes send fewer keep-alives, down to one an interval") {
  using muster::agent::keep_alives_per_interval;
  // 10,000 a second for the whole run at most: 5 x 1,000 nodes / 0.5 s.
  CHECK(keep_alives_per_interval(500ms, 0) == 5);  // before any round
  CHECK(keep_alives_per_interval(500ms, 2) == 5);
  CHECK(keep_alives_per_interval(500ms, 1000) == 5);
  CHECK(keep_alives_per_interval(500ms, 1001) == 4);
  CHECK(keep_alives_per_interval(500ms, 2500) == 2);
  CHECK(keep_alives_per_interval(500ms, 5000) == 1);
  CHECK(keep_alives_per_interval(500ms, 100000) == 1);  // never none
  CHECK(keep_alives_per_interval(5s, 10000) == 5);       // a longer interval has room
  // In a machine: the Assignment's group_world_size sets the rate from the next keep-alive on.
  Node n;
  n.start();
  n.ready();
  v1::ServerMsg big = assignment(1);
  big.mutable_assignment()->set_group_world_size(2500);
  n.hear(big);
  n.go(n.m->on_workers_started(2, n.t));
  n.advance(100ms);  // the one armed before the round, at the old rate
  Actions& a = n.timer(session::Timer::kKeepAlive);
  CHECK(sent(a, v1::AgentMsg::kKeepAlive) != nullptr);
  REQUIRE(armed(a, session::Timer::kKeepAlive) != nullptr);
  CHECK(armed(a, session::Timer::kKeepAlive)->at == n.t + 250ms);
}

TEST_CASE("session: the silence timer is armed once and follows the last word heard") {
  Node n;
  n.start();
  Actions& a = n.ready();
  REQUIRE(armed(a, session::Timer::kSilence) != nullptr);
  const auto due = armed(a, session::Timer::kSilence)->at;
  CHECK(due == n.t + 2s);
  n.advance(1s);
  CHECK(armed(n.keep_alive_answer(), session::Timer::kSilence) == nullptr);  // already armed
  n.advance(1s);  // the first deadline: heard 1 s ago, so wait for the new end of the window
  Actions& b = n.timer(session::Timer::kSilence);
  REQUIRE(armed(b, session::Timer::kSilence) != nullptr);
  CHECK(armed(b, session::Timer::kSilence)->at == n.t + 1s);
  CHECK_FALSE(has<session::CloseStream>(b));
}

TEST_CASE("session: silence is the whole window, not a millisecond less") {
  Node n;
  n.running();
  n.advance(2s - 1ms);
  Actions& early = n.timer(session::Timer::kSilence);  // a probe, but no verdict yet
  CHECK(has<session::OpenProbe>(early));
  CHECK_FALSE(has<session::CloseStream>(early));
  REQUIRE(armed(early, session::Timer::kSilence) != nullptr);
  CHECK(armed(early, session::Timer::kSilence)->at == n.t + 1ms);
  n.advance(1ms);
  CHECK(has<session::CloseStream>(n.timer(session::Timer::kSilence)));
}

TEST_CASE("session: a round starts the workers, another Assignment meanwhile is ignored") {
  Node n;
  n.start();
  n.ready();
  Actions& a = n.hear(assignment(1));
  const auto* formed = emitted(a, AgentEvent::Kind::kRoundFormed);
  REQUIRE(formed != nullptr);
  CHECK(formed->event.round == 1);
  CHECK(formed->event.group_rank == 1);
  CHECK(formed->event.world_size == 4);
  REQUIRE(has<session::StartWorkers>(a));
  CHECK(first<session::StartWorkers>(a)->assignment.round() == 1);
  Actions& b = n.go(n.m->on_workers_started(2, n.t));
  REQUIRE(emitted(b, AgentEvent::Kind::kWorkersStarted) != nullptr);
  CHECK(emitted(b, AgentEvent::Kind::kWorkersStarted)->event.workers == 2);
  CHECK_FALSE(emitted(b, AgentEvent::Kind::kWorkersStarted)->event.recovery.has_value());
  CHECK(logged(b, session::Level::kInfo, "round 1: group rank 1/2, ranks 2..3 of 4, restart 0"));
  CHECK_FALSE(has<session::StartWorkers>(n.hear(assignment(2))));
}

TEST_CASE("session: every worker succeeded, then Done: exit 0") {
  Node n;
  n.running();
  Actions& a = n.gone();
  REQUIRE(sent(a, v1::AgentMsg::kSuccess) != nullptr);
  CHECK(sent(a, v1::AgentMsg::kSuccess)->msg.success().round() == 1);
  CHECK(n.m->phase() == Phase::kAwaitingDone);
  CHECK(n.gone().empty());  // a second report of the same: nothing more
  Actions& b = n.done();
  CHECK(emitted(b, AgentEvent::Kind::kSucceeded) != nullptr);
  REQUIRE(has<session::Exit>(b));
  CHECK(first<session::Exit>(b)->code == 0);
  CHECK(n.m->exit_code() == 0);
  CHECK(n.m->exiting());
  CHECK(n.hear(assignment(2)).empty());  // nothing after the end
}

TEST_CASE("session: Done before this node's workers finished is not the end") {
  Node n;
  n.running();
  CHECK_FALSE(has<session::Exit>(n.done()));
  CHECK(n.m->phase() == Phase::kRunning);
}

TEST_CASE("session: a worker failure is reported once, the group stops, a Restart rejoins") {
  Node n;
  n.running();
  n.advance(10ms);
  const auto noticed = n.t;
  Actions& a = n.go(n.m->on_worker_failed(failure(3, 7), n.t));
  CHECK(logged(a, session::Level::kWarn, "worker rank 3 (local rank 1, pid 4003) failed: exit code 7"));
  REQUIRE(emitted(a, AgentEvent::Kind::kWorkerFailed) != nullptr);
  CHECK(emitted(a, AgentEvent::Kind::kWorkerFailed)->event.exit_code == 7);
  REQUIRE(sent(a, v1::AgentMsg::kFailure) != nullptr);
  CHECK(sent(a, v1::AgentMsg::kFailure)->msg.failure().round() == 1);
  CHECK(sent(a, v1::AgentMsg::kFailure)->msg.failure().root_cause().rank() == 3);
  REQUIRE(has<session::StopWorkers>(a));
  CHECK(first<session::StopWorkers>(a)->signal == SIGTERM);
  CHECK(n.m->phase() == Phase::kStopping);
  // The other worker, killed by the stop, is not a second failure.
  CHECK(n.go(n.m->on_worker_failed(failure(2, -1), n.t)).empty());
  n.advance(20ms);
  Actions& b = n.gone();
  REQUIRE(emitted(b, AgentEvent::Kind::kWorkersStopped) != nullptr);
  CHECK(emitted(b, AgentEvent::Kind::kWorkersStopped)->event.workers == 2);
  CHECK_FALSE(has<session::Send>(b));  // the server decides
  n.advance(5ms);
  Actions& c = n.restart();
  CHECK(logged(c, session::Level::kWarn, "restarting workers: node n2 left"));
  REQUIRE(emitted(c, AgentEvent::Kind::kRestart) != nullptr);
  CHECK(emitted(c, AgentEvent::Kind::kRestart)->event.restart_count == 1);
  REQUIRE(has<session::StopWorkers>(c));
  Actions& d = n.gone();  // already gone: the wiring says so at once
  CHECK(emitted(d, AgentEvent::Kind::kWorkersStopped) == nullptr);  // once per round
  CHECK(has<session::ReleaseWorkers>(d));
  REQUIRE(sent(d, v1::AgentMsg::kJoin) != nullptr);
  CHECK(n.m->phase() == Phase::kJoining);
  n.advance(30ms);
  n.hear(assignment(2, 0, 1));
  n.advance(5ms);
  Actions& e = n.go(n.m->on_workers_started(2, n.t));
  const auto* started = emitted(e, AgentEvent::Kind::kWorkersStarted);
  REQUIRE(started != nullptr);
  REQUIRE(started->event.recovery.has_value());
  const auto& r = *started->event.recovery;
  CHECK(r.cause == "worker_failure");
  CHECK(r.noticed == noticed);
  CHECK(r.stopped == noticed + 20ms);
  CHECK(r.formed == noticed + 55ms);
  CHECK(r.started == noticed + 60ms);
}

TEST_CASE("session: the server's Restart while running stops the workers, then rejoins") {
  Node n;
  n.running();
  Actions& a = n.restart();
  REQUIRE(has<session::StopWorkers>(a));
  CHECK(n.m->after() == SessionMachine::After::kRejoin);
  Actions& b = n.gone();
  CHECK(emitted(b, AgentEvent::Kind::kWorkersStopped) != nullptr);
  CHECK(sent(b, v1::AgentMsg::kJoin) != nullptr);
}

TEST_CASE("session: the server's Fail prints the summary and exits 1 once the workers are gone") {
  Node n;
  n.running();
  v1::ServerMsg f;
  f.mutable_fail()->set_reason("no restarts left");
  *f.mutable_fail()->mutable_root_cause() = failure(0, 1);
  Actions& a = n.hear(f);
  REQUIRE(has<session::StopWorkers>(a));
  CHECK_FALSE(has<session::Exit>(a));
  Actions& b = n.gone();
  REQUIRE(emitted(b, AgentEvent::Kind::kFailed) != nullptr);
  CHECK(emitted(b, AgentEvent::Kind::kFailed)->event.reason == "no restarts left");
  REQUIRE(has<session::PrintFailure>(b));
  CHECK(first<session::PrintFailure>(b)->fail.root_cause().rank() == 0);
  REQUIRE(has<session::Exit>(b));
  CHECK(first<session::Exit>(b)->code == 1);
  CHECK(n.m->failed());
  // A closed stream after the Fail changes nothing.
  CHECK(n.closed(absl::OkStatus()).empty());
}

TEST_CASE("session: a Fail that says do not requeue exits 3") {
  Node n;
  n.running();
  v1::ServerMsg f;
  f.mutable_fail()->set_reason("no progress");
  f.mutable_fail()->set_do_not_requeue(true);
  n.hear(f);
  Actions& b = n.gone();
  CHECK(logged(b, session::Level::kError, "no progress; exit code 3 (do not requeue)"));
  REQUIRE(has<session::Exit>(b));
  CHECK(first<session::Exit>(b)->code == kExitDoNotRequeue);
}

TEST_CASE("session: a signal leaves the run at once, a second one kills without grace") {
  Node n;
  n.running();
  Actions& a = n.signal(SIGINT);
  CHECK(logged(a, session::Level::kWarn, "received SIGINT; stopping workers"));
  CHECK(has<session::CloseStream>(a));
  REQUIRE(has<session::StopWorkers>(a));
  CHECK(first<session::StopWorkers>(a)->signal == SIGINT);
  CHECK(n.m->exit_code() == 128 + SIGINT);
  CHECK(has<session::KillWorkers>(n.signal(SIGINT)));
  // The closed stream and the silence that follow are not a lost server.
  CHECK(n.closed(absl::CancelledError("cancelled")).empty());
  n.advance(3s);
  CHECK_FALSE(has<session::StopWorkers>(n.timer(session::Timer::kSilence)));
  Actions& b = n.gone();
  REQUIRE(has<session::Exit>(b));
  CHECK(first<session::Exit>(b)->code == 128 + SIGINT);
  CHECK(first<session::Exit>(b)->signal == SIGINT);
  CHECK(n.signal(SIGTERM).empty());
}

TEST_CASE("session: a signal while a worker fails still exits with the signal's code") {
  Node n;
  n.running();
  n.go(n.m->on_worker_failed(failure(2, 1), n.t));
  n.signal(SIGTERM);
  Actions& a = n.gone();
  REQUIRE(has<session::Exit>(a));
  CHECK(first<session::Exit>(a)->code == 128 + SIGTERM);
}

TEST_CASE("session: a refusal from the server ends the job with its message") {
  Node n;
  n.start();
  Actions& a = n.closed(absl::PermissionDeniedError("bad token for run job"));
  CHECK(logged(a, session::Level::kError, "rendezvous: bad token for run job"));
  REQUIRE(has<session::Exit>(a));
  CHECK(first<session::Exit>(a)->code == 1);
}

TEST_CASE("session: a server never reached ends the job") {
  Node n;
  n.start();
  Actions& a = n.closed(absl::UnavailableError("connection refused"));
  CHECK(logged(a, session::Level::kError,
               "rendezvous: never reached the server at node1:29400 (connection refused)"));
  REQUIRE(has<session::Exit>(a));
}

TEST_CASE("session: connected but never heard from for a window: never reached") {
  Node n;
  n.start();
  n.advance(2s);
  n.m->on_timer(session::Timer::kSilence, n.t);  // not armed: nothing
  n.ready();  // the stream is up (that arms the window) but no message ever comes
  n.advance(2s);
  Actions& a = n.timer(session::Timer::kSilence);
  CHECK(has<session::CloseStream>(a));
  CHECK(logged(a, session::Level::kError, "connected, but nothing heard from it for 2 s"));
  CHECK(has<session::Exit>(a));
}

TEST_CASE("session: silence while running: the node stops its workers and joins again") {
  Node n;
  n.running();
  n.advance(1s);
  REQUIRE(has<session::OpenProbe>(n.timer(session::Timer::kSilence)));
  n.probe_closed(absl::DeadlineExceededError("not reachable"));  // nobody answers
  n.advance(1s);
  Actions& a = n.timer(session::Timer::kSilence);
  CHECK(has<session::CloseStream>(a));
  CHECK(logged(a, session::Level::kError,
               "lost the server at node1:29400 (nothing heard from it for 2 s, the run's "
               "liveness window); stopping workers, then joining again (for up to 60 s)"));
  REQUIRE(emitted(a, AgentEvent::Kind::kLostServer) != nullptr);
  REQUIRE(has<session::StopWorkers>(a));
  n.advance(100ms);
  Actions& b = n.gone();
  CHECK(has<session::ReleaseWorkers>(b));
  REQUIRE(armed(b, session::Timer::kReopen) != nullptr);
  CHECK(armed(b, session::Timer::kReopen)->at == n.t);
  CHECK_FALSE(has<session::OpenStream>(b));  // not from inside the old stream's callback
  Actions& c = n.timer(session::Timer::kReopen);
  REQUIRE(has<session::OpenStream>(c));
  CHECK(first<session::OpenStream>(c)->wait_for_ready);
  CHECK(first<session::OpenStream>(c)->connect_timeout == 60s - 100ms);  // what is left
  REQUIRE(sent(c, v1::AgentMsg::kJoin) != nullptr);
  CHECK(sent(c, v1::AgentMsg::kJoin)->msg.join().reattach_round() == 0);
  // Back: an Assignment of the next round starts workers again.
  CHECK(has<session::StartWorkers>(n.hear(assignment(2))));
}

TEST_CASE("session: a lost server is tried again until the rejoin deadline, then exit 1") {
  Node n;
  n.running();
  n.closed(absl::UnavailableError("socket closed"));
  REQUIRE(has<session::StopWorkers>(n.last));
  n.gone();
  n.timer(session::Timer::kReopen);
  n.advance(30s);
  Actions& a = n.closed(absl::UnavailableError("connection refused"));
  CHECK_FALSE(has<session::Exit>(a));  // within the deadline: again
  CHECK(emitted(a, AgentEvent::Kind::kLostServer) != nullptr);
  REQUIRE(armed(a, session::Timer::kReopen) != nullptr);  // nothing runs: straight on
  Actions& b = n.timer(session::Timer::kReopen);
  REQUIRE(has<session::OpenStream>(b));
  CHECK(first<session::OpenStream>(b)->connect_timeout == 30s);
  n.advance(31s);
  Actions& c = n.closed(absl::DeadlineExceededError("not reachable within 30 s"));
  CHECK(logged(c, session::Level::kError, "could not reach it again within 60 s"));
  REQUIRE(has<session::Exit>(c));
  CHECK(first<session::Exit>(c)->code == 1);
}

TEST_CASE("session: the server heard again cancels the rejoin deadline") {
  Node n;
  n.running();
  n.closed(absl::UnavailableError("socket closed"));
  n.gone();
  n.timer(session::Timer::kReopen);
  n.hear(assignment(2));
  n.go(n.m->on_workers_started(2, n.t));
  n.advance(61s);
  // A later loss is a new one, with a new deadline, not the end.
  Actions& a = n.closed(absl::UnavailableError("socket closed"));
  CHECK(logged(a, session::Level::kError, "stopping workers, then joining again"));
  CHECK_FALSE(has<session::Exit>(a));
}

TEST_CASE("session: the server lost after this node's workers succeeded: exit 1") {
  Node n;
  n.running();
  n.gone();
  Actions& a = n.closed(absl::UnavailableError("socket closed"));
  CHECK(logged(a, session::Level::kError, "before the run's end was confirmed"));
  REQUIRE(has<session::StopWorkers>(a));
  Actions& b = n.gone(0);
  REQUIRE(has<session::Exit>(b));
  CHECK(first<session::Exit>(b)->code == 1);
}

TEST_CASE("session: the first wait goes round several endpoints until its deadline") {
  Node n(3, true);
  Actions& a = n.start();
  REQUIRE(has<session::OpenStream>(a));
  CHECK(first<session::OpenStream>(a)->endpoint.name == "node1:29400");
  CHECK(first<session::OpenStream>(a)->connect_timeout == 2s);  // one window per attempt
  n.advance(2s);
  Actions& b = n.closed(absl::DeadlineExceededError("not reachable"));
  REQUIRE(armed(b, session::Timer::kReopen) != nullptr);
  Actions& c = n.timer(session::Timer::kReopen);
  REQUIRE(has<session::OpenStream>(c));
  CHECK(first<session::OpenStream>(c)->endpoint.name == "node2:29400");
  CHECK(sent(c, v1::AgentMsg::kJoin) != nullptr);
  n.advance(57s);
  n.closed(absl::UnavailableError("connection refused"));
  CHECK(first<session::OpenStream>(n.timer(session::Timer::kReopen))->endpoint.name ==
        "node3:29400");
  CHECK(first<session::OpenStream>(n.last)->connect_timeout == 1s);  // what is left of it
  n.advance(1s);
  Actions& d = n.closed(absl::DeadlineExceededError("not reachable"));
  CHECK(logged(d, session::Level::kError,
               "none of the servers at node1:29400, node2:29400, node3:29400 was reachable "
               "within 60 s"));
  REQUIRE(has<session::Exit>(d));
}

TEST_CASE("session: a lost stream with re-attach keeps the workers and asks for the place back") {
  Node n(2);
  n.running(1, 10000);
  n.advance(50ms);
  const auto lost = n.t;
  Actions& a = n.closed(absl::UnavailableError("socket closed"));
  CHECK(logged(a, session::Level::kWarn,
               "lost the stream to the server at node1:29400 (socket closed); the workers keep "
               "running while this node re-attaches to run job (for up to 10 s)"));
  CHECK_FALSE(has<session::StopWorkers>(a));
  REQUIRE(emitted(a, AgentEvent::Kind::kLostServer) != nullptr);
  CHECK(emitted(a, AgentEvent::Kind::kLostServer)->event.reason == "re-attaching: socket closed");
  CHECK_FALSE(n.m->attached());
  // The workers succeed meanwhile: the report waits for the new stream.
  Actions& b = n.gone();
  CHECK(sent(b, v1::AgentMsg::kSuccess) == nullptr);
  Actions& c = n.timer(session::Timer::kReopen);
  REQUIRE(has<session::OpenStream>(c));
  CHECK(first<session::OpenStream>(c)->endpoint.name == "node2:29400");  // the next one first
  const auto* join = sent(c, v1::AgentMsg::kJoin);
  REQUIRE(join != nullptr);
  CHECK(join->msg.join().reattach_round() == 1);
  CHECK(join->msg.join().reattach_group_rank() == 1);
  n.advance(250ms);
  v1::ServerMsg wrong;
  wrong.mutable_attached()->set_round(7);
  wrong.mutable_attached()->set_ok(true);
  CHECK_FALSE(emitted(n.hear(wrong), AgentEvent::Kind::kReattached));  // not the one asked for
  v1::ServerMsg ok;
  ok.mutable_attached()->set_round(1);
  ok.mutable_attached()->set_ok(true);
  Actions& d = n.hear(ok);
  CHECK(logged(d, session::Level::kWarn, "re-attached to run job round 1 at node2:29400 after 250 ms"));
  const auto* re = emitted(d, AgentEvent::Kind::kReattached);
  REQUIRE(re != nullptr);
  CHECK(re->event.took == n.t - lost);
  CHECK(re->event.reason == "node2:29400");
  REQUIRE(sent(d, v1::AgentMsg::kSuccess) != nullptr);  // the report that waited
  CHECK(n.m->attached());
  CHECK(has<session::Exit>(n.done()));
}

TEST_CASE("session: a refused re-attach stops the workers and joins again") {
  Node n;
  n.running(1, 10000);
  n.closed(absl::UnavailableError("socket closed"));
  n.timer(session::Timer::kReopen);
  v1::ServerMsg no;
  no.mutable_attached()->set_round(1);
  no.mutable_attached()->set_ok(false);
  no.mutable_attached()->set_reason("the round is over");
  Actions& a = n.hear(no);
  CHECK(logged(a, session::Level::kWarn, "could not re-attach to run job (the round is over); stopping workers"));
  REQUIRE(has<session::StopWorkers>(a));
  Actions& b = n.gone();
  CHECK(has<session::ReleaseWorkers>(b));
  CHECK(sent(b, v1::AgentMsg::kJoin) != nullptr);
  n.hear(assignment(2, 10000));
  Actions& c = n.go(n.m->on_workers_started(2, n.t));
  REQUIRE(emitted(c, AgentEvent::Kind::kWorkersStarted)->event.recovery.has_value());
  CHECK(emitted(c, AgentEvent::Kind::kWorkersStarted)->event.recovery->cause == "lost_server");
}

TEST_CASE("session: a refused re-attach after the workers succeeded: exit 1") {
  Node n;
  n.running(1, 10000);
  n.gone();
  n.closed(absl::UnavailableError("socket closed"));
  n.timer(session::Timer::kReopen);
  v1::ServerMsg no;
  no.mutable_attached()->set_round(1);
  no.mutable_attached()->set_ok(false);
  Actions& a = n.hear(no);
  CHECK(logged(a, session::Level::kError, "before the run's end was confirmed"));
  CHECK(has<session::StopWorkers>(a));
  CHECK(has<session::Exit>(n.gone(0)));
}

TEST_CASE("session: re-attach attempts go on until the window, then the node is out") {
  Node n(2);
  n.running(1, 10000);
  n.closed(absl::UnavailableError("socket closed"));
  n.timer(session::Timer::kReopen);
  n.advance(3s);
  Actions& a = n.closed(absl::DeadlineExceededError("not reachable"));
  CHECK_FALSE(has<session::StopWorkers>(a));
  REQUIRE(armed(a, session::Timer::kReopen) != nullptr);
  Actions& b = n.timer(session::Timer::kReopen);
  CHECK(first<session::OpenStream>(b)->endpoint.name == "node1:29400");  // round the list
  CHECK(first<session::OpenStream>(b)->connect_timeout == 2s);
  n.ready();
  n.advance(2s);  // a new stream that stays silent is one more failed attempt
  Actions& c = n.timer(session::Timer::kSilence);
  CHECK(has<session::CloseStream>(c));
  CHECK_FALSE(has<session::StopWorkers>(c));
  REQUIRE(armed(c, session::Timer::kReopen) != nullptr);
  n.timer(session::Timer::kReopen);
  n.advance(6s);
  Actions& d = n.closed(absl::UnavailableError("connection refused"));
  CHECK(logged(d, session::Level::kError, "could not re-attach to run job within 10 s"));
  CHECK(logged(d, session::Level::kError, "lost the server"));
  REQUIRE(has<session::StopWorkers>(d));
  CHECK(n.m->attached());
}

TEST_CASE("session: without re-attach in the round, a lost stream stops the workers") {
  Node n;
  n.running(1, 0);
  CHECK(has<session::StopWorkers>(n.closed(absl::UnavailableError("socket closed"))));
}

TEST_CASE("session: a stalled rank of this round is dumped, then the group fails") {
  Node n;
  n.running();
  v1::ServerMsg s;
  s.mutable_stalled()->set_round(2);
  s.mutable_stalled()->set_rank(3);
  CHECK_FALSE(has<session::DumpStalled>(n.hear(s)));  // another round's
  s.mutable_stalled()->set_round(1);
  s.mutable_stalled()->set_description("rank 3 at step 9 for 30 s");
  Actions& a = n.hear(s);
  REQUIRE(has<session::DumpStalled>(a));
  CHECK(first<session::DumpStalled>(a)->rank == 3);
  CHECK(first<session::DumpStalled>(a)->description == "rank 3 at step 9 for 30 s");
  v1::WorkerFailure f = failure(3, 0);
  f.set_message("hang: rank 3 at step 9");
  Actions& b = n.go(n.m->on_hang_dumped(f, n.t));
  REQUIRE(sent(b, v1::AgentMsg::kFailure) != nullptr);
  CHECK(sent(b, v1::AgentMsg::kFailure)->msg.failure().root_cause().message() ==
        "hang: rank 3 at step 9");
  CHECK(has<session::StopWorkers>(b));
}

TEST_CASE("session: a worker that cannot be started fails the round without a start event") {
  Node n;
  n.start();
  n.ready();
  n.hear(assignment(1));
  v1::WorkerFailure f = failure(2, 127);
  Actions& a = n.go(n.m->on_spawn_failed(f, n.t));
  REQUIRE(sent(a, v1::AgentMsg::kFailure) != nullptr);
  CHECK(sent(a, v1::AgentMsg::kFailure)->msg.failure().root_cause().exit_code() == 127);
  CHECK(has<session::StopWorkers>(a));
  CHECK(emitted(a, AgentEvent::Kind::kWorkersStarted) == nullptr);
}

TEST_CASE("session: progress goes out only while the round runs and the node is attached") {
  Node n;
  n.start();
  v1::AgentMsg p;
  p.mutable_progress()->add_ranks()->set_step(5);
  CHECK(n.go(n.m->on_progress(p, n.t)).empty());
  n.ready();
  n.hear(assignment(4, 10000));
  n.go(n.m->on_workers_started(2, n.t));
  Actions& a = n.go(n.m->on_progress(p, n.t));
  REQUIRE(sent(a, v1::AgentMsg::kProgress) != nullptr);
  CHECK(sent(a, v1::AgentMsg::kProgress)->msg.progress().round() == 4);
  n.closed(absl::UnavailableError("socket closed"));  // re-attaching
  CHECK(n.go(n.m->on_progress(p, n.t)).empty());
}

TEST_CASE("session: a signal between streams exits, and no stream reopens after it") {
  Node n;
  n.running();
  n.closed(absl::UnavailableError("socket closed"));
  n.gone();  // the lost server's stop is done: a reopen is due
  REQUIRE(n.m->phase() == Phase::kStopping);
  REQUIRE(has<session::StopWorkers>(n.signal(SIGTERM)));
  REQUIRE(has<session::Exit>(n.gone(0)));  // nothing runs: the group is gone at once
  CHECK(n.timer(session::Timer::kReopen).empty());
}

TEST_CASE("session: the end cancels every timer") {
  Node n;
  n.running();
  n.gone();
  Actions& a = n.done();
  std::vector<session::Timer> cancelled;
  for (const auto* c : all<session::CancelTimer>(a)) cancelled.push_back(c->timer);
  CHECK(cancelled.size() == 4);
  // The exit comes last, after everything it must follow.
  REQUIRE(!a.empty());
  CHECK(std::holds_alternative<session::Exit>(a.back()));
}

// --- the probe ------------------------------------------------------------------------------

namespace {
v1::ServerMsg attached(int round, bool ok) {
  v1::ServerMsg m;
  m.mutable_attached()->set_round(round);
  m.mutable_attached()->set_ok(ok);
  if (!ok) m.mutable_attached()->set_reason("the round is over");
  return m;
}
v1::ServerMsg keep_alive_msg() {
  v1::ServerMsg k;
  k.mutable_keep_alive();
  return k;
}
}  // namespace

TEST_CASE("session: two intervals of silence in a round open a probe, the workers run on") {
  Node n;
  n.running(1, 0);  // a server without re-attach windows probes too: it still holds the place
  const auto heard = n.t;
  n.advance(1s - 1ms);
  Actions& early = n.timer(session::Timer::kSilence);
  CHECK_FALSE(has<session::OpenProbe>(early));
  REQUIRE(armed(early, session::Timer::kSilence) != nullptr);
  CHECK(armed(early, session::Timer::kSilence)->at == heard + 1s);
  n.advance(1ms);
  Actions& a = n.timer(session::Timer::kSilence);
  CHECK(logged(a, session::Level::kWarn,
               "nothing heard from the server at node1:29400 for 1 s; probing on new "
               "connections while the workers keep running (out after 2 s of silence)"));
  const auto* p = first<session::OpenProbe>(a);
  REQUIRE(p != nullptr);
  CHECK(p->endpoint.name == "node1:29400");  // its own server first, on a fresh connection
  CHECK(p->connect_timeout == 50ms);           // a tenth of an interval
  REQUIRE(p->msgs.size() == 2);
  CHECK(p->msgs[0].join().reattach_round() == 1);
  CHECK(p->msgs[0].join().reattach_group_rank() == 1);
  CHECK(p->msgs[1].has_keep_alive());
  CHECK_FALSE(has<session::CloseStream>(a));
  CHECK_FALSE(has<session::StopWorkers>(a));
  REQUIRE(armed(a, session::Timer::kSilence) != nullptr);
  CHECK(armed(a, session::Timer::kSilence)->at == heard + 2s);  // the window's end decides
  CHECK(n.m->probing());
  CHECK(n.m->attached());
  // The attempt times out; the next one opens on the loop's next turn, the last one only
  // for what is left of the window.
  n.advance(50ms);
  REQUIRE(armed(n.probe_closed(absl::DeadlineExceededError("timeout")), session::Timer::kProbe));
  const auto* r = first<session::OpenProbe>(n.timer(session::Timer::kProbe));
  REQUIRE(r != nullptr);
  CHECK(r->connect_timeout == 50ms);  // a fresh SYN every 50 ms until the window's end
  n.advance(920ms);
  REQUIRE(armed(n.probe_closed(absl::DeadlineExceededError("timeout")), session::Timer::kProbe));
  const auto* q = first<session::OpenProbe>(n.timer(session::Timer::kProbe));
  REQUIRE(q != nullptr);
  CHECK(q->connect_timeout == 30ms);
  // A probe's end after its window is not one more attempt.
  n.advance(30ms);
  Actions& end = n.timer(session::Timer::kSilence);
  CHECK(has<session::CloseProbe>(end));
  CHECK(has<session::StopWorkers>(end));
  CHECK_FALSE(n.m->probing());
  CHECK(n.probe_closed(absl::CancelledError("closed")).empty());
}

TEST_CASE("session: a short interval's keep-alives and probe attempts keep their floors") {
  Node n;
  n.config.keep_alive_interval = 100ms;  // a 400 ms window
  n.m = std::make_unique<SessionMachine>(n.config);
  n.running(1, 0);
  REQUIRE(armed(n.timer(session::Timer::kKeepAlive), session::Timer::kKeepAlive) != nullptr);
  CHECK(armed(n.last, session::Timer::kKeepAlive)->at == n.t + 20ms);
  n.advance(200ms);  // two intervals of silence
  const auto* p = first<session::OpenProbe>(n.timer(session::Timer::kSilence));
  REQUIRE(p != nullptr);
  CHECK(p->connect_timeout == muster::agent::kMinProbeAttempt);  // not 10 ms: a connection needs more
}

TEST_CASE("session: a probe answered with Attached becomes the stream, nothing restarts") {
  Node n;
  n.running(1, 0);
  n.advance(1s);
  n.timer(session::Timer::kSilence);
  // A worker fails meanwhile: its report goes out on the old stream, and is kept.
  n.advance(100ms);
  REQUIRE(sent(n.go(n.m->on_worker_failed(failure(3, 1), n.t)), v1::AgentMsg::kFailure));
  // The old stream ends (the server closed it when the probe took the place): the probe
  // decides.
  CHECK(n.closed(absl::AbortedError("replaced by a newer stream")).empty());
  n.advance(150ms);
  Actions& a = n.probe_hears(attached(1, true));
  CHECK(has<session::AdoptProbe>(a));
  CHECK(logged(a, session::Level::kWarn,
               "re-attached to run job round 1 at node1:29400 after 250 ms; the workers kept "
               "running"));
  REQUIRE(emitted(a, AgentEvent::Kind::kReattached) != nullptr);
  CHECK(sent(a, v1::AgentMsg::kFailure) != nullptr);  // what may have died with the old one
  CHECK_FALSE(has<session::OpenStream>(a));
  CHECK_FALSE(has<session::StopWorkers>(a));  // stopping for the failure, not for the probe
  CHECK(n.m->attached());
  CHECK_FALSE(n.m->probing());
  // From now on it is the stream: its messages are on_message, and the silence rule counts
  // from what it said.
  REQUIRE(armed(n.keep_alive_answer(), session::Timer::kSilence) == nullptr);
  n.advance(1s);
  // Still in its round (stopping for the failure, the server's word to come): probed again.
  CHECK(has<session::OpenProbe>(n.timer(session::Timer::kSilence)));
}

TEST_CASE("session: anything heard on the old stream ends the probe") {
  Node n;
  n.running();
  n.advance(1s);
  n.timer(session::Timer::kSilence);
  n.advance(50ms);
  n.probe_closed(absl::DeadlineExceededError("not reachable"));  // between two attempts
  n.advance(250ms);
  Actions& a = n.keep_alive_answer();
  CHECK_FALSE(has<session::CloseProbe>(a));  // none open
  CHECK(has<session::CancelTimer>(a));
  CHECK_FALSE(n.m->probing());
  CHECK(n.timer(session::Timer::kProbe).empty());  // no next attempt
  CHECK(n.probe_hears(attached(1, true)).empty());  // too late: ignored
  CHECK(n.probe_closed(absl::CancelledError("closed")).empty());
  // The window's end as armed is no verdict: heard 700 ms ago, the next probe is 300 ms off.
  n.advance(700ms);
  Actions& b = n.timer(session::Timer::kSilence);
  CHECK_FALSE(has<session::StopWorkers>(b));
  CHECK_FALSE(has<session::OpenProbe>(b));
  REQUIRE(armed(b, session::Timer::kSilence) != nullptr);
  CHECK(armed(b, session::Timer::kSilence)->at == n.t + 300ms);
}

// The old stream heard while an attempt is open: that attempt's Join may be at the server
// already, which then moves the node to it and closes the old stream. Closing the attempt
// then would leave the node with no stream the server keeps (the likely cause of one restart
// in 92 blips of 68% of a 5 s window).
TEST_CASE("session: an attempt open when the old stream is heard is let finish: Attached adopts it") {
  Node n;
  n.running();
  n.advance(1s);
  REQUIRE(has<session::OpenProbe>(n.timer(session::Timer::kSilence)));
  n.advance(20ms);
  Actions& a = n.keep_alive_answer();  // the old stream's retransmission got through
  CHECK_FALSE(has<session::CloseProbe>(a));
  CHECK(n.m->probing());
  CHECK(n.timer(session::Timer::kProbe).empty());  // no new attempt meanwhile
  // The server took the Join: it closes the old stream, then answers on the probe.
  n.advance(5ms);
  CHECK(n.closed(absl::AbortedError("replaced by a newer stream")).empty());
  Actions& b = n.probe_hears(attached(1, true));
  CHECK(has<session::AdoptProbe>(b));
  CHECK_FALSE(has<session::StopWorkers>(b));
  CHECK_FALSE(n.m->probing());
  CHECK(n.m->attached());
}

// A node whose probe attempt is open when its old stream is heard again (20 ms after the probe
// started): the attempt is let finish.
static void let_finish(Node& n) {
  n.running();
  n.advance(1s);
  REQUIRE(has<session::OpenProbe>(n.timer(session::Timer::kSilence)));
  n.advance(20ms);
  REQUIRE_FALSE(has<session::CloseProbe>(n.keep_alive_answer()));
  REQUIRE(n.m->probing());
}

TEST_CASE("session: a let-finish attempt answered without Attached is closed, the old stream kept") {
  Node n;
  let_finish(n);
  v1::ServerMsg ka;
  ka.mutable_keep_alive();
  Actions& a = n.probe_hears(ka);
  CHECK(has<session::CloseProbe>(a));
  CHECK_FALSE(has<session::StopWorkers>(a));
  CHECK_FALSE(n.m->probing());
}

TEST_CASE("session: a let-finish attempt that fails after the old stream ended: that end decides") {
  Node n;
  let_finish(n);
  CHECK(n.closed(absl::UnavailableError("connection reset")).empty());  // held for the attempt
  Actions& a = n.probe_closed(absl::DeadlineExceededError("not reachable"));
  CHECK(has<session::StopWorkers>(a));  // out of the run: no server-side run store here
  CHECK(logged(a, session::Level::kError, "lost the server at node1:29400 (connection reset)"));
  CHECK_FALSE(n.m->probing());
}

TEST_CASE("session: a let-finish attempt gets one interval, then the old stream alone decides") {
  Node n;
  let_finish(n);
  n.advance(400ms);
  CHECK_FALSE(has<session::CloseProbe>(n.keep_alive_answer()));
  n.advance(100ms);  // one interval since the old stream was heard
  CHECK(has<session::CloseProbe>(n.keep_alive_answer()));
  CHECK_FALSE(n.m->probing());
}

TEST_CASE("session: a standby that answers a probe keeps the workers: the node re-attaches") {
  Node n(2);
  n.running(1, 10000);
  n.advance(1s);
  REQUIRE(first<session::OpenProbe>(n.timer(session::Timer::kSilence))->endpoint.name ==
          "node1:29400");
  n.advance(500ms);
  n.probe_closed(absl::DeadlineExceededError("not reachable"));  // the leader's host is cut
  Actions& b = n.timer(session::Timer::kProbe);
  REQUIRE(first<session::OpenProbe>(b)->endpoint.name == "node2:29400");
  n.advance(10ms);
  Actions& c = n.probe_hears(keep_alive_msg());  // no Attached: a standby holds the Join
  CHECK(has<session::CloseProbe>(c));
  CHECK_FALSE(has<session::AdoptProbe>(c));
  REQUIRE(armed(c, session::Timer::kProbe) != nullptr);
  REQUIRE(first<session::OpenProbe>(n.timer(session::Timer::kProbe))->endpoint.name ==
          "node1:29400");  // the leader gets its turn again (a blip may end)
  n.advance(490ms);
  Actions& d = n.timer(session::Timer::kSilence);
  CHECK(has<session::CloseStream>(d));
  CHECK(has<session::CloseProbe>(d));
  CHECK_FALSE(has<session::StopWorkers>(d));
  CHECK(logged(d, session::Level::kWarn, "another replica answered"));
  Actions& e = n.timer(session::Timer::kReopen);
  REQUIRE(has<session::OpenStream>(e));
  CHECK(first<session::OpenStream>(e)->endpoint.name == "node2:29400");
  REQUIRE(sent(e, v1::AgentMsg::kJoin) != nullptr);
  CHECK(sent(e, v1::AgentMsg::kJoin)->msg.join().reattach_round() == 1);
  // The standby leads and answers.
  n.advance(1s);
  Actions& f = n.hear(attached(1, true));
  CHECK(emitted(f, AgentEvent::Kind::kReattached) != nullptr);
  CHECK_FALSE(has<session::StopWorkers>(f));
}

TEST_CASE("session: a standby answered but the round keeps no runs: out after the window") {
  Node n(2);
  n.running(1, 0);
  n.advance(1s);
  n.timer(session::Timer::kSilence);
  n.probe_closed(absl::DeadlineExceededError("not reachable"));
  n.timer(session::Timer::kProbe);
  n.probe_hears(keep_alive_msg());
  n.advance(1s);
  CHECK(has<session::StopWorkers>(n.timer(session::Timer::kSilence)));
}

TEST_CASE("session: a refused probe stops the workers and joins again") {
  Node n;
  n.running(1, 0);
  n.advance(1s);
  n.timer(session::Timer::kSilence);
  Actions& a = n.probe_hears(attached(1, false));  // the server dropped the node already
  CHECK(has<session::AdoptProbe>(a));
  CHECK(logged(a, session::Level::kWarn, "could not re-attach to run job (the round is over)"));
  REQUIRE(has<session::StopWorkers>(a));
  CHECK(sent(n.gone(), v1::AgentMsg::kJoin) != nullptr);  // on the adopted stream
}

TEST_CASE("session: no probe before a round, after its end, or in a window of two intervals") {
  Node joining;
  joining.start();
  joining.ready();
  joining.advance(1s);
  CHECK_FALSE(has<session::OpenProbe>(joining.timer(session::Timer::kSilence)));

  Node restarting;
  restarting.running();
  restarting.restart();
  restarting.advance(1s);
  CHECK_FALSE(has<session::OpenProbe>(restarting.timer(session::Timer::kSilence)));

  Node tight;
  tight.config.keep_alive_max_attempt = 2;
  tight.m = std::make_unique<SessionMachine>(tight.config);
  tight.running();
  tight.advance(1s);
  Actions& a = tight.timer(session::Timer::kSilence);
  CHECK_FALSE(has<session::OpenProbe>(a));
  CHECK(has<session::StopWorkers>(a));
}

TEST_CASE("session: a signal during a probe closes it") {
  Node n;
  n.running();
  n.advance(1s);
  n.timer(session::Timer::kSilence);
  Actions& a = n.signal(SIGTERM);
  CHECK(has<session::CloseProbe>(a));
  CHECK(has<session::CloseStream>(a));
  CHECK(n.timer(session::Timer::kProbe).empty());
}
