#include "muster/rendezvous/state_machine.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace muster::rendezvous {
namespace {

Outgoing send(SessionId s, v1::ServerMsg msg) {
  Outgoing o;
  o.session = s;
  o.msg = std::move(msg);
  return o;
}

Outgoing close_with(SessionId s, absl::Status status) {
  Outgoing o;
  o.session = s;
  o.close = true;
  o.status = std::move(status);
  return o;
}

absl::Status validate(const v1::Join& j) {
  if (j.run_id().empty()) return absl::InvalidArgumentError("join: empty run id");
  if (j.run_id().size() > kMaxIdLength || j.node_id().size() > kMaxIdLength ||
      j.host().size() > kMaxIdLength) {
    return absl::InvalidArgumentError("join: run id, node id or host longer than 256 bytes");
  }
  if (j.local_world_size() < 1 || j.local_world_size() > kMaxLocalWorldSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("join: local_world_size ", j.local_world_size(), " out of range"));
  }
  if (j.min_nodes() < 1 || j.max_nodes() < j.min_nodes() || j.max_nodes() > kMaxNodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("join: bad node range ", j.min_nodes(), ":", j.max_nodes()));
  }
  if (j.max_restarts() < 0) return absl::InvalidArgumentError("join: negative max_restarts");
  if (j.master_port_candidate() < 0 || j.master_port_candidate() > 65535) {
    return absl::InvalidArgumentError("join: master port out of range");
  }
  if (j.requested_rank() >= j.max_nodes()) {
    return absl::InvalidArgumentError(absl::StrCat("join: node rank ", j.requested_rank(),
                                                   " is not below max nodes ", j.max_nodes()));
  }
  return absl::OkStatus();
}

}  // namespace

std::size_t StateMachine::num_active_runs() const {
  return std::count_if(runs_.begin(), runs_.end(),
                       [](const auto& kv) { return kv.second.phase != Phase::kFinished; });
}

StateMachine::Run* StateMachine::run_of(SessionId session) {
  auto it = session_run_.find(session);
  if (it == session_run_.end()) return nullptr;
  auto r = runs_.find(it->second);
  return r == runs_.end() ? nullptr : &r->second;
}

std::vector<Outgoing> StateMachine::on_message(SessionId session, const v1::AgentMsg& msg,
                                               TimePoint now) {
  std::vector<Outgoing> out;
  if (msg.has_join()) return on_join(session, msg.join(), now);
  Run* run = run_of(session);
  if (run == nullptr) {
    out.push_back(
        close_with(session, absl::FailedPreconditionError("protocol error: message before join")));
    return out;
  }
  if (auto seen = run->last_seen.find(session); seen != run->last_seen.end()) seen->second = now;
  if (msg.has_failure()) {
    on_failure(*run, session, msg.failure(), now, out);
  } else if (msg.has_success()) {
    on_success(*run, session, msg.success(), now, out);
  }
  // KeepAlive: liveness is the stream itself; nothing to do.
  return out;
}

std::vector<Outgoing> StateMachine::on_join(SessionId session, const v1::Join& join,
                                            TimePoint now) {
  std::vector<Outgoing> out;
  if (absl::Status st = validate(join); !st.ok()) {
    out.push_back(close_with(session, st));
    return out;
  }
  auto [it, inserted] = runs_.try_emplace(join.run_id());
  Run& run = it->second;
  if (inserted) {
    run.id = join.run_id();
    run.min_nodes = join.min_nodes();
    run.max_nodes = join.max_nodes();
    run.max_restarts = join.max_restarts();
    run.timeouts = timeouts_;
    using ms = std::chrono::milliseconds;
    if (join.join_timeout_ms() > 0) run.timeouts.join_timeout = ms(join.join_timeout_ms());
    if (join.last_call_timeout_ms() > 0) {
      run.timeouts.last_call_timeout = ms(join.last_call_timeout_ms());
    }
    if (join.keep_alive_interval_ms() > 0) {
      run.timeouts.keep_alive_interval = ms(join.keep_alive_interval_ms());
    }
    if (join.keep_alive_max_attempt() > 0) {
      run.timeouts.keep_alive_max_attempt = join.keep_alive_max_attempt();
    }
  }
  if (run.phase == Phase::kFinished) {
    out.push_back(close_with(session, absl::FailedPreconditionError(absl::StrCat(
                                          "run '", run.id, "' has already finished"))));
    return out;
  }
  if (join.min_nodes() != run.min_nodes || join.max_nodes() != run.max_nodes ||
      join.max_restarts() != run.max_restarts) {
    out.push_back(close_with(
        session,
        absl::InvalidArgumentError(absl::StrCat(
            "run '", run.id, "' is configured with nnodes=", run.min_nodes, ":", run.max_nodes,
            " max_restarts=", run.max_restarts, ", this node asked for ", join.min_nodes(), ":",
            join.max_nodes(), " max_restarts=", join.max_restarts()))));
    if (inserted) runs_.erase(it);
    return out;
  }
  // A rejoin on the same stream (after a Restart) replaces any earlier entry.
  auto same = [session](const Node& n) { return n.session == session; };
  run.waiting.erase(std::remove_if(run.waiting.begin(), run.waiting.end(), same),
                    run.waiting.end());
  run.waiting.push_back(Node{session, join});
  session_run_[session] = run.id;
  run.last_seen[session] = now;
  if (!run.keep_alive_check) run.keep_alive_check = now + run.timeouts.keep_alive_interval;

  if (run.phase == Phase::kRunning) {
    // A newcomer while a round runs: scale up if there is room, else it waits as a spare.
    if (static_cast<int>(run.members.size()) < run.max_nodes) {
      restart(run, absl::StrCat("node ", join.node_id(), " joined; scaling up"), false, now, out);
    }
    return out;
  }
  if (!run.join_deadline) run.join_deadline = now + run.timeouts.join_timeout;
  maybe_close_round(run, now, out);
  return out;
}

void StateMachine::maybe_close_round(Run& run, TimePoint now, std::vector<Outgoing>& out) {
  const int n = static_cast<int>(run.waiting.size());
  if (n >= run.max_nodes) {
    close_round(run, now, out);
    return;
  }
  if (n >= run.min_nodes) {
    // After a restart, the round closes as soon as every surviving node is back.
    if (!run.expected.empty() &&
        std::all_of(run.expected.begin(), run.expected.end(), [&run](const std::string& id) {
          return std::any_of(run.waiting.begin(), run.waiting.end(),
                             [&id](const Node& w) { return w.join.node_id() == id; });
        })) {
      close_round(run, now, out);
      return;
    }
    if (!run.last_call_deadline) {
      run.last_call_deadline = now + run.timeouts.last_call_timeout;
    }
    if (now >= *run.last_call_deadline) close_round(run, now, out);
  } else {
    run.last_call_deadline.reset();
  }
}

void StateMachine::close_round(Run& run, TimePoint now, std::vector<Outgoing>& out) {
  const int count = std::min<int>(run.max_nodes, run.waiting.size());
  // Who gets in: requested ranks and previous members first, then join order.
  std::stable_partition(run.waiting.begin(), run.waiting.end(), [&](const Node& n) {
    return n.join.requested_rank() >= 0 || run.last_rank.count(n.join.node_id()) > 0;
  });
  std::vector<Node> members(run.waiting.begin(), run.waiting.begin() + count);
  run.waiting.erase(run.waiting.begin(), run.waiting.begin() + count);

  // Stable group ranks: requested rank, else the previous one if still in range, else the
  // lowest free one.
  std::vector<int> rank(count, -1);
  std::vector<bool> taken(count, false);
  auto claim = [&](int i, int r) {
    if (r >= 0 && r < count && !taken[r]) {
      rank[i] = r;
      taken[r] = true;
    }
  };
  for (int i = 0; i < count; ++i) claim(i, members[i].join.requested_rank());
  for (int i = 0; i < count; ++i) {
    auto prev = run.last_rank.find(members[i].join.node_id());
    if (rank[i] < 0 && prev != run.last_rank.end()) claim(i, prev->second);
  }
  int next_free = 0;
  for (int i = 0; i < count; ++i) {
    if (rank[i] >= 0) continue;
    while (taken[next_free]) ++next_free;
    claim(i, next_free);
  }
  std::vector<Node> ordered(count);
  for (int i = 0; i < count; ++i) ordered[rank[i]] = std::move(members[i]);

  ++run.round;
  run.members = std::move(ordered);
  run.succeeded.clear();
  run.last_rank.clear();
  run.phase = Phase::kRunning;
  run.expected.clear();
  run.join_deadline.reset();
  run.last_call_deadline.reset();

  int world_size = 0;
  for (const Node& n : run.members) world_size += n.join.local_world_size();
  const v1::Join& master = run.members.front().join;
  int offset = 0;
  for (int r = 0; r < count; ++r) {
    const Node& n = run.members[r];
    run.last_rank[n.join.node_id()] = r;
    v1::ServerMsg msg;
    v1::Assignment* a = msg.mutable_assignment();
    a->set_round(run.round);
    a->set_group_rank(r);
    a->set_group_world_size(count);
    a->set_rank_offset(offset);
    a->set_world_size(world_size);
    a->set_master_addr(master.host());
    a->set_master_port(master.master_port_candidate());
    a->set_store_prefix(absl::StrCat("/", run.id, "/", run.round, "/"));
    a->set_restart_count(run.restart_count);
    out.push_back(send(n.session, std::move(msg)));
    offset += n.join.local_world_size();
  }
  // Spares left over keep waiting for the next round.
  if (!run.waiting.empty()) run.join_deadline.reset();
}

void StateMachine::restart(Run& run, const std::string& reason, bool counts, TimePoint now,
                           std::vector<Outgoing>& out) {
  if (counts) ++run.restart_count;
  run.expected.clear();
  for (const Node& n : run.members) {
    run.expected.insert(n.join.node_id());
    v1::ServerMsg msg;
    msg.mutable_restart()->set_reason(reason);
    msg.mutable_restart()->set_restart_count(run.restart_count);
    out.push_back(send(n.session, std::move(msg)));
  }
  run.members.clear();
  run.succeeded.clear();
  run.phase = Phase::kJoining;
  run.join_deadline = now + run.timeouts.join_timeout;
  run.last_call_deadline.reset();
  maybe_close_round(run, now, out);  // spares may already make a round
}

void StateMachine::finish(Run& run, const v1::ServerMsg& last, TimePoint now,
                          std::vector<Outgoing>& out) {
  for (const std::vector<Node>* group : {&run.members, &run.waiting}) {
    for (const Node& n : *group) {
      out.push_back(send(n.session, last));
      out.push_back(close_with(n.session, absl::OkStatus()));
      session_run_.erase(n.session);
    }
  }
  run.members.clear();
  run.waiting.clear();
  run.succeeded.clear();
  run.expected.clear();
  run.last_seen.clear();
  run.phase = Phase::kFinished;
  run.join_deadline.reset();
  run.last_call_deadline.reset();
  run.keep_alive_check.reset();
  run.expires_at = now + run.timeouts.finished_run_grace;
}

void StateMachine::on_failure(Run& run, SessionId session, const v1::ReportFailure& f,
                              TimePoint now, std::vector<Outgoing>& out) {
  auto member = std::find_if(run.members.begin(), run.members.end(),
                             [session](const Node& n) { return n.session == session; });
  // Only the running round's members count; a report for an older round is stale.
  if (run.phase != Phase::kRunning || member == run.members.end() || f.round() != run.round) {
    return;
  }
  const v1::WorkerFailure& rc = f.root_cause();
  if (run.restart_count < run.max_restarts) {
    restart(run,
            absl::StrCat("worker rank ", rc.rank(), " on ", rc.host(), " failed; restart ",
                         run.restart_count + 1, " of ", run.max_restarts),
            true, now, out);
    return;
  }
  v1::ServerMsg msg;
  v1::Fail* fail = msg.mutable_fail();
  fail->set_reason(run.max_restarts == 0 ? std::string("a worker failed and max_restarts is 0")
                                         : absl::StrCat("a worker failed and all ",
                                                        run.max_restarts, " restarts are spent"));
  *fail->mutable_root_cause() = rc;
  *fail->mutable_others() = f.others();
  finish(run, msg, now, out);
}

void StateMachine::on_success(Run& run, SessionId session, const v1::ReportSuccess& s,
                              TimePoint now, std::vector<Outgoing>& out) {
  bool member = std::any_of(run.members.begin(), run.members.end(),
                            [session](const Node& n) { return n.session == session; });
  if (run.phase != Phase::kRunning || !member || s.round() != run.round) return;
  run.succeeded.insert(session);
  if (run.succeeded.size() == run.members.size()) {
    v1::ServerMsg msg;
    msg.mutable_done();
    finish(run, msg, now, out);
  }
}

std::vector<Outgoing> StateMachine::on_stream_closed(SessionId session, TimePoint now) {
  std::vector<Outgoing> out;
  Run* run = run_of(session);
  if (run == nullptr) {
    session_run_.erase(session);
    return out;
  }
  drop_session(*run, session, now, out);
  if (run->phase == Phase::kJoining && run->waiting.empty() && run->members.empty() &&
      run->round == 0) {
    runs_.erase(run->id);  // nobody ever formed a round: forget the run
  }
  return out;
}

void StateMachine::drop_session(Run& run, SessionId session, TimePoint now,
                                std::vector<Outgoing>& out) {
  session_run_.erase(session);
  run.last_seen.erase(session);
  auto same = [session](const Node& n) { return n.session == session; };
  auto w = std::find_if(run.waiting.begin(), run.waiting.end(), same);
  if (w != run.waiting.end()) {
    run.expected.erase(w->join.node_id());
    run.waiting.erase(w);
  }
  auto member = std::find_if(run.members.begin(), run.members.end(), same);
  if (run.phase == Phase::kRunning && member != run.members.end()) {
    std::string node = member->join.node_id();
    run.members.erase(member);
    restart(run, absl::StrCat("node ", node, " left the run"), false, now, out);
  } else if (run.phase == Phase::kJoining) {
    maybe_close_round(run, now, out);
  }
}

void StateMachine::check_keep_alive(Run& run, TimePoint now, std::vector<Outgoing>& out) {
  const auto limit = run.timeouts.keep_alive_interval * run.timeouts.keep_alive_max_attempt;
  std::vector<SessionId> silent;
  for (const auto& [session, seen] : run.last_seen) {
    if (now - seen >= limit) silent.push_back(session);
  }
  for (SessionId s : silent) {
    out.push_back(
        close_with(s, absl::UnavailableError(absl::StrCat(
                          "no keep-alive from this node for ",
                          std::chrono::duration_cast<std::chrono::milliseconds>(limit).count(),
                          " ms: it was dropped from run '", run.id, "'"))));
    drop_session(run, s, now, out);
  }
  run.keep_alive_check = now + run.timeouts.keep_alive_interval;
}

std::vector<v1::RunStatus> StateMachine::status(const std::string& run_id) const {
  std::vector<v1::RunStatus> out;
  for (const auto& [id, run] : runs_) {
    if (!run_id.empty() && id != run_id) continue;
    v1::RunStatus s;
    s.set_run_id(id);
    s.set_phase(run.phase == Phase::kJoining   ? "joining"
                : run.phase == Phase::kRunning ? "running"
                                               : "finished");
    s.set_round(run.round);
    s.set_restart_count(run.restart_count);
    s.set_max_restarts(run.max_restarts);
    s.set_min_nodes(run.min_nodes);
    s.set_max_nodes(run.max_nodes);
    int world = 0;
    for (const Node& n : run.members) {
      s.add_members(n.join.node_id());
      world += n.join.local_world_size();
    }
    s.set_world_size(world);
    s.set_waiting(static_cast<int>(run.waiting.size()));
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<Outgoing> StateMachine::on_tick(TimePoint now) {
  std::vector<Outgoing> out;
  for (auto it = runs_.begin(); it != runs_.end();) {
    Run& run = it->second;
    if (run.phase == Phase::kFinished) {
      if (run.expires_at && now >= *run.expires_at) {
        it = runs_.erase(it);
        continue;
      }
    }
    if (run.phase != Phase::kFinished && run.keep_alive_check && now >= *run.keep_alive_check) {
      check_keep_alive(run, now, out);
    }
    if (run.phase == Phase::kJoining) {
      if (run.last_call_deadline && now >= *run.last_call_deadline) {
        maybe_close_round(run, now, out);
      } else if (run.join_deadline && now >= *run.join_deadline &&
                 static_cast<int>(run.waiting.size()) < run.min_nodes) {
        absl::Status st = absl::DeadlineExceededError(
            absl::StrCat("rendezvous for run '", run.id, "' timed out: ", run.waiting.size(),
                         " of at least ", run.min_nodes, " nodes joined within the join timeout"));
        for (const Node& n : run.waiting) {
          out.push_back(close_with(n.session, st));
          session_run_.erase(n.session);
        }
        it = runs_.erase(it);
        continue;
      }
    }
    ++it;
  }
  return out;
}

std::optional<TimePoint> StateMachine::next_deadline() const {
  std::optional<TimePoint> best;
  auto consider = [&best](const std::optional<TimePoint>& t) {
    if (t && (!best || *t < *best)) best = t;
  };
  for (const auto& [id, run] : runs_) {
    consider(run.join_deadline);
    consider(run.last_call_deadline);
    consider(run.expires_at);
    consider(run.keep_alive_check);
  }
  return best;
}

}  // namespace muster::rendezvous
