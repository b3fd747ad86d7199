// Restarting the server without restarting workers, in the pure state machine with a fake
// clock: run records out (a Decision's touched runs, records()) and back in (restore), detached members that
// re-attach or not, and a randomized kill-and-restore that keeps the invariants.
#include <catch2/catch.hpp>
#include <map>
#include <random>
#include <set>

#include "join_msg.h"
#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/state_machine.h"

using namespace std::chrono_literals;
using muster::rendezvous::Decision;
using muster::rendezvous::Outgoing;
using muster::rendezvous::RunEvent;
using muster::rendezvous::SessionId;
using muster::rendezvous::StateMachine;
using muster::rendezvous::TimePoint;
namespace v1 = muster::v1;

namespace {

muster::rendezvous::RendezvousTimeouts timing() {
  muster::rendezvous::RendezvousTimeouts t;
  t.keep_alive_interval = std::chrono::hours(1);  // out of the way but for its own checks
  t.last_call_timeout = 2s;
  t.reattach_timeout = 10s;
  return t;
}

// One machine and the store it writes to (a map, as RunStore keeps it).
struct Server {
  std::unique_ptr<StateMachine> sm;
  std::map<std::string, v1::RunRecord> store;
  std::vector<Outgoing> last;
  std::vector<RunEvent> events;
  StateMachine::RecordChanges written;  // by the last decision

  explicit Server(muster::rendezvous::RendezvousTimeouts t = timing())
      : sm(std::make_unique<StateMachine>(t)) {
    sm->enable_records();
  }
  // What the server does after every call: the records first, then the messages.
  std::vector<Outgoing>& done(Decision d) {
    written = sm->records(d.touched);
    for (auto& r : written.put) store[r.run_id()] = r;
    for (auto& id : written.erased) store.erase(id);
    for (auto& e : d.events) events.push_back(std::move(e));
    return last = std::move(d.messages);
  }
  // kill -9 and a restart on the same store.
  StateMachine::RestoreResult restart(TimePoint now,
                                      muster::rendezvous::RendezvousTimeouts t = timing()) {
    sm = std::make_unique<StateMachine>(t);
    sm->enable_records();
    std::vector<v1::RunRecord> records;
    for (auto& [id, r] : store) records.push_back(r);
    auto res = sm->restore(records, now);
    Decision restored;
    restored.events = res.events;
    done(std::move(restored));
    return res;
  }
  // The store holds exactly each run's record.
  void check_store() const {
    std::set<std::string> ids;
    for (const auto& s : sm->status("")) {
      ids.insert(s.run_id());
      auto it = store.find(s.run_id());
      REQUIRE(it != store.end());
      REQUIRE(it->second.SerializeAsString() == sm->record(s.run_id())->SerializeAsString());
    }
    REQUIRE(ids.size() == store.size());
  }

  static v1::AgentMsg join_msg(const std::string& node, int min, int max, int max_restarts) {
    return muster::testing::join_msg(node, min, max, max_restarts);
  }
  std::vector<Outgoing>& join(SessionId s, const std::string& node, int min, int max,
                              int max_restarts, TimePoint now) {
    return done(sm->on_message(s, join_msg(node, min, max, max_restarts), now));
  }
  std::vector<Outgoing>& reattach(SessionId s, const std::string& node, int min, int max,
                                  int max_restarts, int round, int group_rank, TimePoint now) {
    v1::AgentMsg m = join_msg(node, min, max, max_restarts);
    m.mutable_join()->set_reattach_round(round);
    m.mutable_join()->set_reattach_group_rank(group_rank);
    return done(sm->on_message(s, m, now));
  }
  std::vector<Outgoing>& fail(SessionId s, int round, TimePoint now) {
    v1::AgentMsg m;
    m.mutable_failure()->set_round(round);
    m.mutable_failure()->mutable_root_cause()->set_rank(0);
    m.mutable_failure()->mutable_root_cause()->set_exit_code(3);
    return done(sm->on_message(s, m, now));
  }
  std::vector<Outgoing>& succeed(SessionId s, int round, TimePoint now) {
    v1::AgentMsg m;
    m.mutable_success()->set_round(round);
    return done(sm->on_message(s, m, now));
  }
  std::vector<Outgoing>& keep_alive(SessionId s, TimePoint now) {
    v1::AgentMsg m;
    m.mutable_keep_alive();
    return done(sm->on_message(s, m, now));
  }
  std::vector<Outgoing>& tick(TimePoint now) { return done(sm->on_tick(now)); }
  std::vector<Outgoing>& closed(SessionId s, TimePoint now) {
    return done(sm->on_stream_closed(s, now));
  }

  std::vector<v1::ServerMsg> to(SessionId s, v1::ServerMsg::MsgCase kind) const {
    std::vector<v1::ServerMsg> r;
    for (const auto& o : last) {
      if (o.session == s && o.msg && o.msg->msg_case() == kind) r.push_back(*o.msg);
    }
    return r;
  }
  bool sent_any(v1::ServerMsg::MsgCase kind) const {
    for (const auto& o : last) {
      if (o.msg && o.msg->msg_case() == kind) return true;
    }
    return false;
  }
  const Outgoing* close_of(SessionId s) const {
    for (const auto& o : last) {
      if (o.session == s && o.close) return &o;
    }
    return nullptr;
  }
  int count(RunEvent::Kind kind, const std::string& cause = "") const {
    int n = 0;
    for (const auto& e : events) n += e.kind == kind && (cause.empty() || e.cause == cause);
    return n;
  }
  void invariants() const {
    absl::Status st = sm->check_invariants();
    INFO(st.ToString());
    REQUIRE(st.ok());
  }
};

// Two nodes in round 2 after one counted restart: a's group rank and b's, by their Assignments.
struct Running {
  Server srv;
  TimePoint now{};
  int rank_a = -1, rank_b = -1;
  Running() {
    srv.join(1, "a", 2, 2, 3, now);
    srv.join(2, "b", 2, 2, 3, now);
    REQUIRE(srv.to(1, v1::ServerMsg::kAssignment).size() == 1);
    srv.fail(1, 1, now);
    REQUIRE(srv.to(2, v1::ServerMsg::kRestart).size() == 1);
    srv.join(1, "a", 2, 2, 3, now);
    srv.join(2, "b", 2, 2, 3, now);
    auto a = srv.to(1, v1::ServerMsg::kAssignment);
    auto b = srv.to(2, v1::ServerMsg::kAssignment);
    REQUIRE(a.size() == 1);
    REQUIRE(b.size() == 1);
    REQUIRE(a[0].assignment().round() == 2);
    REQUIRE(a[0].assignment().restart_count() == 1);
    // A server that keeps its runs tells its nodes they may keep their workers through it.
    REQUIRE(a[0].assignment().reattach_timeout_ms() == 10000);
    rank_a = a[0].assignment().group_rank();
    rank_b = b[0].assignment().group_rank();
    srv.invariants();
    srv.check_store();
  }
};

}  // namespace

TEST_CASE("records: the record holds what the run needs, keep-alives write nothing",
          "[rdzv][reattach]") {
  Running r;
  const v1::RunRecord& rec = r.srv.store.at("run");
  CHECK(rec.phase() == v1::RunRecord::RUNNING);
  CHECK(rec.round() == 2);
  CHECK(rec.restart_count() == 1);
  CHECK(rec.max_restarts() == 3);
  REQUIRE(rec.members_size() == 2);
  CHECK(rec.members(r.rank_a).node_id() == "a");
  CHECK(rec.members(r.rank_b).node_id() == "b");
  CHECK(rec.members(0).token().empty());
  CHECK(rec.last_rank_size() == 2);
  CHECK(rec.reattach_timeout_ms() == 10000);
  r.srv.keep_alive(1, r.now);
  CHECK(r.srv.written.put.empty());
  CHECK(r.srv.written.erased.empty());
  // Without records the machine tracks nothing and says nothing of re-attach.
  StateMachine plain(timing());
  v1::AgentMsg j = Server::join_msg("a", 1, 1, 0);
  Decision d = plain.on_message(1, j, r.now);
  REQUIRE(d.messages.size() == 1);
  CHECK(d.messages[0].msg->assignment().reattach_timeout_ms() == 0);
  CHECK(d.touched.empty());
  CHECK(plain.records({"run"}).put.empty());
}

TEST_CASE("restore: members re-attach with their ranks, no restart, no budget spent",
          "[rdzv][reattach]") {
  Running r;
  r.now += 1h;  // a long outage: timers start at the restore, nobody is dropped for it
  auto res = r.srv.restart(r.now);
  CHECK(res.restored == 1);
  CHECK(res.refused.empty());
  r.srv.invariants();
  CHECK(r.srv.count(RunEvent::Kind::kRunRestored) == 1);
  auto st = r.srv.sm->status("run");
  REQUIRE(st.size() == 1);
  CHECK(st[0].phase() == "running");
  CHECK(st[0].round() == 2);
  CHECK(st[0].restart_count() == 1);
  CHECK(st[0].members_size() == 2);
  r.srv.tick(r.now + 1s);
  CHECK(r.srv.last.empty());

  r.now += 2s;
  r.srv.reattach(11, "a", 2, 2, 3, 2, r.rank_a, r.now);
  auto att = r.srv.to(11, v1::ServerMsg::kAttached);
  REQUIRE(att.size() == 1);
  CHECK(att[0].attached().ok());
  CHECK(att[0].attached().round() == 2);
  CHECK(att[0].attached().restart_count() == 1);
  r.srv.invariants();
  r.srv.reattach(12, "b", 2, 2, 3, 2, r.rank_b, r.now);
  REQUIRE(r.srv.to(12, v1::ServerMsg::kAttached).size() == 1);
  CHECK(r.srv.to(12, v1::ServerMsg::kAttached)[0].attached().ok());
  CHECK_FALSE(r.srv.sent_any(v1::ServerMsg::kRestart));
  CHECK(r.srv.count(RunEvent::Kind::kNodeReattached) == 2);
  r.srv.invariants();
  r.srv.check_store();
  // Past the re-attach window nothing happens to attached members.
  r.srv.tick(r.now + 20s);
  CHECK_FALSE(r.srv.sent_any(v1::ServerMsg::kRestart));
  // A worker failure after the restore: exactly one counted restart (2 of 3).
  r.srv.fail(11, 2, r.now + 21s);
  auto rs = r.srv.to(12, v1::ServerMsg::kRestart);
  REQUIRE(rs.size() == 1);
  CHECK(rs[0].restart().restart_count() == 2);
  r.srv.join(11, "a", 2, 2, 3, r.now + 22s);
  r.srv.join(12, "b", 2, 2, 3, r.now + 22s);
  auto a = r.srv.to(11, v1::ServerMsg::kAssignment);
  REQUIRE(a.size() == 1);
  CHECK(a[0].assignment().restart_count() == 2);
  CHECK(a[0].assignment().group_rank() == r.rank_a);  // stable ranks across the restore
  r.srv.succeed(11, 3, r.now + 23s);
  r.srv.succeed(12, 3, r.now + 23s);
  CHECK(r.srv.to(11, v1::ServerMsg::kDone).size() == 1);
  r.srv.invariants();
  r.srv.check_store();
  CHECK(r.srv.store.at("run").phase() == v1::RunRecord::FINISHED);
}

TEST_CASE("restore: a member not back in the window is lost, the others restart for free",
          "[rdzv][reattach]") {
  Running r;
  r.srv.restart(r.now);
  r.srv.reattach(11, "a", 2, 2, 3, 2, r.rank_a, r.now + 1s);
  r.srv.tick(r.now + 9s);
  CHECK(r.srv.last.empty());
  r.srv.tick(r.now + 10s);  // the window (10 s from the restore) is over
  auto rs = r.srv.to(11, v1::ServerMsg::kRestart);
  REQUIRE(rs.size() == 1);
  CHECK(rs[0].restart().restart_count() == 1);  // not counted
  CHECK(r.srv.count(RunEvent::Kind::kNodeLost, "not_reattached") == 1);
  r.srv.invariants();
  // b comes back too late: its place is gone; it is told so and joins afresh.
  r.srv.reattach(12, "b", 2, 2, 3, 2, r.rank_b, r.now + 11s);
  auto att = r.srv.to(12, v1::ServerMsg::kAttached);
  REQUIRE(att.size() == 1);
  CHECK_FALSE(att[0].attached().ok());
  CHECK_THAT(att[0].attached().reason(), Catch::Contains("forming round 3"));
  r.srv.keep_alive(12, r.now + 11s);  // answered while it stops its workers
  CHECK(r.srv.to(12, v1::ServerMsg::kKeepAlive).size() == 1);
  CHECK(r.srv.close_of(12) == nullptr);
  r.srv.join(11, "a", 2, 2, 3, r.now + 12s);
  r.srv.join(12, "b", 2, 2, 3, r.now + 12s);
  auto a = r.srv.to(12, v1::ServerMsg::kAssignment);
  REQUIRE(a.size() == 1);
  CHECK(a[0].assignment().round() == 3);
  CHECK(a[0].assignment().restart_count() == 1);
  r.srv.invariants();
  r.srv.check_store();
}

TEST_CASE("restore: nobody back at all drops the run after the window", "[rdzv][reattach]") {
  Running r;
  r.srv.restart(r.now);
  r.srv.tick(r.now + 10s);
  CHECK_FALSE(r.srv.sm->has_run("run"));
  CHECK(r.srv.store.empty());
  r.srv.invariants();
}

TEST_CASE("restore: a plain join from a held place gives it up (restart, not counted)",
          "[rdzv][reattach]") {
  Running r;
  r.srv.restart(r.now);
  r.srv.reattach(11, "a", 2, 2, 3, 2, r.rank_a, r.now);
  r.srv.join(12, "b", 2, 2, 3, r.now);  // b's agent gave up re-attaching: its workers stopped
  auto rs = r.srv.to(11, v1::ServerMsg::kRestart);
  REQUIRE(rs.size() == 1);
  CHECK(rs[0].restart().restart_count() == 1);
  CHECK(r.srv.count(RunEvent::Kind::kNodeLost, "rejoined") == 1);
  r.srv.invariants();
  r.srv.join(11, "a", 2, 2, 3, r.now);
  CHECK(r.srv.to(12, v1::ServerMsg::kAssignment).size() == 1);
  r.srv.invariants();
}

TEST_CASE("re-attach: refused for an unknown run, another round, another node, or mid-stream",
          "[rdzv][reattach]") {
  Running r;
  // Unknown run (a server that forgot it): not attached, and the stream stays open.
  v1::AgentMsg other = Server::join_msg("a", 2, 2, 3);
  other.mutable_join()->set_run_id("other");
  other.mutable_join()->set_reattach_round(1);
  r.srv.done(r.srv.sm->on_message(21, other, r.now));
  REQUIRE(r.srv.to(21, v1::ServerMsg::kAttached).size() == 1);
  CHECK_FALSE(r.srv.to(21, v1::ServerMsg::kAttached)[0].attached().ok());
  CHECK_FALSE(r.srv.sm->has_run("other"));
  r.srv.reattach(22, "a", 2, 2, 3, 1, r.rank_a, r.now);  // an old round
  CHECK_THAT(r.srv.to(22, v1::ServerMsg::kAttached)[0].attached().reason(),
             Catch::Contains("is in round 2, not 1"));
  r.srv.reattach(23, "a", 2, 2, 3, 2, r.rank_b, r.now);  // another node's rank
  CHECK_FALSE(r.srv.to(23, v1::ServerMsg::kAttached)[0].attached().ok());
  // A re-attach on a stream already in the run is a protocol error.
  r.srv.reattach(1, "a", 2, 2, 3, 2, r.rank_a, r.now);
  REQUIRE(r.srv.close_of(1) != nullptr);
  CHECK(r.srv.close_of(1)->status.code() == absl::StatusCode::kInvalidArgument);
  // Out of range.
  r.srv.reattach(24, "a", 2, 2, 3, 2, 5, r.now);
  REQUIRE(r.srv.close_of(24) != nullptr);
  CHECK(r.srv.close_of(24)->status.code() == absl::StatusCode::kInvalidArgument);
  r.srv.invariants();
}

TEST_CASE("re-attach: a newer stream of a member takes over its still-open old one",
          "[rdzv][reattach]") {
  Running r;
  r.srv.reattach(11, "a", 2, 2, 3, 2, r.rank_a, r.now);
  REQUIRE(r.srv.to(11, v1::ServerMsg::kAttached).size() == 1);
  CHECK(r.srv.to(11, v1::ServerMsg::kAttached)[0].attached().ok());
  REQUIRE(r.srv.close_of(1) != nullptr);
  CHECK(r.srv.close_of(1)->status.code() == absl::StatusCode::kAborted);
  r.srv.invariants();
  r.srv.closed(1, r.now);  // the old stream's end, seen later, costs nothing
  CHECK(r.srv.last.empty());
  r.srv.succeed(11, 2, r.now);
  r.srv.succeed(2, 2, r.now);
  CHECK(r.srv.to(11, v1::ServerMsg::kDone).size() == 1);
}

TEST_CASE("restore: a finished run tells a member that missed the end, others are refused",
          "[rdzv][reattach]") {
  Running r;
  r.srv.succeed(1, 2, r.now);
  r.srv.succeed(2, 2, r.now);
  REQUIRE(r.srv.store.at("run").phase() == v1::RunRecord::FINISHED);
  r.srv.restart(r.now);
  r.srv.reattach(11, "a", 2, 2, 3, 2, r.rank_a, r.now);
  CHECK(r.srv.to(11, v1::ServerMsg::kDone).size() == 1);
  REQUIRE(r.srv.close_of(11) != nullptr);
  CHECK(r.srv.close_of(11)->status.ok());
  r.srv.join(12, "c", 2, 2, 3, r.now);
  REQUIRE(r.srv.close_of(12) != nullptr);
  CHECK(r.srv.close_of(12)->status.code() == absl::StatusCode::kFailedPrecondition);
  // Its grace runs from the restore (60 s by default), then it goes, record and all.
  r.srv.tick(r.now + 61s);
  CHECK_FALSE(r.srv.sm->has_run("run"));
  CHECK(r.srv.store.empty());
}

TEST_CASE("restore: a joining run comes back empty, keeps its count, and its nodes join again",
          "[rdzv][reattach]") {
  Running r;
  r.srv.fail(1, 2, r.now);  // restart 2, decided and recorded; then the server dies
  REQUIRE(r.srv.store.at("run").phase() == v1::RunRecord::JOINING);
  r.srv.restart(r.now);
  r.srv.invariants();
  CHECK(r.srv.sm->status("run")[0].waiting() == 0);
  // The nodes were stopping their workers (Restart); they join again.
  r.srv.join(11, "b", 2, 2, 3, r.now + 1s);
  r.srv.join(12, "a", 2, 2, 3, r.now + 1s);  // max nodes: the round closes
  auto a = r.srv.to(12, v1::ServerMsg::kAssignment);
  REQUIRE(a.size() == 1);
  CHECK(a[0].assignment().round() == 3);
  CHECK(a[0].assignment().restart_count() == 2);
  CHECK(a[0].assignment().group_rank() == r.rank_a);
  // Nobody coming back at all: the hold ends and the run is dropped.
  Running q;
  q.srv.fail(1, 2, q.now);
  q.srv.restart(q.now);
  q.srv.tick(q.now + 10s);
  CHECK_FALSE(q.srv.sm->has_run("run"));
}

TEST_CASE("restore: records that do not hold together are refused, one line each",
          "[rdzv][reattach]") {
  Running r;
  v1::RunRecord good = r.srv.store.at("run");
  v1::RunRecord bad_format = good, over_budget = good, too_few = good, dup = good;
  bad_format.set_format(99);
  bad_format.set_run_id("f");
  over_budget.set_run_id("b");
  over_budget.set_restart_count(9);
  too_few.set_run_id("t");
  too_few.mutable_members()->RemoveLast();
  StateMachine sm(timing());
  auto res = sm.restore({bad_format, over_budget, too_few, good, dup}, r.now);
  CHECK(res.restored == 1);
  REQUIRE(res.refused.size() == 4);
  CHECK_THAT(res.refused[0], Catch::Contains("record format 99"));
  CHECK_THAT(res.refused[3], Catch::Contains("held already"));
  CHECK(sm.check_invariants().ok());
}

// Random agents against a machine that is killed and restored at random points: the
// invariants hold throughout, the store always holds each run's record, the restart count
// survives every restore, and the rounds' ranks stay unique and contiguous.
TEST_CASE("restore: random kills and restores keep the invariants", "[rdzv][reattach]") {
  std::mt19937 rng(4242);
  for (int trial = 0; trial < 150; ++trial) {
    Server srv;
    TimePoint now{};
    const int min = 1 + static_cast<int>(rng() % 2), max = min + static_cast<int>(rng() % 3);
    struct Node {
      SessionId session = 0;
      int round = 0, rank = -1;  // its last Assignment (0: none running)
    };
    std::map<std::string, Node> nodes;  // by node id
    SessionId next = 1;
    for (int step = 0; step < 80; ++step) {
      const int what = static_cast<int>(rng() % 8);
      std::vector<std::string> live;
      for (auto& [id, n] : nodes) {
        if (n.session != 0) live.push_back(id);
      }
      auto pick = [&]() -> Node* {
        if (live.empty()) return nullptr;
        return &nodes[live[rng() % live.size()]];
      };
      if (what <= 1) {
        const std::string id = "n" + std::to_string(rng() % 5);
        Node& n = nodes[id];
        if (n.session == 0) n.session = next++;
        n.round = 0;
        srv.join(n.session, id, min, max, 3, now);
      } else if (what == 2) {
        if (Node* n = pick()) {
          srv.closed(n->session, now);
          n->session = 0;
          n->round = 0;
        }
      } else if (what == 3) {
        if (Node* n = pick(); n != nullptr && n->round > 0) srv.fail(n->session, n->round, now);
      } else if (what == 4) {
        if (Node* n = pick(); n != nullptr && n->round > 0) srv.succeed(n->session, n->round, now);
      } else if (what == 5) {
        now += std::chrono::milliseconds(rng() % 4000);
        srv.tick(now);
      } else {
        // kill -9 and restart: every stream breaks; nodes in a round re-attach (some never,
        // some late), the others join again.
        const int count_before =
            srv.store.count("run") ? srv.store.at("run").restart_count() : -1;
        now += std::chrono::milliseconds(rng() % 3000);
        auto res = srv.restart(now);
        REQUIRE(res.refused.empty());
        if (count_before >= 0) {
          REQUIRE(srv.sm->status("run").size() == 1);
          REQUIRE(srv.sm->status("run")[0].restart_count() == count_before);
        }
        srv.invariants();
        for (auto& [id, n] : nodes) {
          if (n.session == 0) continue;
          n.session = next++;
          const int fate = static_cast<int>(rng() % 4);
          if (fate == 0) {
            n.session = 0;  // never comes back
          } else if (n.round > 0 && fate != 3) {
            srv.reattach(n.session, id, min, max, 3, n.round, n.rank, now);
            auto att = srv.to(n.session, v1::ServerMsg::kAttached);
            if (att.empty() || !att[0].attached().ok()) {
              n.round = 0;
              if (srv.close_of(n.session) != nullptr) {
                n.session = 0;
              } else {
                srv.join(n.session, id, min, max, 3, now);
              }
            }
          } else {
            n.round = 0;
            srv.join(n.session, id, min, max, 3, now);
          }
          srv.invariants();
        }
      }
      // What the step's messages say.
      std::vector<std::pair<std::string, v1::Assignment>> as;
      for (const Outgoing& o : srv.last) {
        for (auto& [id, n] : nodes) {
          if (n.session != o.session || n.session == 0) continue;
          if (o.msg && o.msg->has_assignment()) {
            n.round = o.msg->assignment().round();
            n.rank = o.msg->assignment().group_rank();
            as.emplace_back(id, o.msg->assignment());
          }
          if (o.msg && (o.msg->has_restart() || o.msg->has_done() || o.msg->has_fail())) {
            n.round = 0;
          }
          if (o.close) {
            n.session = 0;
            n.round = 0;
          }
        }
      }
      srv.invariants();
      srv.check_store();
      auto next_deadline = srv.sm->next_deadline();
      REQUIRE((!next_deadline || *next_deadline > now));
      if (as.empty()) continue;
      REQUIRE(static_cast<int>(as.size()) >= min);
      REQUIRE(static_cast<int>(as.size()) <= max);
      std::set<int> ranks;
      for (const auto& [id, a] : as) {
        REQUIRE(a.group_world_size() == static_cast<int>(as.size()));
        REQUIRE(a.rank_offset() == 2 * a.group_rank());
        ranks.insert(a.group_rank());
      }
      REQUIRE(static_cast<int>(ranks.size()) == static_cast<int>(as.size()));
      REQUIRE(*ranks.rbegin() == static_cast<int>(as.size()) - 1);
    }
  }
}
