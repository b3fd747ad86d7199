// A leader change of a replicated rdzvd, in the pure state machine with a fake clock. For
// the machine a leader change is a kill and a restore from the records the old leader wrote
// (write-ahead: a decision's records are written before any of its messages is sent), so the
// leader can die at three points of a decision: before its records are written (nobody hears
// of it; the new leader restores the store as it was before it), after the write with only
// some of its messages sent, or between decisions. Agents then do what real agents do:
// members re-attach and send again the report that got no answer, the others join again.
// What agents were told (a ledger kept here, from the messages they received) must agree with
// what every new leader restores: the restart budget counted once per failure, never
// negative, never going down, a finished run's result kept, and nobody dropped for the
// silence of an outage.
#include <catch2/catch.hpp>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>

#include "join_msg.h"
#include "muster/rendezvous/state_machine.h"

using namespace std::chrono_literals;
using muster::rendezvous::Decision;
using muster::rendezvous::Outgoing;
using muster::rendezvous::RendezvousTimeouts;
using muster::rendezvous::RunEvent;
using muster::rendezvous::SessionId;
using muster::rendezvous::StateMachine;
using muster::rendezvous::TimePoint;
using std::chrono::milliseconds;
namespace v1 = muster::v1;

namespace {

// A liveness window (4 x 0.5 s) shorter than many outages here, so that an outage's silence
// would drop nodes if the restored timers did not start at the restore.
constexpr milliseconds kKeepAliveInterval = 500ms;
constexpr milliseconds kReattachTimeout = 10s;

RendezvousTimeouts timing() {
  RendezvousTimeouts t;
  t.keep_alive_interval = kKeepAliveInterval;
  t.keep_alive_max_attempt = 4;
  t.last_call_timeout = 2s;
  t.reattach_timeout = kReattachTimeout;
  t.finished_run_grace = 20s;  // then the job is submitted again
  return t;
}

v1::AgentMsg failure_msg(int round) {
  v1::AgentMsg m;
  m.mutable_failure()->set_round(round);
  m.mutable_failure()->mutable_root_cause()->set_rank(0);
  m.mutable_failure()->mutable_root_cause()->set_exit_code(3);
  return m;
}

v1::AgentMsg success_msg(int round) {
  v1::AgentMsg m;
  m.mutable_success()->set_round(round);
  return m;
}

v1::AgentMsg reattach_msg(v1::AgentMsg join, int round, int group_rank) {
  join.mutable_join()->set_reattach_round(round);
  join.mutable_join()->set_reattach_group_rank(group_rank);
  return join;
}

std::vector<v1::ServerMsg> to(const std::vector<Outgoing>& out, SessionId s,
                              v1::ServerMsg::MsgCase kind) {
  std::vector<v1::ServerMsg> r;
  for (const auto& o : out) {
    if (o.session == s && o.msg && o.msg->msg_case() == kind) r.push_back(*o.msg);
  }
  return r;
}

// --- The randomized conformance test --------------------------------------------------------

struct RunCfg {
  std::string id;
  int min = 1, max = 1, max_restarts = 0;
};

// What agents were told about one run, from the messages they received. One incarnation of
// the run: when its record is erased (nobody held it, or a finished run's grace ended) a run
// of that id is a new one and its ledger starts over.
struct Ledger {
  int told = 0;                   // the highest restart count any agent was told
  std::set<int> failed;           // rounds a member sent a failure report for
  std::set<int> counted;          // rounds a counted restart was attributed to: one each
  std::map<int, int> round_count;  // each round's restart count, by its Assignments
  std::map<int, int> round_world;  // each round's group world size
  std::map<int, std::set<int>> round_ranks;
  std::map<int, std::uint64_t> round_decision;  // the decision that formed the round
  std::optional<std::string> told_result;       // the Done or Fail agents were told
  std::optional<std::string> stored_result;     // the result the first FINISHED record held
  int unheard = -1;  // a restart count written by a leader that died before telling it
};

struct Agent {
  enum class St {
    kIdle,       // no stream, in no run (it may join)
    kWaiting,    // joined, waiting for an Assignment
    kRunning,    // its workers run in (round, rank)
    kStopping,   // told Restart: it joins again when its workers have stopped
    kAttaching,  // sent its re-attach, no answer yet
    kOffline,    // its leader died: it reaches the next one at back_at
    kRefused,    // its re-attach was refused: it joins again on the same stream
    kFinished,   // told Done or Fail
  };
  int run = 0;
  std::string id;
  St st = St::kIdle;
  SessionId session = 0;
  int round = 0, rank = -1;       // its last Assignment
  milliseconds reattach{0};       // from that Assignment
  std::optional<bool> report;     // sent and unanswered: true success, false failure
  std::uint64_t report_term = 0;  // the leader term it was first sent in
  bool workers = false;           // kOffline / kAttaching: its workers still run
  bool reattached = false;        // re-attached to this leader, its stream open since
  TimePoint lost_at, back_at;
};
using St = Agent::St;

struct Stats {
  int failovers = 0, lost = 0, cut = 0, reattached = 0, resent = 0, resent_failure_counted = 0,
      finished_failovers = 0, multi_run_restores = 0, refused_reattach = 0, counted = 0,
      fails = 0, dones = 0;
};

class World {
 public:
  World(std::mt19937& rng, Stats& stats) : rng_(rng), stats_(stats) {
    const int runs = 2 + static_cast<int>(rng_() % 2);
    for (int r = 0; r < runs; ++r) {
      RunCfg c;
      c.id = "job" + std::to_string(r);
      c.min = 1 + static_cast<int>(rng_() % 2);
      c.max = c.min + static_cast<int>(rng_() % 2);
      c.max_restarts = 1 + static_cast<int>(rng_() % 3);
      runs_.push_back(c);
      for (int n = 0; n <= c.max; ++n) {  // one spare
        Agent a;
        a.run = r;
        a.id = c.id + "-n" + std::to_string(n);
        agents_.push_back(a);
      }
    }
    ledgers_.resize(runs_.size());
    new_leader();
  }

  void step() {
    const int what = static_cast<int>(rng_() % 16);
    if (what < 3) {
      if (Agent* a = pick(St::kIdle)) {
        a->session = next_session_++;
        a->st = St::kWaiting;
        send(*a, join_of(*a), true);
      }
    } else if (what < 6) {
      if (Agent* a = pick(St::kStopping)) {
        a->st = St::kWaiting;
        send(*a, join_of(*a), true);
      }
    } else if (what < 8) {
      if (Agent* a = pick(St::kRunning); a != nullptr && !a->report) report(*a, false);
    } else if (what < 9) {
      if (Agent* a = pick(St::kRunning); a != nullptr && !a->report) report(*a, true);
    } else if (what < 10) {
      // An agent's process dies: its stream ends.
      std::vector<Agent*> open;
      for (Agent& a : agents_) {
        if (a.session != 0) open.push_back(&a);
      }
      if (!open.empty()) {
        Agent& a = *open[rng_() % open.size()];
        const SessionId s = a.session;
        forget(a);
        a.st = St::kIdle;
        a.report.reset();
        call([&] { return sm_->on_stream_closed(s, now_); }, true);
      }
    } else if (what < 15) {
      advance(milliseconds(rng_() % 2500));
    } else {
      failover();  // between decisions
    }
    drain_followups();
    check();
  }

  // Ends a trial: time passes with nobody acting but agents coming back and rejoining, so
  // that pending re-attaches happen.
  void settle() {
    for (int i = 0; i < 8; ++i) {
      advance(3s);
      drain_followups();
      check();
    }
  }

 private:
  // --- The leader ---------------------------------------------------------------------------
  void new_leader() {
    sm_ = std::make_unique<StateMachine>(timing());
    sm_->enable_records();
    ++term_;
  }

  // One decision: the machine's answer to one event, then what the server does with it:
  // write the records, then send the messages. With `inject` the leader may die before the
  // write (nobody hears of the decision) or after it, mid-send.
  void call(const std::function<Decision()>& fn, bool inject, bool tick = false) {
    Decision d = fn();
    const std::vector<Outgoing>& out = d.messages;
    StateMachine::RecordChanges changes = sm_->records(d.touched);
    const std::vector<RunEvent>& events = d.events;
    ++decision_;
    const bool something = !out.empty() || !changes.put.empty() || !changes.erased.empty();
    const int fate = inject && something ? static_cast<int>(rng_() % 100) : 100;
    if (fate < 8) {
      ++stats_.lost;
      failover();
      return;
    }
    write(changes);
    check_events(events, tick);
    if (fate < 13) {
      ++stats_.cut;
      deliver(out, /*cut=*/true);
      for (const auto& r : changes.put) {
        Ledger& l = ledgers_[run_index(r.run_id())];
        if (r.restart_count() > l.told) l.unheard = r.restart_count();
      }
      failover();
      return;
    }
    deliver(out, /*cut=*/false);
  }

  void write(const StateMachine::RecordChanges& c) {
    for (const auto& r : c.put) {
      store_[r.run_id()] = r;
      Ledger& l = ledgers_[run_index(r.run_id())];
      if (r.phase() == v1::RunRecord::FINISHED) {
        const std::string res = r.result().SerializeAsString();
        if (l.stored_result) {
          REQUIRE(*l.stored_result == res);
        } else {
          l.stored_result = res;
        }
      }
    }
    for (const auto& id : c.erased) {
      store_.erase(id);
      // Whoever forms it again forms a new run: the job is submitted again.
      const int run = run_index(id);
      ledgers_[run] = Ledger{};
      for (Agent& a : agents_) {
        if (a.run == run && a.st == St::kFinished) a.st = St::kIdle;
      }
    }
  }

  // The leader dies; another restores every run from the store; every stream breaks.
  void failover() {
    ++stats_.failovers;
    const TimePoint lost = now_;
    now_ += milliseconds(rng_() % 6000);  // the outage
    std::map<std::string, int> counts_before;
    int finished = 0;
    for (const auto& [id, r] : store_) {
      counts_before[id] = r.restart_count();
      finished += r.phase() == v1::RunRecord::FINISHED;
    }
    stats_.finished_failovers += finished > 0;
    stats_.multi_run_restores += store_.size() > 1;
    new_leader();
    std::vector<v1::RunRecord> records;
    for (const auto& [id, r] : store_) records.push_back(r);
    auto res = sm_->restore(records, now_);
    REQUIRE(res.refused.empty());
    REQUIRE(res.restored == static_cast<int>(store_.size()));
    check_events(res.events, false);
    for (const auto& [id, count] : counts_before) {
      auto st = sm_->status(id);
      REQUIRE(st.size() == 1);
      REQUIRE(st[0].restart_count() == count);  // never down, never up, across the change
    }
    followups_.clear();
    by_session_.clear();
    for (Agent& a : agents_) {
      if (a.st == St::kFinished) {  // its agent has exited (the close may not have come)
        a.session = 0;
        continue;
      }
      if (a.session == 0 && a.st != St::kOffline) continue;
      const bool had_workers =
          a.st == St::kRunning || a.st == St::kAttaching || (a.st == St::kOffline && a.workers);
      // One still trying since an earlier loss (offline, or its re-attach unanswered) keeps
      // that one: its window counts from there.
      if (a.st != St::kOffline && a.st != St::kAttaching) a.lost_at = lost;
      a.session = 0;
      a.reattached = false;
      if (rng_() % 6 == 0) {
        a.st = St::kIdle;  // never comes back (it may join afresh much later)
        a.report.reset();
        continue;
      }
      a.st = St::kOffline;
      a.workers = had_workers;
      // Most soon, some after their window.
      a.back_at = now_ + milliseconds(rng_() % (rng_() % 3 == 0 ? 12000 : 2000));
    }
    check();
  }

  // --- Agents ---------------------------------------------------------------------------
  v1::AgentMsg join_of(const Agent& a) const {
    const RunCfg& c = runs_[a.run];
    v1::AgentMsg m = muster::testing::join_msg(a.id, c.min, c.max, c.max_restarts);
    m.mutable_join()->set_run_id(c.id);
    return m;
  }

  void send(Agent& a, const v1::AgentMsg& m, bool inject) {
    by_session_[a.session] = static_cast<int>(&a - agents_.data());
    const SessionId s = a.session;
    call([&] { return sm_->on_message(s, m, now_); }, inject);
  }

  void report(Agent& a, bool success) {
    a.report = success;
    a.report_term = term_;
    if (!success) ledgers_[a.run].failed.insert(a.round);
    send(a, success ? success_msg(a.round) : failure_msg(a.round), true);
  }

  void forget(Agent& a) {
    by_session_.erase(a.session);
    a.session = 0;
    a.reattached = false;
  }

  // The agent reaches the new leader: a member whose workers run re-attaches while its window
  // lasts (counted from the loss, as the agent does); the others join again.
  void reconnect(Agent& a) {
    a.session = next_session_++;
    if (a.workers && now_ < a.lost_at + a.reattach) {
      a.st = St::kAttaching;
      send(a, reattach_msg(join_of(a), a.round, a.rank), true);
      return;
    }
    a.workers = false;
    a.report.reset();
    a.st = St::kWaiting;
    send(a, join_of(a), true);
  }

  void advance(milliseconds by) {
    const TimePoint target = now_ + by;
    for (;;) {
      for (;;) {  // who is back by now, earliest first
        Agent* due = nullptr;
        for (Agent& a : agents_) {
          if (a.st == St::kOffline && a.back_at <= now_ && (!due || a.back_at < due->back_at)) {
            due = &a;
          }
        }
        if (due == nullptr) break;
        reconnect(*due);
        drain_followups();
      }
      if (now_ >= target) return;
      TimePoint next = std::min(target, now_ + kKeepAliveInterval);
      for (const Agent& a : agents_) {
        if (a.st == St::kOffline && a.back_at > now_) next = std::min(next, a.back_at);
      }
      now_ = next;
      // Every connected agent keeps its stream alive (one keep-alive per interval at most).
      for (Agent& a : agents_) {
        if (a.session == 0) continue;
        v1::AgentMsg ka;
        ka.mutable_keep_alive();
        send(a, ka, false);
      }
      call([&] { return sm_->on_tick(now_); }, true, /*tick=*/true);
      drain_followups();
    }
  }

  struct Followup {
    int agent;
    SessionId session;
    bool resend;  // else: join again (its re-attach was refused)
  };

  void drain_followups() {
    while (!followups_.empty()) {
      Followup f = followups_.front();
      followups_.pop_front();
      Agent& a = agents_[f.agent];
      if (a.session != f.session) continue;  // its stream ended meanwhile
      if (f.resend) {
        if (a.st != St::kRunning || !a.report) continue;
        ++stats_.resent;
        send(a, *a.report ? success_msg(a.round) : failure_msg(a.round), true);
      } else if (a.st == St::kRefused) {
        a.st = St::kWaiting;
        send(a, join_of(a), true);
      }
    }
  }

  // What the agents hear, and what they do about it. `cut`: the leader dies mid-send; each
  // stream got some first part of its messages.
  void deliver(const std::vector<Outgoing>& out, bool cut) {
    std::map<SessionId, std::size_t> keep;
    if (cut) {
      std::map<SessionId, std::size_t> n;
      for (const auto& o : out) ++n[o.session];
      for (const auto& [s, k] : n) keep[s] = rng_() % (k + 1);
    }
    std::map<std::pair<int, int>, int> formed;  // (run, round) -> Assignments in this decision
    for (const auto& o : out) {
      if (cut) {
        std::size_t& k = keep[o.session];
        if (k == 0) continue;
        --k;
      }
      auto it = by_session_.find(o.session);
      INFO("a message for session " << o.session);
      REQUIRE(it != by_session_.end());  // only to streams that are open
      Agent& a = agents_[it->second];
      INFO("to " << a.id);
      if (o.msg) hear(a, *o.msg, formed);
      if (o.close) {
        if (a.st != St::kFinished) {
          a.st = St::kIdle;
          a.report.reset();
        }
        forget(a);
      }
    }
    // A round a whole decision formed has ranks 0..n-1, each once.
    for (const auto& [key, count] : formed) {
      Ledger& l = ledgers_[key.first];
      const auto& ranks = l.round_ranks[key.second];
      if (cut) continue;
      REQUIRE(count == l.round_world[key.second]);
      REQUIRE(static_cast<int>(ranks.size()) == count);
      REQUIRE(*ranks.rbegin() == count - 1);
    }
  }

  // An agent learns restart count `c`; `round`: the round it was told to leave, for a Restart.
  void learn(Agent& a, int c, std::optional<int> round) {
    const RunCfg& cfg = runs_[a.run];
    Ledger& l = ledgers_[a.run];
    INFO("restart count " << c << " told " << l.told);
    REQUIRE(c >= l.told);  // never down
    REQUIRE(c <= cfg.max_restarts);
    if (c == l.told) return;
    REQUIRE(c == l.told + 1);  // one counted restart at a time is ever unheard
    // The failure that caused it: the round left (a Restart) or the latest failed round not
    // yet counted; exactly one failure report's round per counted restart.
    int cause = -1;
    if (round) {
      cause = *round;
    } else {
      for (int r : l.failed) {
        if (l.counted.count(r) == 0) cause = r;
      }
    }
    INFO("caused by round " << cause);
    REQUIRE(l.failed.count(cause) == 1);
    REQUIRE(l.counted.insert(cause).second);  // never counted twice
    l.told = c;
    if (l.unheard == c) l.unheard = -1;
    ++stats_.counted;
  }

  void hear(Agent& a, const v1::ServerMsg& m, std::map<std::pair<int, int>, int>& formed) {
    const RunCfg& cfg = runs_[a.run];
    Ledger& l = ledgers_[a.run];
    const int index = static_cast<int>(&a - agents_.data());
    switch (m.msg_case()) {
      case v1::ServerMsg::kAssignment: {
        const v1::Assignment& as = m.assignment();
        REQUIRE(a.st == St::kWaiting);
        const int r = as.round();
        REQUIRE(as.group_world_size() >= cfg.min);
        REQUIRE(as.group_world_size() <= cfg.max);
        REQUIRE(as.group_rank() >= 0);
        REQUIRE(as.group_rank() < as.group_world_size());
        REQUIRE(as.rank_offset() == 2 * as.group_rank());
        REQUIRE(as.world_size() == 2 * as.group_world_size());
        REQUIRE(as.reattach_timeout_ms() == kReattachTimeout.count());
        if (auto d = l.round_decision.find(r); d != l.round_decision.end()) {
          // A round is formed once: a later leader never forms the same round again.
          REQUIRE(d->second == decision_);
          REQUIRE(as.group_world_size() == l.round_world[r]);
          REQUIRE(as.restart_count() == l.round_count[r]);
        } else {
          REQUIRE((l.round_count.empty() || r > l.round_count.rbegin()->first));
          l.round_decision[r] = decision_;
          l.round_world[r] = as.group_world_size();
          l.round_count[r] = as.restart_count();
        }
        REQUIRE(l.round_ranks[r].insert(as.group_rank()).second);  // unique
        ++formed[{a.run, r}];
        learn(a, as.restart_count(), std::nullopt);
        a.st = St::kRunning;
        a.round = r;
        a.rank = as.group_rank();
        a.reattach = milliseconds(as.reattach_timeout_ms());
        a.report.reset();
        a.reattached = false;
        break;
      }
      case v1::ServerMsg::kRestart: {
        REQUIRE(a.st == St::kRunning);
        const int c = m.restart().restart_count();
        const int was = l.round_count.at(a.round);
        REQUIRE(c >= was);
        REQUIRE(c <= was + 1);
        if (c == was + 1) {
          // A counted restart: a failure report of this round caused it.
          if (c > l.told) {
            learn(a, c, a.round);
          } else {
            REQUIRE(l.counted.count(a.round) == 1);
          }
          if (a.report == false && a.report_term != term_) ++stats_.resent_failure_counted;
        } else {
          learn(a, c, std::nullopt);
        }
        a.st = St::kStopping;
        a.report.reset();
        break;
      }
      case v1::ServerMsg::kDone:
      case v1::ServerMsg::kFail: {
        REQUIRE((a.st == St::kRunning || a.st == St::kWaiting || a.st == St::kStopping ||
                 a.st == St::kAttaching));
        const std::string res = m.SerializeAsString();
        if (l.told_result) {
          REQUIRE(*l.told_result == res);  // one result, whoever tells it
        } else {
          l.told_result = res;
          if (m.has_fail()) {
            // The budget was spent, and the agents had been told so.
            ++stats_.fails;
            REQUIRE(l.told == cfg.max_restarts);
            REQUIRE(l.failed.count(l.round_count.rbegin()->first) == 1);
          } else {
            ++stats_.dones;
          }
        }
        a.st = St::kFinished;
        a.report.reset();
        break;
      }
      case v1::ServerMsg::kAttached: {
        REQUIRE(a.st == St::kAttaching);
        const v1::Attached& at = m.attached();
        REQUIRE(at.round() == a.round);
        if (at.restart_count() > 0 || at.ok()) learn(a, at.restart_count(), std::nullopt);
        if (at.ok()) {
          ++stats_.reattached;
          REQUIRE(at.restart_count() == l.round_count.at(a.round));  // no restart spent
          a.st = St::kRunning;
          a.reattached = true;
          if (a.report) followups_.push_back({index, a.session, true});
        } else {
          // Its workers stop; it joins again on this stream.
          ++stats_.refused_reattach;
          a.st = St::kRefused;
          a.report.reset();
          followups_.push_back({index, a.session, false});
        }
        a.workers = false;
        break;
      }
      case v1::ServerMsg::kKeepAlive:
        break;
      default:
        FAIL("unexpected message " << m.ShortDebugString());
    }
  }

  // Liveness: agents here keep their streams alive, so nobody is ever dropped for silence,
  // a member that re-attached is never lost (the outage's silence does not count), and a
  // place is held at least as long as its node tries to re-attach: time alone (a tick; it
  // restarts nothing else here) loses a place only once its node's own window is over.
  void check_events(const std::vector<RunEvent>& events, bool tick) {
    for (const RunEvent& e : events) {
      if (e.kind != RunEvent::Kind::kNodeLost) continue;
      INFO(e.run_id << ": node " << e.node_id << " lost (" << e.cause << ")");
      REQUIRE(e.cause != "silent");
      for (const Agent& a : agents_) {
        if (a.id != e.node_id) continue;
        REQUIRE_FALSE(a.reattached);
        if (tick && e.cause == "not_reattached" && a.st == St::kOffline && a.workers) {
          REQUIRE(now_ >= a.lost_at + a.reattach);
        }
      }
    }
  }

  // After every step.
  void check() {
    absl::Status st = sm_->check_invariants();
    INFO(st.ToString());
    REQUIRE(st.ok());
    // The store holds exactly each run's record.
    std::set<std::string> held;
    for (const auto& s : sm_->status("")) {
      held.insert(s.run_id());
      auto it = store_.find(s.run_id());
      REQUIRE(it != store_.end());
      REQUIRE(it->second.SerializeAsString() == sm_->record(s.run_id())->SerializeAsString());
    }
    REQUIRE(held.size() == store_.size());
    auto next = sm_->next_deadline();
    REQUIRE((!next || *next > now_));
    for (std::size_t i = 0; i < runs_.size(); ++i) {
      const Ledger& l = ledgers_[i];
      auto it = store_.find(runs_[i].id);
      if (it == store_.end()) {
        REQUIRE_FALSE(l.told_result);
        continue;
      }
      const v1::RunRecord& r = it->second;
      INFO(r.run_id() << ": restart count " << r.restart_count() << ", agents told " << l.told);
      REQUIRE(r.budget_from() == 0);
      REQUIRE(r.restart_count() <= runs_[i].max_restarts);  // budget left never negative
      REQUIRE(r.restart_count() >= l.told);                 // write-ahead
      if (r.restart_count() > l.told) {
        // Only a count a leader wrote and died before telling, with its failure not yet
        // counted.
        REQUIRE(r.restart_count() == l.told + 1);
        REQUIRE(l.unheard == r.restart_count());
        bool uncounted = false;
        for (int f : l.failed) uncounted |= l.counted.count(f) == 0;
        REQUIRE(uncounted);
      }
      if (l.told_result) {
        REQUIRE(r.phase() == v1::RunRecord::FINISHED);
        REQUIRE(r.result().SerializeAsString() == *l.told_result);
      }
      if (l.stored_result) REQUIRE(r.phase() == v1::RunRecord::FINISHED);
    }
  }

  Agent* pick(St st) {
    std::vector<Agent*> v;
    for (Agent& a : agents_) {
      if (a.st == st) v.push_back(&a);
    }
    return v.empty() ? nullptr : v[rng_() % v.size()];
  }

  int run_index(const std::string& id) const {
    for (std::size_t i = 0; i < runs_.size(); ++i) {
      if (runs_[i].id == id) return static_cast<int>(i);
    }
    FAIL("unknown run " << id);
    return -1;
  }

  std::mt19937& rng_;
  Stats& stats_;
  std::vector<RunCfg> runs_;
  std::vector<Agent> agents_;
  std::vector<Ledger> ledgers_;
  std::unique_ptr<StateMachine> sm_;
  std::map<std::string, v1::RunRecord> store_;
  std::map<SessionId, int> by_session_;
  std::deque<Followup> followups_;
  TimePoint now_{};
  SessionId next_session_ = 1;
  std::uint64_t decision_ = 0, term_ = 0;
};

}  // namespace

TEST_CASE("failover: leader changes at random points, between a decision and its write too",
          "[rdzv][failover]") {
  std::mt19937 rng(20240613);
  Stats stats;
  for (int trial = 0; trial < 500; ++trial) {
    INFO("trial " << trial);
    World w(rng, stats);
    for (int step = 0; step < 120; ++step) {
      INFO("step " << step);
      w.step();
    }
    w.settle();
  }
  // The trials reach what they are about.
  INFO("failovers " << stats.failovers << ", lost decisions " << stats.lost << ", cut sends "
                    << stats.cut << ", re-attaches " << stats.reattached << " (refused "
                    << stats.refused_reattach << "), resent reports " << stats.resent
                    << ", lost failures counted after their resend "
                    << stats.resent_failure_counted << ", counted restarts " << stats.counted
                    << ", runs failed " << stats.fails << ", done " << stats.dones
                    << ", failovers with a finished run " << stats.finished_failovers
                    << ", with several runs " << stats.multi_run_restores);
  CHECK(stats.lost >= 600);
  CHECK(stats.cut >= 400);
  CHECK(stats.reattached >= 1000);
  CHECK(stats.refused_reattach >= 200);
  CHECK(stats.resent >= 120);
  CHECK(stats.resent_failure_counted >= 25);
  CHECK(stats.counted >= 800);
  CHECK(stats.fails >= 150);
  CHECK(stats.dones >= 150);
  CHECK(stats.finished_failovers >= 1200);
  CHECK(stats.multi_run_restores >= 2500);
}

namespace {

// One leader at a time and the store they write to, for the step-by-step cases: `decide`
// writes a decision's records and hands back its messages; a decision that is not passed to
// it was lost with its leader.
struct Cluster {
  std::unique_ptr<StateMachine> sm;
  std::map<std::string, v1::RunRecord> store;
  TimePoint now{};

  Cluster() { elect(); }
  // The leader dies; another restores the store.
  void elect() {
    sm = std::make_unique<StateMachine>(timing());
    sm->enable_records();
    std::vector<v1::RunRecord> records;
    for (const auto& [id, r] : store) records.push_back(r);
    auto res = sm->restore(records, now);
    REQUIRE(res.refused.empty());
    decide({});
  }
  std::vector<Outgoing> decide(Decision d) {
    auto c = sm->records(d.touched);
    for (auto& r : c.put) store[r.run_id()] = r;
    for (auto& id : c.erased) store.erase(id);
    absl::Status st = sm->check_invariants();
    INFO(st.ToString());
    REQUIRE(st.ok());
    return std::move(d.messages);
  }
  std::vector<Outgoing> on(SessionId s, const v1::AgentMsg& m) {
    return decide(sm->on_message(s, m, now));
  }
  int count() const { return sm->status("run").at(0).restart_count(); }
};

// a (session 1) and b (2) in round 1 of "run" (nnodes 2, 3 restarts), nothing spent.
struct Round1 {
  Cluster c;
  v1::AgentMsg ja = muster::testing::join_msg("a", 2, 2, 3);
  v1::AgentMsg jb = muster::testing::join_msg("b", 2, 2, 3);
  int rank_a = -1, rank_b = -1;
  Round1() {
    c.on(1, ja);
    auto out = c.on(2, jb);
    auto a = to(out, 1, v1::ServerMsg::kAssignment);
    auto b = to(out, 2, v1::ServerMsg::kAssignment);
    REQUIRE(a.size() == 1);
    REQUIRE(b.size() == 1);
    REQUIRE(a[0].assignment().round() == 1);
    rank_a = a[0].assignment().group_rank();
    rank_b = b[0].assignment().group_rank();
  }
};

}  // namespace

TEST_CASE("failover: a failure whose decision was lost is counted once, after its resend",
          "[rdzv][failover]") {
  Round1 r;
  // a's worker fails. The leader decides (restart 1 of 3) and dies before writing it.
  auto lost = r.c.sm->on_message(1, failure_msg(1), r.c.now).messages;
  REQUIRE(to(lost, 2, v1::ServerMsg::kRestart).size() == 1);
  REQUIRE(to(lost, 2, v1::ServerMsg::kRestart)[0].restart().restart_count() == 1);
  CHECK(r.c.store.at("run").restart_count() == 0);  // nothing written, nobody told
  r.c.now += 3s;
  r.c.elect();
  CHECK(r.c.count() == 0);
  CHECK(r.c.sm->status("run")[0].phase() == "running");
  // Both re-attach to round 1 (their workers never stopped); a sends its failure again.
  auto at_a = to(r.c.on(11, reattach_msg(r.ja, 1, r.rank_a)), 11, v1::ServerMsg::kAttached);
  auto at_b = to(r.c.on(12, reattach_msg(r.jb, 1, r.rank_b)), 12, v1::ServerMsg::kAttached);
  REQUIRE(at_a.size() == 1);
  REQUIRE(at_b.size() == 1);
  CHECK(at_a[0].attached().ok());
  CHECK(at_b[0].attached().ok());
  CHECK(at_a[0].attached().restart_count() == 0);
  auto out = r.c.on(11, failure_msg(1));
  auto rs = to(out, 12, v1::ServerMsg::kRestart);
  REQUIRE(rs.size() == 1);
  CHECK(rs[0].restart().restart_count() == 1);  // counted once, by the new leader
  CHECK(to(out, 11, v1::ServerMsg::kRestart).size() == 1);
  CHECK(r.c.store.at("run").restart_count() == 1);
  // b's worker had failed too, in the same round: that report is stale now, not counted.
  CHECK(r.c.on(12, failure_msg(1)).empty());
  CHECK(r.c.count() == 1);
  // A second leader change after the written decision keeps the count.
  r.c.now += 1s;
  r.c.elect();
  CHECK(r.c.count() == 1);
  r.c.on(21, r.ja);
  auto as = to(r.c.on(22, r.jb), 22, v1::ServerMsg::kAssignment);
  REQUIRE(as.size() == 1);
  CHECK(as[0].assignment().round() == 2);
  CHECK(as[0].assignment().restart_count() == 1);
}

TEST_CASE("failover: a failure decided and written but told to nobody is not counted again",
          "[rdzv][failover]") {
  Round1 r;
  // The leader writes restart 1 and dies before sending any Restart.
  r.c.on(1, failure_msg(1));
  REQUIRE(r.c.store.at("run").restart_count() == 1);
  r.c.now += 3s;
  r.c.elect();
  CHECK(r.c.count() == 1);
  // a re-attaches to round 1: it is gone. a is told the count and does not send its failure
  // again: it stops its workers and joins again.
  auto at = to(r.c.on(11, reattach_msg(r.ja, 1, r.rank_a)), 11, v1::ServerMsg::kAttached);
  REQUIRE(at.size() == 1);
  CHECK_FALSE(at[0].attached().ok());
  CHECK(at[0].attached().restart_count() == 1);
  CHECK_THAT(at[0].attached().reason(), Catch::Contains("forming round 2"));
  r.c.on(11, r.ja);
  auto as = to(r.c.on(12, r.jb), 12, v1::ServerMsg::kAssignment);
  REQUIRE(as.size() == 1);
  CHECK(as[0].assignment().round() == 2);
  CHECK(as[0].assignment().restart_count() == 1);
  // The next failure is the second restart, not the third.
  auto rs = to(r.c.on(11, failure_msg(2)), 12, v1::ServerMsg::kRestart);
  REQUIRE(rs.size() == 1);
  CHECK(rs[0].restart().restart_count() == 2);
}
