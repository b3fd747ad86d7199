// The rendezvous rules, driven with a fake clock: `now` is just a number we advance.
#include "muster/rendezvous/state_machine.h"

#include <catch2/catch.hpp>
#include <random>

using namespace std::chrono_literals;
using muster::rendezvous::Outgoing;
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
    v1::AgentMsg m;
    v1::Join* j = m.mutable_join();
    j->set_run_id("run");
    j->set_node_id(node);
    j->set_host("host-" + node);
    j->set_local_world_size(nproc);
    j->set_min_nodes(min);
    j->set_max_nodes(max);
    j->set_max_restarts(max_restarts);
    j->set_master_port_candidate(1000 + static_cast<int>(node.size()));
    j->set_requested_rank(requested);
    return m;
  }
  std::vector<Outgoing>& join(SessionId s, const std::string& node, int min, int max,
                              int max_restarts = 0, int nproc = 2, int requested = -1) {
    return last = sm.on_message(s, join_msg(node, min, max, max_restarts, nproc, requested), now);
  }
  std::vector<Outgoing>& fail(SessionId s, int round) {
    v1::AgentMsg m;
    m.mutable_failure()->set_round(round);
    m.mutable_failure()->mutable_root_cause()->set_rank(3);
    m.mutable_failure()->mutable_root_cause()->set_exit_code(7);
    return last = sm.on_message(s, m, now);
  }
  std::vector<Outgoing>& succeed(SessionId s, int round) {
    v1::AgentMsg m;
    m.mutable_success()->set_round(round);
    return last = sm.on_message(s, m, now);
  }
  std::vector<Outgoing>& advance(std::chrono::milliseconds d) {
    now += d;
    return last = sm.on_tick(now);
  }
  std::vector<Outgoing>& closed(SessionId s) { return last = sm.on_stream_closed(s, now); }
  std::vector<Outgoing>& keep_alive(SessionId s) {
    v1::AgentMsg m;
    m.mutable_keep_alive();
    return last = sm.on_message(s, m, now);
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

TEST_CASE("rendezvous: a single node's round closes at once", "[rdzv]") {
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

TEST_CASE("rendezvous: a failure restarts the run until the budget is spent", "[rdzv]") {
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

TEST_CASE("rendezvous: a stale failure report is ignored", "[rdzv]") {
  Harness h;
  h.join(1, "a", 1, 1, 1);
  h.fail(1, 7);
  CHECK(h.last.empty());
}

TEST_CASE("rendezvous: a round closes when max nodes have joined", "[rdzv]") {
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

TEST_CASE("rendezvous: last call closes a round above min", "[rdzv]") {
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

TEST_CASE("rendezvous: join timeout below min is a clear error", "[rdzv]") {
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

TEST_CASE("rendezvous: a lost node restarts the others without using the budget", "[rdzv]") {
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

TEST_CASE("rendezvous: group ranks are stable across rounds", "[rdzv]") {
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

TEST_CASE("rendezvous: a requested node rank is honoured", "[rdzv]") {
  Harness h;
  h.join(1, "a", 2, 2, 0, 2, 1);
  h.join(2, "b", 2, 2, 0, 2, 0);
  CHECK(h.assignment(1).group_rank() == 1);
  CHECK(h.assignment(2).group_rank() == 0);
  CHECK(h.assignment(1).master_addr() == "host-b");
}

TEST_CASE("rendezvous: a newcomer scales a running round up; beyond max it waits", "[rdzv]") {
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

TEST_CASE("rendezvous: bad joins end only the joiner's stream", "[rdzv]") {
  Harness h;
  h.join(1, "a", 2, 2);
  h.join(2, "b", 1, 2);  // disagrees on nnodes
  CHECK(h.closed_with(2, absl::StatusCode::kInvalidArgument));
  h.join(3, "c", 3, 2);  // min > max
  CHECK(h.closed_with(3, absl::StatusCode::kInvalidArgument));
  h.join(4, "d", 2, 2);
  CHECK(h.assignment(1).group_world_size() == 2);
}

TEST_CASE("rendezvous: a join to a finished run is refused", "[rdzv]") {
  Harness h;
  h.join(1, "a", 1, 1);
  h.succeed(1, 1);
  h.join(2, "b", 1, 1);
  CHECK(h.closed_with(2, absl::StatusCode::kFailedPrecondition));
  h.advance(Harness::quiet().finished_run_grace);
  CHECK(h.sm.num_runs() == 0);
}

TEST_CASE("rendezvous: after a restart the round closes once every survivor is back", "[rdzv]") {
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

TEST_CASE("rendezvous: the first join sets the run's timing", "[rdzv]") {
  Harness h;
  auto m = Harness::join_msg("a", 1, 2);
  m.mutable_join()->set_last_call_timeout_ms(1000);
  h.last = h.sm.on_message(1, m, h.now);
  CHECK(h.last.empty());
  h.advance(999ms);
  CHECK(h.last.empty());
  h.advance(1ms);
  CHECK(h.assignment(1).group_world_size() == 1);
}

TEST_CASE("rendezvous: a node silent past its keep-alives is dropped", "[rdzv]") {
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

TEST_CASE("rendezvous: status reports each run", "[rdzv]") {
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

TEST_CASE("rendezvous: random event sequences keep the invariants", "[rdzv]") {
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
