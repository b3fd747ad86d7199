// The session machine's test fixture (agent/session_machine.h): a machine with a fake clock,
// and lookups in its actions. Shared by session_machine_test.cc and session_in_place_test.cc.
#pragma once

#include <catch2/catch.hpp>
#include <csignal>
#include <memory>
#include <string>
#include <vector>

#include "muster/agent/session_machine.h"

using namespace std::chrono_literals;
using muster::agent::AgentEvent;
using muster::agent::kExitDoNotRequeue;
namespace session = muster::agent::session;
namespace v1 = muster::v1;
using session::Actions;
using session::SessionMachine;
using Phase = SessionMachine::Phase;

namespace session_fixture {

template <class T>
std::vector<const T*> all(const Actions& actions) {
  std::vector<const T*> out;
  for (const auto& a : actions) {
    if (const T* x = std::get_if<T>(&a)) out.push_back(x);
  }
  return out;
}
template <class T>
const T* first(const Actions& actions) {
  auto v = all<T>(actions);
  return v.empty() ? nullptr : v.front();
}
template <class T>
bool has(const Actions& actions) {
  return first<T>(actions) != nullptr;
}

inline const session::Emit* emitted(const Actions& actions, AgentEvent::Kind kind) {
  for (const session::Emit* e : all<session::Emit>(actions)) {
    if (e->event.kind == kind) return e;
  }
  return nullptr;
}
inline const session::Send* sent(const Actions& actions, v1::AgentMsg::MsgCase kind) {
  for (const session::Send* s : all<session::Send>(actions)) {
    if (s->msg.msg_case() == kind) return s;
  }
  return nullptr;
}
inline bool logged(const Actions& actions, session::Level level, const std::string& part) {
  for (const session::Log* l : all<session::Log>(actions)) {
    if (l->level == level && l->text.find(part) != std::string::npos) return true;
  }
  return false;
}
inline const session::ArmTimer* armed(const Actions& actions, session::Timer timer) {
  for (const session::ArmTimer* a : all<session::ArmTimer>(actions)) {
    if (a->timer == timer) return a;
  }
  return nullptr;
}

inline v1::ServerMsg assignment(int round, int reattach_ms = 0, int restart_count = 0) {
  v1::ServerMsg m;
  v1::Assignment* a = m.mutable_assignment();
  a->set_round(round);
  a->set_group_rank(1);
  a->set_group_world_size(2);
  a->set_rank_offset(2);
  a->set_world_size(4);
  a->set_restart_count(restart_count);
  a->set_reattach_timeout_ms(reattach_ms);
  return m;
}

inline v1::WorkerFailure failure(int rank, int exit_code) {
  v1::WorkerFailure f;
  f.set_rank(rank);
  f.set_local_rank(rank % 2);
  f.set_pid(4000 + rank);
  f.set_exit_code(exit_code);
  return f;
}

// A machine, its fake clock and the last event's actions.
struct Node {
  session::Config config;
  std::unique_ptr<SessionMachine> m;
  session::Time t{std::chrono::seconds(1000)};
  Actions last;

  explicit Node(int endpoints = 1, bool wait = false) {
    config.run_id = "job";
    for (int i = 0; i < endpoints; ++i) {
      config.endpoints.push_back({"ipv4:10.0.0." + std::to_string(i + 1) + ":29400",
                                  "node" + std::to_string(i + 1) + ":29400"});
    }
    config.wait_for_server = wait;
    config.connect_timeout = 60s;
    config.keep_alive_interval = 500ms;
    config.keep_alive_max_attempt = 4;  // a 2 s window
    config.nproc_per_node = 2;
    config.join.set_run_id("job");
    config.join.set_node_id("n1");
    m = std::make_unique<SessionMachine>(config);
  }
  // --in_place, with this timeout (a new machine: call before start).
  void in_place(std::chrono::milliseconds timeout = 2s) {
    config.in_place = true;
    config.in_place_timeout = timeout;
    m = std::make_unique<SessionMachine>(config);
  }
  Actions& go(Actions a) { return last = std::move(a); }
  void advance(std::chrono::milliseconds d) { t += d; }

  Actions& start() { return go(m->start(t)); }
  Actions& ready() { return go(m->on_stream_ready(t)); }
  Actions& hear(const v1::ServerMsg& msg) { return go(m->on_message(msg, t)); }
  Actions& keep_alive_answer() {
    v1::ServerMsg k;
    k.mutable_keep_alive();
    return hear(k);
  }
  Actions& closed(const absl::Status& s) { return go(m->on_stream_closed(s, t)); }
  Actions& probe_hears(const v1::ServerMsg& msg) { return go(m->on_probe_message(msg, t)); }
  Actions& probe_closed(const absl::Status& s) { return go(m->on_probe_closed(s, t)); }
  Actions& timer(session::Timer which) { return go(m->on_timer(which, t)); }
  Actions& gone(int workers = 2) { return go(m->on_group_gone(workers, t)); }
  Actions& signal(int sig) { return go(m->on_signal(sig, t)); }
  Actions& restart(const std::string& why = "node n2 left") {
    v1::ServerMsg r;
    r.mutable_restart()->set_reason(why);
    r.mutable_restart()->set_restart_count(1);
    return hear(r);
  }
  Actions& done() {
    v1::ServerMsg d;
    d.mutable_done();
    return hear(d);
  }

  // Started, heard, in round `round` with its workers running.
  void running(int round = 1, int reattach_ms = 0) {
    start();
    ready();
    hear(assignment(round, reattach_ms));
    REQUIRE(has<session::StartWorkers>(last));
    go(m->on_workers_started(2, t));
    REQUIRE(m->phase() == Phase::kRunning);
  }
};

}  // namespace session_fixture

using namespace session_fixture;
