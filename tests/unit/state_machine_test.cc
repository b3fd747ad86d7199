// The rendezvous rules, driven with a fake clock: `now` is just a number we advance.
#include "muster/rendezvous/state_machine.h"

#include <catch2/catch.hpp>
#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <set>

#include "join_msg.h"
#include "muster/rendezvous/limits.h"

using namespace std::chrono_literals;
using muster::rendezvous::Decision;
using muster::rendezvous::Outgoing;
using muster::rendezvous::RunEvent;
using muster::rendezvous::SessionId;
using muster::rendezvous::StateMachine;
using muster::rendezvous::TimePoint;
namespace v1 = muster::v1;

namespace {

struct Harness {
  StateMachine sm;
  TimePoint now{};  // the fake clock
  std::vector<Outgoing> last;

  // Keep-alive has its own tests; elsewhere it is out of the way.
  static muster::rendezvous::RendezvousTimeouts quiet() {
    muster::rendezvous::RendezvousTimeouts t;
    t.keep_alive_interval = std::chrono::hours(1);
    return t;
  }
  explicit Harness(muster::rendezvous::RendezvousTimeouts t = quiet()) : sm(t) {}

  static v1::AgentMsg join_msg(const std::string& node, int min, int max, int max_restarts = 0,
                               int nproc = 2, int requested = -1) {
    v1::AgentMsg m = muster::testing::join_msg(node, min, max, max_restarts, nproc, requested);
    m.mutable_join()->set_master_port_candidate(1000 + static_cast<int>(node.size()));
    return m;
  }
  std::vector<Outgoing>& join(SessionId s, const std::string& node, int min, int max,
                              int max_restarts = 0, int nproc = 2, int requested = -1) {
    last = sm.on_message(s, join_msg(node, min, max, max_restarts, nproc, requested), now).messages;
    return last;
  }
  std::vector<Outgoing>& fail(SessionId s, int round) {
    v1::AgentMsg m;
    m.mutable_failure()->set_round(round);
    m.mutable_failure()->mutable_root_cause()->set_rank(3);
    m.mutable_failure()->mutable_root_cause()->set_exit_code(7);
    return last = sm.on_message(s, m, now).messages;
  }
  std::vector<Outgoing>& succeed(SessionId s, int round) {
    v1::AgentMsg m;
    m.mutable_success()->set_round(round);
    return last = sm.on_message(s, m, now).messages;
  }
  std::vector<Outgoing>& advance(std::chrono::milliseconds d) {
    now += d;
    return last = sm.on_tick(now).messages;
  }
  std::vector<Outgoing>& closed(SessionId s) { return last = sm.on_stream_closed(s, now).messages; }
  std::vector<Outgoing>& send(SessionId s, const v1::AgentMsg& m) {
    return last = sm.on_message(s, m, now).messages;
  }
  // A join whose fields `edit` changes from join_msg's.
  std::vector<Outgoing>& join_with(SessionId s, const std::string& node, int min, int max,
                                   const std::function<void(v1::Join&)>& edit,
                                   int max_restarts = 0) {
    v1::AgentMsg m = join_msg(node, min, max, max_restarts);
    edit(*m.mutable_join());
    return send(s, m);
  }
  const Outgoing* close_of(SessionId s) const {
    for (const auto& o : last) {
      if (o.session == s && o.close) return &o;
    }
    return nullptr;
  }
  std::vector<Outgoing>& keep_alive(SessionId s) {
    v1::AgentMsg m;
    m.mutable_keep_alive();
    return last = sm.on_message(s, m, now).messages;
  }

  // The messages of one kind sent to `s` in the last step.
  std::vector<v1::ServerMsg> to(SessionId s, v1::ServerMsg::MsgCase kind) const {
    std::vector<v1::ServerMsg> r;
    for (const auto& o : last) {
      if (o.session == s && o.msg && o.msg->msg_case() == kind) r.push_back(*o.msg);
    }
    return r;
  }
  v1::Assignment assignment(SessionId s) const {
    auto a = to(s, v1::ServerMsg::kAssignment);
    REQUIRE(a.size() == 1);
    return a[0].assignment();
  }
  // The last step sent nothing but answers to keep-alives (and closed no stream).
  bool only_keep_alive_answers() const {
    for (const auto& o : last) {
      if (o.close || !o.msg || !o.msg->has_keep_alive()) return false;
    }
    return true;
  }
  bool closed_with(SessionId s, absl::StatusCode code) const {
    for (const auto& o : last) {
      if (o.session == s && o.close && o.status.code() == code) return true;
    }
    return false;
  }
};

constexpr auto kAssign = v1::ServerMsg::kAssignment;
constexpr auto kRestart = v1::ServerMsg::kRestart;
constexpr auto kFail = v1::ServerMsg::kFail;
constexpr auto kDone = v1::ServerMsg::kDone;

}  // namespace

TEST_CASE("rendezvous: a single node's round closes at once", "[rdzv][state_machine]") {
  Harness h;
  h.join(1, "a", 1, 1, 0, 4);
  auto a = h.assignment(1);
  CHECK(a.round() == 1);
  CHECK(a.group_rank() == 0);
  CHECK(a.group_world_size() == 1);
  CHECK(a.rank_offset() == 0);
  CHECK(a.world_size() == 4);
  CHECK(a.master_addr() == "host-a");
  CHECK(a.master_port() == 1001);
  CHECK(a.restart_count() == 0);
  CHECK(a.store_prefix() == "/run/1/");
  h.succeed(1, 1);
  CHECK(h.to(1, kDone).size() == 1);
  CHECK(h.closed_with(1, absl::StatusCode::kOk));
  CHECK(h.sm.num_active_runs() == 0);
}

TEST_CASE("rendezvous: a failure restarts the run until the budget is spent", "[rdzv][state_machine]") {
  Harness h;
  h.join(1, "a", 1, 1, 2);
  for (int attempt = 1; attempt <= 2; ++attempt) {
    h.fail(1, attempt);
    auto r = h.to(1, kRestart);
    REQUIRE(r.size() == 1);
    CHECK(r[0].restart().restart_count() == attempt);
    h.join(1, "a", 1, 1, 2);
    CHECK(h.assignment(1).restart_count() == attempt);
    CHECK(h.assignment(1).round() == attempt + 1);
  }
  h.fail(1, 3);
  auto f = h.to(1, kFail);
  REQUIRE(f.size() == 1);
  CHECK(f[0].fail().root_cause().rank() == 3);
  CHECK(f[0].fail().root_cause().exit_code() == 7);
  CHECK(h.closed_with(1, absl::StatusCode::kOk));
}

TEST_CASE("rendezvous: a stale failure report is ignored", "[rdzv][state_machine]") {
  Harness h;
  h.join(1, "a", 1, 1, 1);
  h.fail(1, 7);
  CHECK(h.last.empty());
}

TEST_CASE("rendezvous: a round closes when max nodes have joined", "[rdzv][state_machine]") {
  Harness h;
  h.join(1, "a", 2, 3, 0, 2);
  h.join(2, "b", 2, 3, 0, 4);
  CHECK(h.to(1, kAssign).empty());
  h.join(3, "c", 2, 3, 0, 1);
  auto a = h.assignment(1), b = h.assignment(2), c = h.assignment(3);
  CHECK(a.group_rank() == 0);
  CHECK(b.group_rank() == 1);
  CHECK(c.group_rank() == 2);
  CHECK(a.rank_offset() == 0);
  CHECK(b.rank_offset() == 2);
  CHECK(c.rank_offset() == 6);
  for (const auto& x : {a, b, c}) {
    CHECK(x.world_size() == 7);
    CHECK(x.master_addr() == "host-a");
  }
}

TEST_CASE("rendezvous: last call closes a round above min", "[rdzv][state_machine]") {
  auto t = Harness::quiet();
  t.last_call_timeout = 5s;
  Harness h(t);
  h.join(1, "a", 2, 4);
  h.join(2, "b", 2, 4);
  CHECK(h.last.empty());
  REQUIRE(h.sm.next_deadline().has_value());
  CHECK(*h.sm.next_deadline() == h.now + 5s);
  h.advance(4s);
  CHECK(h.last.empty());
  h.advance(1s);
  CHECK(h.assignment(1).group_world_size() == 2);
  CHECK(h.assignment(2).group_world_size() == 2);
}

TEST_CASE("rendezvous: join timeout below min is a clear error", "[rdzv][state_machine]") {
  auto t = Harness::quiet();
  t.join_timeout = 10s;
  Harness h(t);
  h.join(1, "a", 2, 2);
  h.advance(9s);
  CHECK(h.last.empty());
  h.advance(1s);
  CHECK(h.closed_with(1, absl::StatusCode::kDeadlineExceeded));
  CHECK(h.sm.num_runs() == 0);
}

TEST_CASE("rendezvous: a lost node restarts the others without using the budget", "[rdzv][state_machine]") {
  Harness h;
  h.join(1, "a", 1, 2, 0);
  h.join(2, "b", 1, 2, 0);
  CHECK(h.assignment(2).group_rank() == 1);
  h.closed(1);
  auto r = h.to(2, kRestart);
  REQUIRE(r.size() == 1);
  CHECK(r[0].restart().restart_count() == 0);
  // The survivor is all that is expected back: the round closes at once, no last call.
  h.join(2, "b", 1, 2, 0);
  auto a = h.assignment(2);
  CHECK(a.group_world_size() == 1);
  CHECK(a.group_rank() == 0);
  CHECK(a.restart_count() == 0);
}

TEST_CASE("rendezvous: a Restart names the global ranks whose nodes left, none for a failure",
          "[rdzv][state_machine]") {
  Harness h;
  h.join(1, "a", 1, 3, 1);
  h.join(2, "b", 1, 3, 1);
  h.join(3, "c", 1, 3, 1);  // max: the round closes; two workers each, b holds ranks 2 and 3
  REQUIRE(h.assignment(2).rank_offset() == 2);
  h.closed(2);
  auto r = h.to(1, kRestart);
  REQUIRE(r.size() == 1);
  CHECK(std::vector<int>(r[0].restart().lost_ranks().begin(), r[0].restart().lost_ranks().end()) ==
        std::vector<int>{2, 3});
  CHECK(h.to(3, kRestart).at(0).restart().lost_ranks_size() == 2);
  h.join(1, "a", 1, 3, 1);
  h.join(3, "c", 1, 3, 1);
  REQUIRE(h.assignment(3).world_size() == 4);
  // A worker's failure loses no node: the next Restart names no rank.
  h.fail(1, h.assignment(3).round());
  auto f = h.to(3, kRestart);
  REQUIRE(f.size() == 1);
  CHECK(f[0].restart().lost_ranks_size() == 0);
}

TEST_CASE("rendezvous: group ranks are stable across rounds", "[rdzv][state_machine]") {
  Harness h;
  h.join(1, "a", 2, 2, 1);
  h.join(2, "b", 2, 2, 1);
  CHECK(h.assignment(1).group_rank() == 0);
  h.fail(2, 1);
  // b rejoins first this time; it keeps rank 1.
  h.join(2, "b", 2, 2, 1);
  h.join(1, "a", 2, 2, 1);
  CHECK(h.assignment(1).group_rank() == 0);
  CHECK(h.assignment(2).group_rank() == 1);
}

TEST_CASE("rendezvous: a requested node rank is honoured", "[rdzv][state_machine]") {
  Harness h;
  h.join(1, "a", 2, 2, 0, 2, 1);
  h.join(2, "b", 2, 2, 0, 2, 0);
  CHECK(h.assignment(1).group_rank() == 1);
  CHECK(h.assignment(2).group_rank() == 0);
  CHECK(h.assignment(1).master_addr() == "host-b");
}

TEST_CASE("rendezvous: a newcomer scales a running round up, beyond max it waits", "[rdzv][state_machine]") {
  Harness h;
  h.join(1, "a", 1, 2);
  h.advance(Harness::quiet().last_call_timeout);
  CHECK(h.assignment(1).group_world_size() == 1);
  h.join(2, "b", 1, 2);
  CHECK(h.to(1, kRestart).size() == 1);
  h.join(1, "a", 1, 2);
  CHECK(h.assignment(1).group_world_size() == 2);
  CHECK(h.assignment(2).group_world_size() == 2);
  h.join(3, "c", 1, 2);  // a spare: no restart
  CHECK(h.last.empty());
}

TEST_CASE("rendezvous: bad joins end only the joiner's stream", "[rdzv][state_machine]") {
  Harness h;
  h.join(1, "a", 2, 2);
  h.join(2, "b", 1, 2);  // disagrees on nnodes
  CHECK(h.closed_with(2, absl::StatusCode::kInvalidArgument));
  h.join(3, "c", 3, 2);  // min > max
  CHECK(h.closed_with(3, absl::StatusCode::kInvalidArgument));
  h.join(4, "d", 2, 2);
  CHECK(h.assignment(1).group_world_size() == 2);
}

TEST_CASE("rendezvous: a join to a finished run is refused", "[rdzv][state_machine]") {
  Harness h;
  h.join(1, "a", 1, 1);
  h.succeed(1, 1);
  h.join(2, "b", 1, 1);
  CHECK(h.closed_with(2, absl::StatusCode::kFailedPrecondition));
  h.advance(Harness::quiet().finished_run_grace);
  CHECK(h.sm.num_runs() == 0);
}

TEST_CASE("rendezvous: after a restart the round closes once every survivor is back", "[rdzv][state_machine]") {
  Harness h;
  h.join(1, "a", 2, 4, 1);
  h.join(2, "b", 2, 4, 1);
  h.join(3, "c", 2, 4, 1);
  h.advance(Harness::quiet().last_call_timeout);
  REQUIRE(h.assignment(3).group_world_size() == 3);
  h.fail(3, 1);
  h.join(1, "a", 2, 4, 1);
  h.join(2, "b", 2, 4, 1);
  CHECK(h.last.empty());  // c is not back yet
  h.join(3, "c", 2, 4, 1);
  CHECK(h.assignment(1).group_world_size() == 3);
  CHECK(h.assignment(1).restart_count() == 1);
}

TEST_CASE("rendezvous: the first join sets the run's timing", "[rdzv][state_machine]") {
  Harness h;
  auto m = Harness::join_msg("a", 1, 2);
  m.mutable_join()->set_last_call_timeout_ms(1000);
  h.last = h.sm.on_message(1, m, h.now).messages;
  CHECK(h.last.empty());
  h.advance(999ms);
  CHECK(h.last.empty());
  h.advance(1ms);
  CHECK(h.assignment(1).group_world_size() == 1);
}

TEST_CASE("rendezvous: a node silent past its keep-alives is dropped", "[rdzv][state_machine]") {
  auto t = Harness::quiet();
  t.keep_alive_interval = 5s;
  t.keep_alive_max_attempt = 3;
  Harness h(t);
  h.join(1, "a", 1, 2);
  h.join(2, "b", 1, 2);
  REQUIRE(h.assignment(1).group_world_size() == 2);
  for (int i = 0; i < 2; ++i) {
    h.advance(5s);
    CHECK(h.last.empty());
    h.keep_alive(1);  // a keeps talking, b is silent
  }
  h.advance(5s);  // b has now been silent for 3 intervals
  CHECK(h.closed_with(2, absl::StatusCode::kUnavailable));
  CHECK(h.to(1, kRestart).size() == 1);
  CHECK_FALSE(h.closed_with(1, absl::StatusCode::kUnavailable));
  auto st = h.sm.status("run");
  REQUIRE(st.size() == 1);
  CHECK(st[0].phase() == "joining");
}

TEST_CASE("liveness: every keep-alive is answered, and a silent node goes at the window's end",
          "[rdzv][state_machine][liveness]") {
  // The default rule: 0.5 s x 4 = 2 s.
  muster::rendezvous::RendezvousTimeouts defaults;
  CHECK(defaults.keep_alive_interval * defaults.keep_alive_max_attempt == 2s);
  auto t = Harness::quiet();
  t.keep_alive_interval = 500ms;
  t.keep_alive_max_attempt = 4;
  Harness h(t);
  h.join(1, "a", 1, 2);
  h.join(2, "b", 1, 2);
  REQUIRE(h.assignment(1).group_world_size() == 2);
  h.keep_alive(2);
  REQUIRE(h.last.size() == 1);  // exactly one answer, to the sender
  CHECK(h.last[0].session == 2);
  CHECK(h.last[0].msg->has_keep_alive());
  CHECK_FALSE(h.last[0].close);
  // b last heard at 0; a talks every 500 ms. The drop comes at 2 s exactly, not at the next
  // interval-spaced check after it.
  for (int i = 0; i < 3; ++i) {
    h.advance(500ms);
    CHECK(h.last.empty());
    h.keep_alive(1);
  }
  h.advance(499ms);
  CHECK(h.last.empty());
  h.keep_alive(1);
  h.advance(1ms);
  CHECK(h.closed_with(2, absl::StatusCode::kUnavailable));
  CHECK(h.to(1, kRestart).size() == 1);
}

TEST_CASE("liveness: a node that keeps talking is never dropped, however long it waits",
          "[rdzv][state_machine][liveness]") {
  auto t = Harness::quiet();
  t.keep_alive_interval = 500ms;
  t.keep_alive_max_attempt = 4;
  Harness h(t);
  h.join(1, "a", 2, 2);  // waits for a second node that never comes (join timeout 600 s)
  for (int i = 0; i < 300; ++i) {  // 570 s, inside the join timeout
    h.advance(1900ms);              // each keep-alive just inside the window
    CHECK(h.last.empty());
    h.keep_alive(1);
    CHECK(h.only_keep_alive_answers());
  }
}

TEST_CASE("rendezvous: status reports each run", "[rdzv][state_machine]") {
  Harness h;
  h.join(1, "a", 1, 1, 2, 3);
  auto st = h.sm.status("");
  REQUIRE(st.size() == 1);
  CHECK(st[0].run_id() == "run");
  CHECK(st[0].phase() == "running");
  CHECK(st[0].round() == 1);
  CHECK(st[0].world_size() == 3);
  CHECK(st[0].max_restarts() == 2);
  CHECK(st[0].members().size() == 1);
  CHECK(h.sm.status("other").empty());
}

TEST_CASE("rendezvous: random event sequences keep the invariants", "[rdzv][state_machine]") {
  muster::rendezvous::RendezvousTimeouts t;
  t.last_call_timeout = 2s;
  t.join_timeout = 20s;
  std::mt19937 rng(12345);
  for (int trial = 0; trial < 200; ++trial) {
    Harness h(t);
    const int min = 1 + static_cast<int>(rng() % 3), max = min + static_cast<int>(rng() % 3);
    std::map<SessionId, int> round_of;  // session -> round of its last assignment
    std::map<SessionId, int> nproc_of;  // session -> local_world_size of its last join
    int last_round = 0;
    SessionId next = 1;
    std::set<SessionId> open;
    for (int step = 0; step < 60; ++step) {
      switch (rng() % 5) {
        case 0:
        case 1: {
          SessionId s =
              (open.empty() || rng() % 2) ? next++ : *std::next(open.begin(), rng() % open.size());
          open.insert(s);
          nproc_of[s] = 1 + static_cast<int>(rng() % 3);
          h.join(s, "n" + std::to_string(s), min, max, 3, nproc_of[s]);
          break;
        }
        case 2:
          if (!open.empty()) {
            SessionId s = *std::next(open.begin(), rng() % open.size());
            open.erase(s);
            h.closed(s);
          }
          break;
        case 3:
          if (!round_of.empty()) {
            auto it = std::next(round_of.begin(), rng() % round_of.size());
            h.fail(it->first, it->second);
          }
          break;
        default:
          h.advance(std::chrono::milliseconds(rng() % 3000));
      }
      // Invariants over the assignments of this step.
      std::vector<std::pair<SessionId, v1::Assignment>> as;
      std::set<SessionId> assigned;
      for (const auto& o : h.last) {
        if (o.msg && o.msg->has_assignment()) {
          as.emplace_back(o.session, o.msg->assignment());
          REQUIRE(assigned.insert(o.session).second);  // a node is in at most one round
          round_of[o.session] = o.msg->assignment().round();
        }
        if (o.close) {
          open.erase(o.session);
          round_of.erase(o.session);
        }
      }
      {
        absl::Status inv = h.sm.check_invariants();
        INFO(inv.ToString());
        REQUIRE(inv.ok());
        auto next = h.sm.next_deadline();
        REQUIRE((!next || *next > h.now));  // no deadline left due: no busy timer
      }
      if (!h.sm.has_run("run")) last_round = 0;  // dropped when nobody held it: a new run
      if (as.empty()) continue;
      const int n = static_cast<int>(as.size());
      REQUIRE(n >= min);  // no round closes below min
      REQUIRE(n <= max);
      std::sort(as.begin(), as.end(), [](const auto& a, const auto& b) {
        return a.second.group_rank() < b.second.group_rank();
      });
      int world = 0;
      for (const auto& [session, a] : as) world += nproc_of.at(session);
      REQUIRE(as[0].second.round() > last_round);
      last_round = as[0].second.round();
      int offset = 0;  // global ranks contiguous per node, in group-rank order
      for (int i = 0; i < n; ++i) {
        const v1::Assignment& a = as[i].second;
        REQUIRE(a.group_rank() == i);
        REQUIRE(a.group_world_size() == n);
        REQUIRE(a.round() == last_round);
        REQUIRE(a.world_size() == world);
        REQUIRE(a.rank_offset() == offset);
        offset += nproc_of.at(as[i].first);
      }
    }
  }
}

// --- Hardening (issue 10) ------------------------------------------------------------------

namespace {

namespace limits = muster::rendezvous::limits;
using std::chrono::milliseconds;

// Well-behaved agents, scripted: each joins at its arrival time and, when told Restart,
// joins again on the same stream after its own delay; it reports a failure when scripted to.
// Returns the number of restarts the run went through before it settled (or -1 if it did not
// settle within `max_steps` events).
struct Agent {
  SessionId session = 0;
  std::string node;
  milliseconds arrival{0};
  milliseconds shutdown_timeout{0};  // what its Join says (0: the server's default)
  milliseconds rejoin_delay{0};      // how long it takes to stop its workers after a Restart
  std::optional<TimePoint> join_at;  // when it sends its next Join
  std::optional<milliseconds> fail_at;  // when it reports one worker failure (once)
  int round = 0;                     // of its last assignment; 0 while not in a round
  bool gone = false;
};

struct Outcome {
  int restarts = 0;
  bool settled = false;
  int members = 0;
  int waiting = 0;
  std::string phase;
};

Outcome simulate(std::vector<Agent> agents, int min, int max, int max_restarts,
                 muster::rendezvous::RendezvousTimeouts t, int max_steps = 20000) {
  Harness h(t);
  const TimePoint start = h.now;
  for (Agent& a : agents) a.join_at = start + a.arrival;
  Outcome r;
  auto observe = [&](const std::vector<Outgoing>& out) {
    bool restarted = false;
    for (const Outgoing& o : out) {
      for (Agent& a : agents) {
        if (a.session != o.session) continue;
        if (o.msg && o.msg->has_assignment()) a.round = o.msg->assignment().round();
        if (o.msg && o.msg->has_restart()) {
          restarted = true;
          a.round = 0;
          a.join_at = h.now + a.rejoin_delay;
        }
        if (o.close) a.gone = true;
      }
    }
    if (restarted) ++r.restarts;
    absl::Status inv = h.sm.check_invariants();
    INFO(inv.ToString());
    REQUIRE(inv.ok());
  };
  auto join = [&](Agent& a) {
    a.join_at.reset();
    observe(h.join_with(a.session, a.node, min, max,
                        [&](v1::Join& j) { j.set_shutdown_timeout_ms(a.shutdown_timeout.count()); },
                        max_restarts));
  };
  for (int step = 0; step < max_steps; ++step) {
    // The next thing to happen: an agent's join or failure, or the machine's deadline.
    std::optional<TimePoint> next = h.sm.next_deadline();
    for (const Agent& a : agents) {
      if (a.gone) continue;
      if (a.join_at && (!next || *a.join_at < *next)) next = a.join_at;
      if (a.fail_at && a.round > 0 && (!next || start + *a.fail_at < *next)) {
        next = std::max(h.now, start + *a.fail_at);
      }
    }
    bool pending = false;
    for (const Agent& a : agents) pending |= !a.gone && (a.join_at || (a.fail_at && a.round > 0));
    auto st = h.sm.status("run");
    if (!pending && (st.empty() || st[0].phase() == "running" || !next)) {
      // Nothing scripted is left: the run must be steady, and ticks alone change nothing.
      if (st.empty()) break;
      r.phase = st[0].phase();
      r.members = st[0].members_size();
      r.waiting = st[0].waiting();
      int restarts_before = r.restarts;
      for (int i = 0; i < 10; ++i) observe(h.advance(std::chrono::minutes(1)));
      r.settled = r.phase == "running" && r.restarts == restarts_before;
      break;
    }
    REQUIRE(next.has_value());
    if (*next > h.now) observe(h.advance(std::chrono::duration_cast<milliseconds>(*next - h.now)));
    for (Agent& a : agents) {
      if (a.gone) continue;
      if (a.join_at && *a.join_at <= h.now) join(a);
      if (a.fail_at && a.round > 0 && start + *a.fail_at <= h.now) {
        a.fail_at.reset();
        observe(h.fail(a.session, a.round));
      }
    }
  }
  return r;
}

}  // namespace

TEST_CASE("restart: survivors slower than the last call and a late newcomer settle (no livelock)",
          "[rdzv][state_machine]") {
  // Seen in the field: workers that take longer to stop than last_call_timeout, and a node
  // that arrives late. The newcomer alone met min_nodes, the last call closed the round
  // without the survivors, whose late Join restarted the run again, forever.
  auto t = Harness::quiet();
  t.last_call_timeout = 2s;
  std::vector<Agent> agents(3);
  for (int i = 0; i < 3; ++i) {
    agents[i].session = i + 1;
    agents[i].node = std::string(1, static_cast<char>('a' + i));
    agents[i].shutdown_timeout = 10s;
    agents[i].rejoin_delay = 5s;  // longer than the last call
  }
  agents[2].arrival = 20s;  // c is late: a and b are running by then
  Outcome r = simulate(agents, 1, 3, 0, t);
  CHECK(r.settled);
  CHECK(r.restarts == 1);  // c's arrival scales the run up once
  CHECK(r.members == 3);
}

TEST_CASE("restart: the newcomer alone does not close the round while survivors are expected",
          "[rdzv][state_machine]") {
  auto t = Harness::quiet();
  t.last_call_timeout = 2s;
  Harness h(t);
  auto slow = [](v1::Join& j) { j.set_shutdown_timeout_ms(10000); };
  h.join_with(1, "a", 1, 3, slow);
  h.join_with(2, "b", 1, 3, slow);
  h.advance(2s);
  REQUIRE(h.assignment(1).group_world_size() == 2);
  h.join_with(3, "c", 1, 3, slow);
  CHECK(h.to(1, kRestart).size() == 1);
  CHECK(h.to(2, kRestart).size() == 1);
  h.advance(4s);  // past the last call: c alone meets min, but a and b are still stopping
  CHECK(h.to(3, kAssign).empty());
  h.join_with(1, "a", 1, 3, slow);
  CHECK(h.last.empty());  // b is not back yet
  h.join_with(2, "b", 1, 3, slow);  // every survivor is back: the round closes at once
  CHECK(h.assignment(1).group_world_size() == 3);
  CHECK(h.assignment(1).group_rank() == 0);
  CHECK(h.assignment(2).group_rank() == 1);
  CHECK(h.assignment(3).group_rank() == 2);
}

TEST_CASE("restart: a survivor holds the round for its shutdown timeout plus the margin only",
          "[rdzv][state_machine]") {
  auto t = Harness::quiet();
  t.last_call_timeout = 2s;
  Harness h(t);
  h.join_with(1, "a", 1, 3, [](v1::Join& j) { j.set_shutdown_timeout_ms(10000); });
  h.join_with(2, "b", 1, 3, [](v1::Join& j) { j.set_shutdown_timeout_ms(0); });  // default
  h.advance(2s);
  REQUIRE(h.assignment(1).group_world_size() == 2);
  const TimePoint restart_at = h.now;
  h.join(3, "c", 1, 3);
  REQUIRE(h.to(2, kRestart).size() == 1);
  h.advance(3s);
  h.join_with(1, "a", 1, 3, [](v1::Join& j) { j.set_shutdown_timeout_ms(10000); });
  CHECK(h.last.empty());
  // b (whose stream stays open, silent) holds the round until the default shutdown timeout
  // plus the margin has passed since the restart; then a and c go ahead at once.
  const auto held = limits::kDefaultShutdownTimeout + limits::kRejoinMargin;
  h.advance(std::chrono::duration_cast<milliseconds>(restart_at + held - h.now) - 1ms);
  CHECK(h.to(1, kAssign).empty());
  h.advance(1ms);
  CHECK(h.assignment(1).group_world_size() == 2);
  CHECK(h.assignment(3).group_world_size() == 2);
  // b's late Join scales the run up once; then the three run together.
  h.join(2, "b", 1, 3);
  CHECK(h.to(1, kRestart).size() == 1);
  h.join(1, "a", 1, 3);
  h.join(3, "c", 1, 3);
  CHECK(h.assignment(2).group_world_size() == 3);
}

TEST_CASE("restart: a survivor that dies before it rejoins no longer holds the round",
          "[rdzv][state_machine]") {
  auto t = Harness::quiet();
  t.last_call_timeout = 30s;
  SECTION("its stream ends") {
    Harness h(t);
    h.join(1, "a", 1, 3, 1);
    h.join(2, "b", 1, 3, 1);
    h.join(3, "c", 1, 3, 1);
    REQUIRE(h.assignment(1).group_world_size() == 3);
    h.fail(3, 1);
    REQUIRE(h.to(2, kRestart).size() == 1);
    h.closed(2);  // b dies while it stops its workers
    CHECK(h.last.empty());
    h.join(1, "a", 1, 3, 1);
    CHECK(h.last.empty());
    h.join(3, "c", 1, 3, 1);  // every surviving member is back: no last call
    CHECK(h.assignment(1).group_world_size() == 2);
    CHECK(h.assignment(3).group_world_size() == 2);
  }
  SECTION("it is dropped for silence") {
    t.keep_alive_interval = 1s;
    t.keep_alive_max_attempt = 2;
    Harness h(t);
    h.join(1, "a", 1, 3, 1);
    h.join(2, "b", 1, 3, 1);
    h.join(3, "c", 1, 3, 1);
    REQUIRE(h.assignment(1).group_world_size() == 3);
    h.fail(3, 1);
    h.join(1, "a", 1, 3, 1);
    h.join(3, "c", 1, 3, 1);
    CHECK(h.to(1, kAssign).empty());  // b is still expected
    h.advance(1s);
    h.keep_alive(1);
    h.keep_alive(3);
    h.advance(1s);  // b silent for the whole window (2 s): dropped, and the round closes then
    CHECK(h.assignment(1).group_world_size() == 2);
    CHECK(h.assignment(3).group_world_size() == 2);
    CHECK(h.sm.status("run")[0].phase() == "running");
    CHECK(h.sm.status("run")[0].members_size() == 2);
  }
}

TEST_CASE("restart: well-behaved agents always reach a steady round with bounded restarts",
          "[rdzv][state_machine]") {
  std::mt19937 rng(20240611);
  for (int trial = 0; trial < 300; ++trial) {
    auto t = Harness::quiet();
    t.last_call_timeout = milliseconds(100 + rng() % 5000);
    t.join_timeout = std::chrono::hours(1);
    const int n = 1 + static_cast<int>(rng() % 6);
    const int min = 1 + static_cast<int>(rng() % n);
    const int max = min + static_cast<int>(rng() % 3);
    std::vector<Agent> agents(n);
    int failures = 0;
    for (int i = 0; i < n; ++i) {
      Agent& a = agents[i];
      a.session = i + 1;
      a.node = "n" + std::to_string(i);
      a.arrival = milliseconds(rng() % 60000);
      a.shutdown_timeout = milliseconds(rng() % 3 == 0 ? 0 : rng() % 20000);
      const auto bound = a.shutdown_timeout.count() == 0 ? limits::kDefaultShutdownTimeout
                                                         : a.shutdown_timeout;
      // Any delay: mostly within its own shutdown timeout, sometimes well past it.
      a.rejoin_delay = milliseconds(rng() % (rng() % 4 == 0 ? 3 * bound.count() + 1
                                                             : bound.count() + 1));
      if (failures < 2 && rng() % 3 == 0) {
        a.fail_at = milliseconds(rng() % 90000);
        ++failures;
      }
    }
    INFO("trial " << trial << ": n=" << n << " nnodes=" << min << ":" << max);
    Outcome r = simulate(agents, min, max, 2, t);
    INFO("phase " << r.phase << " members " << r.members << " waiting " << r.waiting << " restarts " << r.restarts);
    REQUIRE(r.settled);
    CHECK(r.members == std::min(n, max));
    CHECK(r.waiting == n - r.members);
    // Each trigger (an arrival, a failure) restarts the run at most once, plus once per
    // agent the first time it comes back later than its shutdown timeout said (after that
    // it is waited for as long as it took).
    CHECK(r.restarts <= 2 * n + failures);
  }
}

TEST_CASE("holding: a run whose last node leaves is dropped at once, whatever its round",
          "[rdzv][state_machine]") {
  SECTION("stream closed after a round ran") {
    Harness h;
    h.join(1, "a", 1, 1);
    REQUIRE(h.assignment(1).round() == 1);
    h.closed(1);
    CHECK(h.sm.num_runs() == 0);
  }
  SECTION("stream closed while survivors were expected") {
    Harness h;
    h.join(1, "a", 1, 2, 1);
    h.join(2, "b", 1, 2, 1);
    h.fail(1, 1);
    h.closed(1);
    CHECK(h.sm.num_runs() == 1);  // b still holds it
    h.closed(2);
    CHECK(h.sm.num_runs() == 0);
  }
  SECTION("dropped for silence") {
    auto t = Harness::quiet();
    t.keep_alive_interval = 1s;
    t.keep_alive_max_attempt = 2;
    Harness h(t);
    h.join(1, "a", 1, 1);
    REQUIRE(h.assignment(1).round() == 1);
    h.advance(2s);
    CHECK(h.closed_with(1, absl::StatusCode::kUnavailable));
    CHECK(h.sm.num_runs() == 0);
    CHECK_FALSE(h.sm.next_deadline().has_value());
  }
  SECTION("a finished run stays for its grace") {
    Harness h;
    h.join(1, "a", 1, 1);
    h.succeed(1, 1);
    h.closed(1);
    CHECK(h.sm.num_runs() == 1);
    h.advance(Harness::quiet().finished_run_grace);
    CHECK(h.sm.num_runs() == 0);
  }
}

TEST_CASE("holding: at most kMaxRuns runs, one more is refused", "[rdzv][state_machine]") {
  Harness h;
  auto join_run = [&](SessionId s, const std::string& run) {
    return h.join_with(s, "n" + std::to_string(s), 2, 2, [&](v1::Join& j) { j.set_run_id(run); });
  };
  for (std::size_t i = 0; i < limits::kMaxRuns; ++i) {
    join_run(i + 1, "r" + std::to_string(i));
    REQUIRE(h.last.empty());
  }
  CHECK(h.sm.num_runs() == limits::kMaxRuns);
  const SessionId extra = limits::kMaxRuns + 1;
  join_run(extra, "one-too-many");
  CHECK(h.closed_with(extra, absl::StatusCode::kResourceExhausted));
  CHECK_FALSE(h.sm.has_run("one-too-many"));
  join_run(extra + 1, "r0");  // a run that exists still takes joins
  CHECK(h.assignment(1).group_world_size() == 2);
  h.closed(2);  // r1's only node leaves: there is room again
  join_run(extra + 2, "now-fits");
  CHECK(h.last.empty());
  CHECK(h.sm.has_run("now-fits"));
}

TEST_CASE("join: a message larger than the agent bound is refused", "[rdzv][state_machine]") {
  Harness h;
  h.join_with(1, "a", 2, 2, [](v1::Join& j) {
    j.GetReflection()->MutableUnknownFields(&j)->AddLengthDelimited(
        99, std::string(limits::kMaxAgentMessageBytes, 'x'));
  });
  CHECK(h.closed_with(1, absl::StatusCode::kResourceExhausted));
  CHECK(h.sm.num_runs() == 0);
}

TEST_CASE("session: a stream serves one run, joining another leaves no ghost behind",
          "[rdzv][state_machine]") {
  SECTION("a member of a running round") {
    Harness h;
    h.join(1, "a", 2, 2);
    h.join(2, "b", 2, 2);
    REQUIRE(h.assignment(1).group_world_size() == 2);
    h.join_with(1, "a", 2, 2, [](v1::Join& j) { j.set_run_id("other"); });
    const Outgoing* c = h.close_of(1);
    REQUIRE(c != nullptr);
    CHECK(c->status.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(c->status.message()), Catch::Contains("'run'"));
    CHECK_THAT(std::string(c->status.message()), Catch::Contains("'other'"));
    CHECK_FALSE(h.sm.has_run("other"));
    // The ghost is out of "run": b is restarted and waits for a second node alone.
    CHECK(h.to(2, kRestart).size() == 1);
    h.join(2, "b", 2, 2);
    auto st = h.sm.status("run");
    REQUIRE(st.size() == 1);
    CHECK(st[0].members_size() == 0);
    CHECK(st[0].waiting() == 1);
    h.join(3, "c", 2, 2);
    CHECK(h.assignment(2).group_world_size() == 2);
  }
  SECTION("the only waiter of a run") {
    Harness h;
    h.join(1, "a", 2, 2);
    h.join_with(1, "a", 1, 1, [](v1::Join& j) { j.set_run_id("other"); });
    CHECK(h.closed_with(1, absl::StatusCode::kInvalidArgument));
    CHECK(h.sm.num_runs() == 0);
  }
}

TEST_CASE("session: a member that joins again while its round runs leaves the round",
          "[rdzv][state_machine]") {
  Harness h;
  h.join(1, "a", 2, 2);
  h.join(2, "b", 2, 2);
  REQUIRE(h.assignment(1).group_world_size() == 2);
  h.join(1, "a", 2, 2);  // the round is full: without the rule, a would be member and waiter
  CHECK(h.to(2, kRestart).size() == 1);
  h.join(2, "b", 2, 2);
  CHECK(h.assignment(1).round() == 2);
  CHECK(h.assignment(2).round() == 2);
}

TEST_CASE("timing: client durations are clamped and never overflow", "[rdzv][state_machine]") {
  SECTION("a huge join timeout is the bound, not an instant failure") {
    auto t = Harness::quiet();
    t.keep_alive_interval = std::chrono::hours(48);  // out of the way of a 24 h wait
    Harness h(t);
    h.join_with(1, "a", 2, 2, [](v1::Join& j) { j.set_join_timeout_ms(10000000000000); });
    CHECK(h.last.empty());
    h.advance(1s);
    CHECK(h.last.empty());
    h.advance(limits::kMaxJoinTimeout - 1s - 1ms);
    CHECK(h.last.empty());
    h.advance(1ms);
    CHECK(h.closed_with(1, absl::StatusCode::kDeadlineExceeded));
  }
  SECTION("INT64_MAX join and last-call timeouts") {
    Harness h;
    h.join_with(1, "a", 1, 2, [](v1::Join& j) {
      j.set_join_timeout_ms(std::numeric_limits<std::int64_t>::max());
      j.set_last_call_timeout_ms(std::numeric_limits<std::int64_t>::max());
    });
    CHECK(h.last.empty());
    h.advance(limits::kMaxLastCallTimeout - 1ms);
    CHECK(h.last.empty());
    h.advance(1ms);
    CHECK(h.assignment(1).group_world_size() == 1);
  }
  SECTION("INT64_MAX keep-alive interval and INT32_MAX attempts do not drop a node at once") {
    auto t = Harness::quiet();
    t.keep_alive_interval = 1s;
    Harness h(t);
    h.join_with(1, "a", 1, 1, [](v1::Join& j) {
      j.set_keep_alive_interval_ms(std::numeric_limits<std::int64_t>::max());
      j.set_keep_alive_max_attempt(std::numeric_limits<std::int32_t>::max());
    });
    REQUIRE(h.assignment(1).round() == 1);
    for (int i = 0; i < 10; ++i) {
      h.advance(1s);
      CHECK_FALSE(h.closed_with(1, absl::StatusCode::kUnavailable));
    }
    // The window is cut to its bound (six 10-minute attempts), and noticed exactly there.
    const auto rule = limits::kMaxLivenessWindow;
    h.advance(rule - 10s - 1ms);
    CHECK_FALSE(h.closed_with(1, absl::StatusCode::kUnavailable));
    h.advance(1ms);
    CHECK(h.closed_with(1, absl::StatusCode::kUnavailable));
  }
  SECTION("negative durations mean the server's default") {
    auto t = Harness::quiet();
    t.join_timeout = 10s;
    t.keep_alive_interval = 1s;
    t.keep_alive_max_attempt = 100;
    Harness h(t);
    h.join_with(1, "a", 2, 2, [](v1::Join& j) {
      j.set_join_timeout_ms(-1);
      j.set_last_call_timeout_ms(-5);
      j.set_keep_alive_interval_ms(std::numeric_limits<std::int64_t>::min());
      j.set_keep_alive_max_attempt(-3);
      j.set_shutdown_timeout_ms(-7);
    });
    CHECK(h.last.empty());
    h.advance(1s);
    h.keep_alive(1);
    h.advance(1s);
    h.keep_alive(1);
    CHECK(h.only_keep_alive_answers());
    h.advance(8s);  // the default join timeout (10 s), not 0 and not "never"
    CHECK(h.closed_with(1, absl::StatusCode::kDeadlineExceeded));
  }
  SECTION("an INT64_MAX shutdown timeout holds the round for the bound only") {
    Harness h;
    h.join_with(1, "a", 1, 2, [](v1::Join& j) {
      j.set_shutdown_timeout_ms(std::numeric_limits<std::int64_t>::max());
    });
    h.advance(Harness::quiet().last_call_timeout);
    REQUIRE(h.assignment(1).round() == 1);
    h.join(2, "b", 1, 2);
    REQUIRE(h.to(1, kRestart).size() == 1);
    h.advance(limits::kMaxShutdownTimeout + limits::kRejoinMargin - 1ms);
    CHECK(h.to(2, kAssign).empty());
    h.advance(1ms);
    // a no longer holds it; with nobody else expected back, b gets the usual last call.
    CHECK(h.to(2, kAssign).empty());
    h.advance(Harness::quiet().last_call_timeout);
    CHECK(h.assignment(2).group_world_size() == 1);
  }
}

TEST_CASE("join: a node range whose world could overflow int32 is refused", "[rdzv][state_machine]") {
  Harness h;
  // 65,536 workers on each of up to 2^20 nodes: 2^36 ranks.
  h.join_with(1, "a", 1, muster::rendezvous::kMaxNodes,
              [](v1::Join& j) { j.set_local_world_size(muster::rendezvous::kMaxLocalWorldSize); });
  const Outgoing* o = h.close_of(1);
  REQUIRE(o != nullptr);
  CHECK(o->status.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(o->status.message()), Catch::Contains("2^31-1"));
  CHECK(h.sm.num_runs() == 0);
  Harness ok;  // the largest nodes of the largest run that still fits
  ok.join_with(1, "a", 1, 1,
              [](v1::Join& j) { j.set_local_world_size(muster::rendezvous::kMaxLocalWorldSize); });
  CHECK(ok.assignment(1).world_size() == muster::rendezvous::kMaxLocalWorldSize);
}

TEST_CASE("join: ids that are not valid UTF-8 are refused with a message", "[rdzv][state_machine]") {
  struct Case {
    const char* what;
    std::function<void(v1::Join&)> edit;
  };
  const std::vector<Case> cases = {
      {"run id", [](v1::Join& j) { j.set_run_id("run\xff"); }},
      {"node id", [](v1::Join& j) { j.set_node_id("\xc0\x80"); }},           // overlong NUL
      {"host", [](v1::Join& j) { j.set_host("h\xed\xa0\x80"); }},             // a surrogate
      {"host", [](v1::Join& j) { j.set_host("\xf4\x90\x80\x80"); }},          // past U+10FFFF
      {"node id", [](v1::Join& j) { j.set_node_id("\xe2\x82"); }},            // cut short
  };
  for (const Case& c : cases) {
    Harness h;
    h.join_with(1, "a", 1, 1, c.edit);
    const Outgoing* o = h.close_of(1);
    REQUIRE(o != nullptr);
    CHECK(o->status.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(o->status.message()), Catch::Contains(c.what));
    CHECK_THAT(std::string(o->status.message()), Catch::Contains("UTF-8"));
    CHECK(h.sm.num_runs() == 0);
  }
  Harness h;
  h.join_with(1, "caf\xc3\xa9-\xe3\x83\x8e\xe3\x83\xbc\xe3\x83\x89", 1, 1,
              [](v1::Join& j) { j.set_host("\xf0\x9f\x9a\x80.example"); });
  CHECK(h.assignment(1).round() == 1);
}

TEST_CASE("failure: reports are cut to the bounds before they are forwarded",
          "[rdzv][state_machine]") {
  Harness h;
  h.join(1, "a", 1, 1);
  v1::AgentMsg m;
  v1::ReportFailure* f = m.mutable_failure();
  f->set_round(1);
  f->mutable_root_cause()->set_rank(0);
  f->mutable_root_cause()->set_message("RuntimeError: " + std::string(12000, 'm'));
  f->mutable_root_cause()->set_traceback("Traceback\n" + std::string(20000, 't') + "\nthe end\n");
  for (int i = 0; i < 30; ++i) {
    v1::WorkerFailure* o = f->add_others();
    o->set_rank(i + 1);
    o->set_message(std::string(500, 'o'));
  }
  REQUIRE(m.ByteSizeLong() < limits::kMaxAgentMessageBytes);
  h.send(1, m);
  auto fails = h.to(1, kFail);
  REQUIRE(fails.size() == 1);
  const v1::Fail& fail = fails[0].fail();
  const v1::WorkerFailure& rc = fail.root_cause();
  CHECK(rc.message().size() <= limits::kMaxFailureMessageBytes);
  CHECK_THAT(rc.message(), Catch::StartsWith("RuntimeError: mmm"));
  CHECK_THAT(rc.message(), Catch::Contains("cut"));
  CHECK(rc.traceback().size() <= limits::kMaxFailureTracebackBytes);
  CHECK_THAT(rc.traceback(), Catch::EndsWith("\nthe end\n"));
  CHECK_THAT(rc.traceback(), Catch::Contains("cut"));
  CHECK(static_cast<std::size_t>(fail.others_size()) <= limits::kMaxFailureOthers);
  CHECK(fail.others(0).rank() == 1);
  for (const auto& o : fail.others()) CHECK(o.message().size() <= limits::kMaxFailureMessageBytes);
  CHECK(fail.ByteSizeLong() < limits::kMaxServerMessageBytes);
}

TEST_CASE("ticks: a steady round is never restarted by time alone", "[rdzv][state_machine]") {
  auto t = Harness::quiet();
  t.keep_alive_interval = 1s;
  t.keep_alive_max_attempt = 3;
  t.last_call_timeout = 1s;
  Harness h(t);
  h.join(1, "a", 2, 3);
  h.join(2, "b", 2, 3);
  h.advance(1s);
  REQUIRE(h.assignment(1).group_world_size() == 2);
  int restarts = 0;
  int other = 0;  // steps that sent anything but keep-alive answers, or closed a stream
  for (int i = 0; i < 5000; ++i) {
    h.advance(milliseconds(500 + i % 700));
    restarts += static_cast<int>(h.to(1, kRestart).size() + h.to(2, kRestart).size());
    other += h.only_keep_alive_answers() ? 0 : 1;
    h.keep_alive(1);
    other += h.only_keep_alive_answers() ? 0 : 1;
    h.keep_alive(2);
    other += h.only_keep_alive_answers() ? 0 : 1;
  }
  CHECK(restarts == 0);
  CHECK(other == 0);
  // And the round is still the one that formed, with both nodes, its budget untouched.
  const auto runs = h.sm.status("");
  REQUIRE(runs.size() == 1);
  CHECK(runs[0].phase() == "running");
  CHECK(runs[0].round() == 1);
  CHECK(runs[0].members_size() == 2);
  CHECK(runs[0].restart_count() == 0);
}

TEST_CASE("restart: two nodes slower than their shutdown timeout do not take turns for ever",
          "[rdzv][state_machine]") {
  // Each needs 30-40 s to stop but says 10 s: the round closes without whichever is late, and
  // its Join restarts the run, which then leaves the other behind. Held for as long as it
  // took last time, each is late at most once.
  auto t = Harness::quiet();
  t.last_call_timeout = 2s;
  std::vector<Agent> agents(4);
  for (int i = 0; i < 4; ++i) {
    agents[i].session = i + 1;
    agents[i].node = "n" + std::to_string(i);
    agents[i].shutdown_timeout = 10s;
    agents[i].rejoin_delay = i < 2 ? 30s + i * 10s : 2s;  // a 30 s, b 40 s: never together
    agents[i].arrival = milliseconds(i * 100);
  }
  agents[0].fail_at = 10s;
  Outcome r = simulate(agents, 2, 4, 1, t);
  CHECK(r.settled);
  CHECK(r.members == 4);
  CHECK(r.restarts <= 4);
}

TEST_CASE("keep-alive: nodes silent at one check are dropped together, with one restart",
          "[rdzv][state_machine]") {
  auto t = Harness::quiet();
  t.keep_alive_interval = 1s;
  t.keep_alive_max_attempt = 2;
  Harness h(t);
  h.join(1, "a", 1, 2);
  h.join(2, "b", 1, 2);
  REQUIRE(h.assignment(1).group_world_size() == 2);
  h.join(3, "c", 1, 2);  // spares
  h.join(4, "d", 1, 2);
  h.advance(1s);
  h.keep_alive(4);  // only d keeps talking
  h.advance(1s);
  for (SessionId s : {1, 2, 3}) CHECK(h.closed_with(s, absl::StatusCode::kUnavailable));
  // Dropped one by one, c would have been given a round with d and then dropped from it.
  for (SessionId s : {1, 2, 3, 4}) CHECK(h.to(s, kAssign).empty());
  CHECK(h.sm.check_invariants().ok());
  for (int i = 0; i < 30; ++i) {  // d alone forms the next round, after the last call
    h.keep_alive(4);
    h.advance(1s);
  }
  CHECK(h.assignment(4).group_world_size() == 1);
}

TEST_CASE("join timeout: survivors that never come back are told too", "[rdzv][state_machine]") {
  auto t = Harness::quiet();
  t.join_timeout = 10s;
  Harness h(t);
  auto slow = [](v1::Join& j) { j.set_shutdown_timeout_ms(20000); };
  h.join_with(1, "a", 2, 2, slow, 1);
  h.join_with(2, "b", 2, 2, slow, 1);
  REQUIRE(h.assignment(1).group_world_size() == 2);
  h.fail(1, 1);
  h.join_with(1, "a", 2, 2, slow, 1);
  // b holds the round for 25 s, longer than the join timeout: the timeout waits for it.
  h.advance(10s);
  CHECK(h.last.empty());
  h.advance(15s);
  CHECK(h.closed_with(1, absl::StatusCode::kDeadlineExceeded));
  CHECK(h.closed_with(2, absl::StatusCode::kDeadlineExceeded));  // not left in a dropped run
  CHECK(h.sm.num_runs() == 0);
}

TEST_CASE("join: the token and unknown fields are not kept", "[rdzv][state_machine]") {
  Harness h;
  h.join_with(1, "a", 2, 2, [](v1::Join& j) {
    j.set_token("secret");
    j.GetReflection()->MutableUnknownFields(&j)->AddLengthDelimited(77, "unknown");
  });
  CHECK(h.last.empty());
  CHECK(h.sm.check_invariants().ok());  // which checks what every stored Join holds
}

TEST_CASE("utf-8: the validator", "[rdzv][state_machine]") {
  using muster::ops::is_valid_utf8;
  CHECK(is_valid_utf8(""));
  CHECK(is_valid_utf8("plain ascii"));
  CHECK(is_valid_utf8("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x9a\x80 \xf4\x8f\xbf\xbf"));
  CHECK(is_valid_utf8(std::string("nul\0inside", 10)));
  CHECK_FALSE(is_valid_utf8("\x80"));              // a lone continuation byte
  CHECK_FALSE(is_valid_utf8("\xc3"));              // cut short
  CHECK_FALSE(is_valid_utf8("\xc3\x28"));          // a bad continuation
  CHECK_FALSE(is_valid_utf8("\xc1\xbf"));          // overlong (2 bytes)
  CHECK_FALSE(is_valid_utf8("\xe0\x9f\xbf"));      // overlong (3 bytes)
  CHECK_FALSE(is_valid_utf8("\xf0\x8f\xbf\xbf"));  // overlong (4 bytes)
  CHECK_FALSE(is_valid_utf8("\xed\xbf\xbf"));      // a surrogate
  CHECK_FALSE(is_valid_utf8("\xf4\x90\x80\x80"));  // above U+10FFFF
  CHECK_FALSE(is_valid_utf8("\xf8\x88\x80\x80\x80"));
  CHECK_FALSE(is_valid_utf8("\xff"));
}

TEST_CASE("failure: cutting keeps characters whole and the restart reason parseable",
          "[rdzv][state_machine]") {
  using muster::rendezvous::cap_failure;
  using muster::ops::is_valid_utf8;
  v1::WorkerFailure f;
  std::string euros;
  while (euros.size() < 3 * limits::kMaxFailureTracebackBytes) euros += "\xe2\x82\xac";
  f.set_message(euros);
  f.set_traceback(euros);
  v1::WorkerFailure c = cap_failure(f);
  CHECK(c.message().size() <= limits::kMaxFailureMessageBytes);
  CHECK(c.traceback().size() <= limits::kMaxFailureTracebackBytes);
  CHECK(is_valid_utf8(c.message()));
  CHECK(is_valid_utf8(c.traceback()));
  CHECK_THAT(c.message(), Catch::Contains("cut"));
  v1::WorkerFailure small;
  small.set_message("short");
  CHECK(cap_failure(small).message() == "short");

  // A failing host's name is a client's bytes; the Restart reason is a `string` field that
  // an agent cannot parse unless it is UTF-8.
  Harness h;
  h.join(1, "a", 1, 1, 1);
  v1::AgentMsg m;
  m.mutable_failure()->set_round(1);
  m.mutable_failure()->mutable_root_cause()->set_host("bad\xff\xfehost");
  h.send(1, m);
  auto r = h.to(1, kRestart);
  REQUIRE(r.size() == 1);
  CHECK(is_valid_utf8(r[0].restart().reason()));
  std::string wire;
  REQUIRE(r[0].SerializeToString(&wire));
  v1::ServerMsg back;
  CHECK(back.ParseFromString(wire));
}

// --hang_timeout (docs/hangs.md): the server applies the stall rule over every node's ranks.
namespace {

v1::AgentMsg progress_msg(int round, std::vector<std::tuple<int, std::uint64_t, std::uint64_t,
                                                            std::string, std::int64_t>> ranks) {
  v1::AgentMsg m;
  m.mutable_progress()->set_round(round);
  for (const auto& [rank, step, reports, phase, still_ms] : ranks) {
    v1::RankProgress* r = m.mutable_progress()->add_ranks();
    r->set_rank(rank);
    r->set_local_rank(0);
    r->set_pid(500 + rank);
    r->set_step(step);
    r->set_reports(reports);
    r->set_phase(phase);
    r->set_still_ms(still_ms);
  }
  return m;
}

const v1::Stalled* stalled_to(const std::vector<Outgoing>& out, SessionId s) {
  for (const Outgoing& o : out) {
    if (o.session == s && o.msg && o.msg->has_stalled()) return &o.msg->stalled();
  }
  return nullptr;
}

int stalled_count(const std::vector<Outgoing>& out) {
  int n = 0;
  for (const Outgoing& o : out) n += o.msg && o.msg->has_stalled();
  return n;
}

}  // namespace

TEST_CASE("hang: a rank behind on one node while another node got further is named to its node",
          "[state_machine][hang]") {
  Harness h;
  auto with_hang = [](v1::Join& j) {
    j.set_hang_timeout_ms(2000);
    j.set_local_world_size(1);
  };
  h.join_with(1, "a", 2, 2, with_hang);
  h.join_with(2, "b", 2, 2, with_hang);
  REQUIRE(h.last.size() == 2);  // the round closed: two Assignments
  for (const Outgoing& o : h.last) CHECK(o.msg->assignment().hang_timeout_ms() == 2000);
  const int round = h.last[0].msg->assignment().round();
  const int rank_a = h.last[0].session == 1 ? h.last[0].msg->assignment().rank_offset()
                                            : h.last[1].msg->assignment().rank_offset();
  const int rank_b = 1 - rank_a;
  // Each node has one rank: no node alone could tell. b's rank is in the step's all_reduce,
  // a's still loading data, for 1.5 s: not yet.
  h.send(2, progress_msg(round, {{rank_b, 10, 32, "all_reduce", 0}}));
  h.send(1, progress_msg(round, {{rank_a, 10, 31, "data_loader", 1500}}));
  CHECK(stalled_count(h.last) == 0);
  // Half a second later a's rank has been still for 2 s: a is told, b is not.
  h.now += 500ms;
  h.send(1, progress_msg(round, {{rank_a, 10, 31, "data_loader", 2000}}));
  const v1::Stalled* s = stalled_to(h.last, 1);
  REQUIRE(s != nullptr);
  CHECK(stalled_to(h.last, 2) == nullptr);
  CHECK(s->round() == round);
  CHECK(s->rank() == rank_a);
  CHECK(s->description() == "rank " + std::to_string(rank_a) +
                                " (host host-a, local rank 0, pid " +
                                std::to_string(500 + rank_a) +
                                ") stuck at step 10 in phase 'data_loader' for 2.0 s; 1 rank got "
                                "further (up to step 10)");
  // Once per round.
  h.now += 1s;
  h.send(1, progress_msg(round, {{rank_a, 10, 31, "data_loader", 3000}}));
  CHECK(stalled_count(h.last) == 0);
  // A report of another round, or with more ranks than the node has, is not taken.
  h.send(2, progress_msg(round + 5, {{rank_b, 1, 1, "x", 99999}}));
  CHECK(stalled_count(h.last) == 0);
  h.send(2, progress_msg(round, {{rank_b, 1, 1, "x", 0}, {7, 1, 1, "y", 0}}));
  REQUIRE(h.last.size() >= 1);
  CHECK(h.last[0].close);
  CHECK(h.last[0].status.code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("hang: ranks all still at one position, or a run without --hang_timeout, are left alone",
          "[state_machine][hang]") {
  Harness h;
  auto one = [](v1::Join& j) { j.set_local_world_size(1); };
  h.join_with(1, "a", 2, 2, one);
  h.join_with(2, "b", 2, 2, one);
  const int round = h.last[0].msg->assignment().round();
  CHECK(h.last[0].msg->assignment().hang_timeout_ms() == 0);
  h.send(1, progress_msg(round, {{0, 3, 9, "data_loader", 60000}}));
  h.send(2, progress_msg(round, {{1, 9, 30, "all_reduce", 0}}));
  CHECK(stalled_count(h.last) == 0);  // no timeout for this run

  muster::rendezvous::RendezvousTimeouts t = Harness::quiet();
  t.hang_timeout = 2s;  // rdzvd --hang_timeout=2: the run's default
  Harness d(t);
  d.join_with(1, "a", 2, 2, one);
  d.join_with(2, "b", 2, 2, one);
  const int r2 = d.last[0].msg->assignment().round();
  CHECK(d.last[0].msg->assignment().hang_timeout_ms() == 2000);
  d.send(1, progress_msg(r2, {{0, 5, 20, "barrier", 60000}}));
  d.send(2, progress_msg(r2, {{1, 5, 20, "barrier", 60000}}));
  CHECK(stalled_count(d.last) == 0);  // a minute at one barrier: nobody got further
}

TEST_CASE("budget: rounds in which no rank made a step stop the job, do not requeue",
          "[state_machine][hang]") {
  Harness h;
  auto conf = [](v1::Join& j) {
    j.set_local_world_size(1);
    j.set_max_restarts_without_progress(2);
  };
  h.join_with(1, "a", 1, 1, conf, /*max_restarts=*/10);
  REQUIRE(h.last.size() == 1);
  CHECK(h.last[0].msg->assignment().wants_progress());
  for (int attempt = 0; attempt < 3; ++attempt) {
    const int round = h.last[0].msg->assignment().round();
    h.send(1, progress_msg(round, {{0, 0, 1, "data_loader", 0}}));  // step 0, then it fails
    h.fail(1, round);
    REQUIRE_FALSE(h.last.empty());
    if (attempt < 2) {  // two restarts in a row without a step are allowed
      REQUIRE(h.last[0].msg->has_restart());
      h.join_with(1, "a", 1, 1, conf, 10);
      continue;
    }
    REQUIRE(h.last[0].msg->has_fail());
    CHECK(h.last[0].msg->fail().do_not_requeue());
    CHECK_THAT(h.last[0].msg->fail().reason(),
               Catch::Contains("3 rounds in a row before any rank made a step"));
  }
  CHECK(h.sm.check_invariants().ok());
}

TEST_CASE("budget: a round with a step resets the count in a row, long progress gets the "
          "budget back", "[state_machine][hang]") {
  Harness h;
  auto conf = [](v1::Join& j) {
    j.set_local_world_size(1);
    j.set_max_restarts_without_progress(1);
    j.set_restart_budget_reset_after_steps(100);
  };
  h.join_with(1, "a", 1, 1, conf, /*max_restarts=*/2);
  auto round_with = [&](std::uint64_t from, std::uint64_t to) {
    const int round = h.last[0].msg->assignment().round();
    h.send(1, progress_msg(round, {{0, from, 1, "train", 0}}));
    h.send(1, progress_msg(round, {{0, to, 2, "train", 0}}));
    h.fail(1, round);
    REQUIRE_FALSE(h.last.empty());
  };
  round_with(0, 0);  // no step: 1 in a row, allowed
  REQUIRE(h.last[0].msg->has_restart());
  CHECK(h.last[0].msg->restart().restart_count() == 1);
  h.join_with(1, "a", 1, 1, conf, 2);
  round_with(0, 5);  // steps: the count in a row starts again; the second restart of 2
  REQUIRE(h.last[0].msg->has_restart());
  CHECK(h.last[0].msg->restart().restart_count() == 2);
  h.join_with(1, "a", 1, 1, conf, 2);
  // Both restarts are spent, but this round made 150 steps: the budget is back.
  round_with(5, 155);
  REQUIRE(h.last[0].msg->has_restart());
  CHECK_THAT(h.last[0].msg->restart().reason(),
             Catch::Contains("restart 1 of 2 (150 steps made: the restart budget is back)"));
  CHECK(h.last[0].msg->restart().restart_count() == 3);  // the workers' count still grows
  h.join_with(1, "a", 1, 1, conf, 2);
  CHECK(h.last[0].msg->assignment().restart_count() == 3);
  round_with(155, 160);
  REQUIRE(h.last[0].msg->has_restart());  // 2 of 2
  h.join_with(1, "a", 1, 1, conf, 2);
  round_with(160, 161);
  REQUIRE(h.last[0].msg->has_fail());  // spent, and 1 step is not long progress
  CHECK_FALSE(h.last[0].msg->fail().do_not_requeue());
  CHECK(h.sm.check_invariants().ok());
}

// The straggler watch (docs/stragglers.md): each node's pages with their time per phase kind,
// scored over every rank of the round; a name is an event and part of the status, and a new
// round clears it.
namespace {

void watching(v1::Join& j) {
  j.set_watch_stragglers(true);
  j.set_local_world_size(1);
}

// Nodes a, b and c (sessions 1-3, one rank each) in a watched round of three.
void three_watched(Harness& h) {
  h.join_with(1, "a", 3, 3, watching);
  h.join_with(2, "b", 3, 3, watching);
  h.join_with(3, "c", 3, 3, watching);
  REQUIRE(h.last.size() == 3);
}

}  // namespace

TEST_CASE("stragglers: the server names a rank whose own work per step is twice the others', "
          "in events and status, and clears it with the round",
          "[state_machine][stragglers]") {
  Harness h;
  three_watched(h);
  for (const Outgoing& o : h.last) {
    CHECK(o.msg->assignment().watch_stragglers());
    CHECK(o.msg->assignment().wants_progress());
  }
  const int round = h.last[0].msg->assignment().round();
  std::map<SessionId, int> rank;
  for (const Outgoing& o : h.last) rank[o.session] = o.msg->assignment().rank_offset();
  // Each step: 70 ms of own work (10 data, 55 compute, 5 optimizer); node c's rank works
  // twice as long, the others wait for it in the all-reduce.
  std::map<SessionId, std::array<std::uint64_t, 5>> kinds;
  std::vector<RunEvent> events;
  const std::uint64_t ms = 1'000'000;
  for (std::uint64_t step = 1; step <= 40; ++step) {
    for (SessionId s : {1, 2, 3}) {
      const std::uint64_t f = s == 3 ? 2 : 1;
      auto& k = kinds[s];
      k[0] += 10 * ms * f;
      k[1] += 55 * ms * f;
      k[2] += (s == 3 ? 2 : 72) * ms;
      k[3] += 5 * ms * f;
      v1::AgentMsg m = progress_msg(round, {{rank[s], step, step, "forward", 0}});
      for (std::uint64_t v : k) m.mutable_progress()->mutable_ranks(0)->add_kind_ns(v);
      Decision d = h.sm.on_message(s, m, h.now);
      for (RunEvent& e : d.events) events.push_back(std::move(e));
    }
    h.now += 140ms;  // a step of the slow rank's
  }
  std::vector<RunEvent> named;
  for (const RunEvent& e : events) {
    if (e.kind == RunEvent::Kind::kStragglerNamed) named.push_back(e);
  }
  REQUIRE(named.size() == 1);
  CHECK(named[0].rank == rank[3]);
  CHECK(named[0].host == "host-c");
  CHECK(named[0].node_id == "c");
  CHECK(named[0].cause == "compute");
  CHECK(named[0].slowdown == Approx(2.0).epsilon(0.05));
  CHECK(named[0].step <= 30);
  CHECK(named[0].reason.find("rank " + std::to_string(rank[3]) + " on host host-c: 2.0x") == 0);

  auto status = h.sm.status("run", h.now);
  REQUIRE(status.size() == 1);
  CHECK(status[0].watching_stragglers());
  REQUIRE(status[0].stragglers_size() == 1);
  CHECK(status[0].stragglers(0).rank() == rank[3]);
  CHECK(status[0].stragglers(0).node_id() == "c");
  CHECK(status[0].stragglers(0).age_ms() > 0);

  // A phase-kind list longer than the kinds there are is refused at the edge.
  v1::AgentMsg bad = progress_msg(round, {{rank[1], 41, 41, "forward", 0}});
  for (int i = 0; i < 6; ++i) bad.mutable_progress()->mutable_ranks(0)->add_kind_ns(1);
  h.send(1, bad);
  REQUIRE(h.close_of(1) != nullptr);
  CHECK(h.close_of(1)->status.code() == absl::StatusCode::kInvalidArgument);

  // That node is gone: its run restarts, and the next round (b and c again, d new) clears the
  // name, an event, and the status.
  std::vector<RunEvent> later;
  auto take = [&later](Decision d) {
    for (RunEvent& e : d.events) later.push_back(std::move(e));
  };
  take(h.sm.on_stream_closed(1, h.now));
  for (auto [s, node] : {std::pair<SessionId, std::string>{2, "b"}, {3, "c"}, {4, "d"}}) {
    v1::AgentMsg j = Harness::join_msg(node, 3, 3);
    watching(*j.mutable_join());
    take(h.sm.on_message(s, j, h.now));
  }
  int cleared = 0, formed = 0;
  for (const RunEvent& e : later) {
    cleared += e.kind == RunEvent::Kind::kStragglerCleared && e.rank == rank[3];
    formed += e.kind == RunEvent::Kind::kRoundFormed;
  }
  CHECK(formed == 1);
  CHECK(cleared == 1);
  status = h.sm.status("run", h.now);
  REQUIRE(status.size() == 1);
  CHECK(status[0].round() == round + 1);
  CHECK(status[0].stragglers_size() == 0);
}

// Exclusion (launch --exclude_stragglers; docs/stragglers.md, "Exclusion"): a named
// straggler's node leaves the world once keeping it costs more than a re-form, the others
// restart in place without it, its Join is refused until its cool-down is over, and the next
// exclusion of the same node doubles the cool-down. At MIN nodes with no spare it is kept.
namespace {

struct StragglerJob {
  Harness h;
  std::map<SessionId, std::array<std::uint64_t, 5>> kinds;
  std::vector<RunEvent> events;
  int round = 0;
  std::map<SessionId, int> rank;

  static void excluding(v1::Join& j) {
    j.set_exclude_stragglers(true);
    j.set_straggler_cooldown_ms(10'000);
    j.set_in_place(true);
    j.set_local_world_size(1);
  }
  void take(std::vector<Outgoing>& out) {
    for (const Outgoing& o : out) {
      if (o.msg && o.msg->has_assignment()) {
        round = o.msg->assignment().round();
        rank[o.session] = o.msg->assignment().rank_offset();
      }
    }
  }
  void join(SessionId s, const std::string& node, int min, int max) {
    Decision d = h.sm.on_message(s, [&] {
      v1::AgentMsg m = Harness::join_msg(node, min, max);
      excluding(*m.mutable_join());
      return m;
    }(), h.now);
    for (RunEvent& e : d.events) events.push_back(std::move(e));
    h.last = std::move(d.messages);
    take(h.last);
  }
  // One step of each session's rank: 70 ms of own work, `slow` sessions twice that; stops
  // early (true) when a step's reports restarted the round.
  bool step(std::uint64_t n, const std::set<SessionId>& sessions, SessionId slow) {
    const std::uint64_t ms = 1'000'000;
    h.last.clear();
    for (SessionId s : sessions) {
      const std::uint64_t f = s == slow ? 2 : 1;
      auto& k = kinds[s];
      k[0] += 10 * ms * f;
      k[1] += 55 * ms * f;
      k[2] += (s == slow ? 2 : 72) * ms;
      k[3] += 5 * ms * f;
      v1::AgentMsg m = progress_msg(round, {{rank[s], n, n, "forward", 0}});
      for (std::uint64_t v : k) m.mutable_progress()->mutable_ranks(0)->add_kind_ns(v);
      Decision d = h.sm.on_message(s, m, h.now);
      for (RunEvent& e : d.events) events.push_back(std::move(e));
      for (Outgoing& o : d.messages) h.last.push_back(std::move(o));
      for (const Outgoing& o : h.last) {
        if (o.msg && o.msg->has_restart()) return true;
      }
    }
    h.now += 140ms;
    return false;
  }
  // Nodes a, b and c (sessions 1-3) in a round of nnodes=min:max.
  void three(int min, int max) {
    join(1, "a", min, max);
    join(2, "b", min, max);
    join(3, "c", min, max);
    REQUIRE(round == 1);
  }
  int count(RunEvent::Kind kind) const {
    return static_cast<int>(std::count_if(events.begin(), events.end(),
                                          [kind](const RunEvent& e) { return e.kind == kind; }));
  }
};

}  // namespace

TEST_CASE("exclusion: a straggler's node leaves in place, is kept out for its cool-down, and "
          "the next exclusion doubles it",
          "[state_machine][stragglers]") {
  StragglerJob job;
  job.three(2, 3);
  std::uint64_t n = 1;
  bool restarted = false;
  for (; n <= 80 && !restarted; ++n) restarted = job.step(n, {1, 2, 3}, 3);
  REQUIRE(restarted);
  CHECK(job.count(RunEvent::Kind::kStragglerNamed) == 1);
  REQUIRE(job.count(RunEvent::Kind::kStragglerExcluded) == 1);
  const RunEvent& x = *std::find_if(job.events.begin(), job.events.end(), [](const RunEvent& e) {
    return e.kind == RunEvent::Kind::kStragglerExcluded;
  });
  CHECK(x.node_id == "c");
  CHECK(x.rank == job.rank[3]);
  CHECK(x.cause == "compute");
  CHECK(x.cooldown == 10s);
  CHECK(x.times_excluded == 1);
  // Not at once: once what it cost since its naming (half of each step) passed a re-form's
  // (limits::kDefaultReformCost), so at least 15 steps of 140 ms after it was named.
  const RunEvent& named = *std::find_if(job.events.begin(), job.events.end(), [](const RunEvent& e) {
    return e.kind == RunEvent::Kind::kStragglerNamed;
  });
  CHECK(x.at - named.at >= 2s);
  // The node is told with its cool-down; the others get a plain restart naming its rank.
  auto to_c = job.h.to(3, kRestart);
  REQUIRE(to_c.size() == 1);
  CHECK(to_c[0].restart().excluded_ms() == 10'000);
  for (SessionId s : {1, 2}) {
    auto r = job.h.to(s, kRestart);
    REQUIRE(r.size() == 1);
    CHECK(r[0].restart().excluded_ms() == 0);
    CHECK_THAT(r[0].restart().reason(), Catch::Contains("excluded as a straggler"));
    REQUIRE(r[0].restart().lost_ranks_size() == 1);
    CHECK(r[0].restart().lost_ranks(0) == job.rank[3]);
  }
  auto restart = std::find_if(job.events.begin(), job.events.end(), [](const RunEvent& e) {
    return e.kind == RunEvent::Kind::kRestart;
  });
  REQUIRE(restart != job.events.end());
  CHECK(restart->cause == "straggler_excluded");
  CHECK_FALSE(restart->counts);

  // The survivors come back in place: a round of two, at once.
  job.join(1, "a", 2, 3);
  job.join(2, "b", 2, 3);
  REQUIRE(job.round == 2);
  CHECK(job.h.to(3, kAssign).empty());
  auto st = job.h.sm.status("run", job.h.now);
  REQUIRE(st.size() == 1);
  CHECK(st[0].members_size() == 2);
  CHECK(st[0].excluding_stragglers());
  REQUIRE(st[0].excluded_size() == 1);
  CHECK(st[0].excluded(0).node_id() == "c");
  CHECK(st[0].excluded(0).times() == 1);
  CHECK(st[0].excluded(0).left_ms() > 9'000);
  CHECK(job.h.sm.check_invariants().ok());

  // Its Join within the cool-down is refused, saying when it may come back.
  job.join(3, "c", 2, 3);
  REQUIRE(job.h.closed_with(3, absl::StatusCode::kFailedPrecondition));
  CHECK_THAT(std::string(job.h.close_of(3)->status.message()),
             Catch::Contains("may join again in"));
  // After it, the node joins (a new stream): the run scales up to three in place.
  job.h.now += 10s;
  job.join(4, "c", 2, 3);
  auto up = job.h.to(1, kRestart);
  REQUIRE(up.size() == 1);
  job.join(1, "a", 2, 3);
  job.join(2, "b", 2, 3);
  REQUIRE(job.round == 3);
  // Slow again: excluded again, for twice as long.
  restarted = false;
  for (std::uint64_t k = 0; k < 80 && !restarted; ++k, ++n) restarted = job.step(n, {1, 2, 4}, 4);
  REQUIRE(restarted);
  auto again = job.h.to(4, kRestart);
  REQUIRE(again.size() == 1);
  CHECK(again[0].restart().excluded_ms() == 20'000);
  st = job.h.sm.status("run", job.h.now);
  REQUIRE(st[0].excluded_size() == 1);
  CHECK(st[0].excluded(0).times() == 2);
  CHECK(job.h.sm.check_invariants().ok());
}

TEST_CASE("exclusion: at MIN nodes with no spare the straggler is kept, and says why",
          "[state_machine][stragglers]") {
  StragglerJob job;
  job.join(1, "a", 2, 2);
  job.join(2, "b", 2, 2);
  REQUIRE(job.round == 1);
  for (std::uint64_t n = 1; n <= 80; ++n) REQUIRE_FALSE(job.step(n, {1, 2}, 2));
  CHECK(job.count(RunEvent::Kind::kStragglerNamed) == 1);
  CHECK(job.count(RunEvent::Kind::kStragglerExcluded) == 0);
  auto st = job.h.sm.status("run", job.h.now);
  REQUIRE(st[0].stragglers_size() == 1);
  CHECK_THAT(st[0].stragglers(0).kept(), Catch::Contains("at MIN nodes (2)"));
  CHECK(st[0].excluded_size() == 0);
}

TEST_CASE("stragglers: a node whose links are all slow is named with cause network, in events "
          "and status, and a report beyond the link bound is refused",
          "[state_machine][stragglers]") {
  Harness h;
  three_watched(h);
  const int round = h.last[0].msg->assignment().round();
  std::map<SessionId, int> rank;
  for (const Outgoing& o : h.last) rank[o.session] = o.msg->assignment().rank_offset();
  const std::map<SessionId, std::pair<std::string, std::string>> ring{
      {1, {"10.0.0.1", "10.0.0.2"}}, {2, {"10.0.0.2", "10.0.0.3"}}, {3, {"10.0.0.3", "10.0.0.1"}}};
  std::vector<RunEvent> events;
  for (std::uint64_t step = 1; step <= 8; ++step) {
    for (SessionId s : {1, 2, 3}) {
      v1::AgentMsg m = progress_msg(round, {{rank[s], step, step, "forward", 0}});
      v1::LinkRate* l = m.mutable_progress()->add_links();
      l->set_local(ring.at(s).first);
      l->set_remote(ring.at(s).second);
      l->set_mbps(s == 1 ? 50 : 10);  // b -> c and c -> a go through c's capped link
      Decision d = h.sm.on_message(s, m, h.now);
      for (RunEvent& e : d.events) events.push_back(std::move(e));
    }
    h.now += 300ms;
  }
  std::vector<RunEvent> named;
  for (const RunEvent& e : events) {
    if (e.kind == RunEvent::Kind::kStragglerNamed) named.push_back(e);
  }
  REQUIRE(named.size() == 1);
  CHECK(named[0].cause == "network");
  CHECK(named[0].node_id == "c");
  CHECK(named[0].rank == rank[3]);
  CHECK(named[0].slowdown == Approx(5));
  CHECK_THAT(named[0].reason, Catch::Contains("its node's link moved 10.0 MB/s, the nodes' "
                                              "median 50.0 MB/s (network)"));
  auto status = h.sm.status("run", h.now);
  REQUIRE(status[0].stragglers_size() == 1);
  CHECK(status[0].stragglers(0).cause() == "network");
  CHECK(status[0].stragglers(0).node_id() == "c");

  v1::AgentMsg many = progress_msg(round, {{rank[1], 9, 9, "forward", 0}});
  for (int i = 0; i <= muster::rendezvous::limits::kMaxLinkReports; ++i) {
    v1::LinkRate* l = many.mutable_progress()->add_links();
    l->set_local("10.0.0.1");
    l->set_remote("10.0.1." + std::to_string(i));
    l->set_mbps(1);
  }
  h.send(1, many);
  REQUIRE(h.close_of(1) != nullptr);
  CHECK(h.close_of(1)->status.code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("exclusion: at MIN with a spare waiting beyond MAX, the straggler's node leaves and the "
          "spare takes its place",
          "[state_machine][stragglers]") {
  StragglerJob job;
  job.three(3, 3);
  job.join(4, "d", 3, 3);  // beyond MAX: it waits
  CHECK(job.h.to(4, kAssign).empty());
  bool restarted = false;
  for (std::uint64_t n = 1; n <= 80 && !restarted; ++n) restarted = job.step(n, {1, 2, 3}, 3);
  REQUIRE(restarted);
  REQUIRE(job.count(RunEvent::Kind::kStragglerExcluded) == 1);
  auto to_c = job.h.to(3, kRestart);
  REQUIRE(to_c.size() == 1);
  CHECK(to_c[0].restart().excluded_ms() > 0);
  job.join(1, "a", 3, 3);
  job.join(2, "b", 3, 3);
  REQUIRE(job.round == 2);
  auto st = job.h.sm.status("run", job.h.now);
  REQUIRE(st[0].members_size() == 3);
  std::set<std::string> members;
  for (const auto& m : st[0].members()) members.insert(m);
  CHECK(members == std::set<std::string>{"a", "b", "d"});
  CHECK(job.h.sm.check_invariants().ok());
}
