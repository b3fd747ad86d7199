// The state machine's clock-driven rules: progress and stalls, keep-alives and silence, the
// join and last-call deadlines, held places, and when on_tick next has work.
#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "muster/rendezvous/stall.h"
#include "muster/rendezvous/state_machine.h"
#include "machine/state_machine_internal.h"

namespace muster::rendezvous {

using namespace internal;
using std::chrono::milliseconds;

namespace {

// A progress report's links (docs/stragglers.md, "Slow links"), at the edge.
absl::Status check_links(const v1::Progress& p) {
  if (p.links_size() > limits::kMaxLinkReports) {
    return absl::InvalidArgumentError(absl::StrCat("progress: ", p.links_size(),
                                                   " links (the limit is ",
                                                   limits::kMaxLinkReports, ")"));
  }
  for (const v1::LinkRate& l : p.links()) {
    if (l.local().size() > limits::kMaxLinkAddressBytes ||
        l.remote().size() > limits::kMaxLinkAddressBytes) {
      return absl::InvalidArgumentError(absl::StrCat("progress: a link address longer than ",
                                                     limits::kMaxLinkAddressBytes, " bytes"));
    }
    if (!(l.mbps() >= 0) || !std::isfinite(l.mbps())) {
      return absl::InvalidArgumentError("progress: a link rate that is not a finite number >= 0");
    }
  }
  return absl::OkStatus();
}

}  // namespace

void StateMachine::on_progress(Run& run, SessionId session, const v1::Progress& p,
                               TimePoint now, std::vector<Outgoing>& out) {
  if (run.phase != Phase::kRunning || p.round() != run.round) return;  // a late report
  const Node* node = nullptr;
  for (const Node& n : run.members) {
    if (n.session == session) node = &n;
  }
  if (node == nullptr) return;
  if (p.ranks_size() > node->join.local_world_size()) {
    refuse(session,
           absl::InvalidArgumentError(absl::StrCat("progress: ", p.ranks_size(),
                                                   " ranks from a node of ",
                                                   node->join.local_world_size())),
           now, out);
    return;
  }
  for (const v1::RankProgress& r : p.ranks()) {
    if (r.kind_ns_size() > limits::kMaxPhaseKinds) {
      refuse(session,
             absl::InvalidArgumentError(absl::StrCat("progress: ", r.kind_ns_size(),
                                                     " phase kinds (the limit is ",
                                                     limits::kMaxPhaseKinds, ")")),
             now, out);
      return;
    }
    if (r.phase().size() > limits::kMaxProgressPhaseBytes) {
      refuse(session,
             absl::InvalidArgumentError(absl::StrCat("progress: a phase of ", r.phase().size(),
                                                     " bytes (the limit is ",
                                                     limits::kMaxProgressPhaseBytes, ")")),
             now, out);
      return;
    }
  }
  if (absl::Status st = check_links(p); !st.ok()) {
    refuse(session, st, now, out);
    return;
  }
  for (const v1::RankProgress& r : p.ranks()) {
    if (r.reports() == 0) continue;
    auto [it, fresh] = run.budget.round_steps.try_emplace(r.rank(), r.step(), r.step());
    if (!fresh) it->second.second = std::max(it->second.second, r.step());
  }
  if (run.stragglers.watch && watch_stragglers(run, session, p, now, out)) return;
  if (run.config.timeouts.hang_timeout.count() == 0 || run.stall_sent) return;  // nobody asked, or told
  run.nodes.set_progress(session, now, p);
  if (run.next_stall_check && now < *run.next_stall_check) return;
  run.next_stall_check = after(now, std::clamp(run.config.timeouts.hang_timeout / 4,
                                               std::chrono::milliseconds(50),
                                               std::chrono::milliseconds(1000)));
  // The rule over every node's ranks, each as its node last saw it.
  std::vector<RankProgress> ranks;
  std::map<int, const Node*> holder;
  for (const Node& n : run.members) {
    const NodeState* node = run.nodes.find(n.session);
    if (node == nullptr || !node->progress) continue;
    const auto& [at, prog] = *node->progress;
    for (const v1::RankProgress& r : prog.ranks()) {
      RankProgress x;
      x.rank = r.rank();
      x.local_rank = r.local_rank();
      x.pid = static_cast<pid_t>(r.pid());
      x.step = r.step();
      x.reports = r.reports();
      x.phase = r.phase();
      const auto still = std::chrono::milliseconds(
          std::clamp<std::int64_t>(r.still_ms(), 0, limits::kMaxHangTimeout.count()));
      x.changed = at - still;
      ranks.push_back(std::move(x));
      holder[r.rank()] = &n;
    }
  }
  auto stall = find_stall(ranks, now, run.config.timeouts.hang_timeout);
  if (!stall) return;
  run.stall_sent = true;
  const Node& n = *holder[stall->rank.rank];
  v1::ServerMsg msg;
  v1::Stalled* s = msg.mutable_stalled();
  s->set_round(run.round);
  s->set_rank(stall->rank.rank);
  s->set_description(stall->describe(n.join.host()));
  out.push_back(send(n.session, std::move(msg)));
}

void StateMachine::check_keep_alive(Run& run, TimePoint now, std::vector<Outgoing>& out) {
  const milliseconds limit =
      times(run.config.timeouts.keep_alive_interval, run.config.timeouts.keep_alive_max_attempt);
  std::vector<SessionId> silent;
  for (const auto& [session, node] : run.nodes.all()) {
    if (node.last_seen && after(*node.last_seen, limit) <= now) silent.push_back(session);
  }
  // All of them first, then one restart: dropping them one by one could close a round
  // with a silent node that the next step drops again.
  std::vector<std::string> lost;
  for (SessionId s : silent) {
    out.push_back(close_with(
        s, absl::UnavailableError(absl::StrCat("no keep-alive from this node for ", limit.count(),
                                               " ms: it was dropped from run '", run.id, "'"))));
    if (auto node = remove_session(run, s, now, "silent")) lost.push_back(std::move(*node));
  }
  if (!silent.empty()) after_loss(run, lost, now, out);
  // The next check is when the node heard from longest ago would become silent, so a
  // silent node is dropped exactly at the end of the window, not up to an interval later.
  std::optional<TimePoint> next;
  for (const auto& [session, node] : run.nodes.all()) {
    if (!node.last_seen) continue;
    const TimePoint due = after(*node.last_seen, limit);
    if (!next || due < *next) next = due;
  }
  run.keep_alive_check = next ? next : deadline(now, run.config.timeouts.keep_alive_interval);
}

void StateMachine::tick_run(const std::string& run_id, TimePoint now,
                            std::vector<Outgoing>& out) {
  auto it = runs_.find(run_id);
  if (it == runs_.end()) return;
  Run& run = it->second;
  if (run.phase == Phase::kFinished) {
    if (run.expires_at && now >= *run.expires_at) {
      runs_.erase(it);
      touch(run_id);
    }
    return;
  }
  // A restored run: places not re-attached in time are lost; a hold nobody came for ends.
  if (run.reattach_until && now >= *run.reattach_until) {
    run.reattach_until.reset();
    std::vector<std::string> lost = drop_detached(run, now, "not_reattached");
    after_loss(run, lost, now, out);
    if (drop_if_unheld(run_id)) return;
  }
  if (run.held_until && now >= *run.held_until) {
    run.held_until.reset();
    if (drop_if_unheld(run_id)) return;
  }
  if (run.keep_alive_check && now >= *run.keep_alive_check) {
    check_keep_alive(run, now, out);
    if (drop_if_unheld(run_id)) return;
  }
  if (run.phase != Phase::kJoining) return;
  // Survivors past their hold no longer hold the round.
  std::optional<TimePoint> latest_hold;
  if (run.nodes.expected_count() > 0) {
    std::vector<SessionId> given_up;
    for (const auto& [session, node] : run.nodes.all()) {
      if (!node.expected_until || survivor_back(node)) continue;
      if (now >= *node.expected_until) {
        given_up.push_back(session);
      } else if (!latest_hold || *node.expected_until > *latest_hold) {
        latest_hold = node.expected_until;
      }
    }
    for (SessionId s : given_up) run.nodes.clear_expected(s);
  }
  maybe_close_round(run, now, out);  // the last call, or survivors given up on
  if (run.phase != Phase::kJoining || !run.join_deadline || now < *run.join_deadline) return;
  if (static_cast<int>(run.waiting.size()) >= run.config.min_nodes) {
    run.join_deadline.reset();  // min was reached: the join timeout no longer applies
    return;
  }
  if (latest_hold) {
    // Below min, but survivors may still come back: give them their time first.
    run.join_deadline = latest_hold;
    return;
  }
  absl::Status st = absl::DeadlineExceededError(
      absl::StrCat("rendezvous for run '", run.id, "' timed out: ", run.waiting.size(),
                   " of at least ", run.config.min_nodes, " nodes joined within the join timeout"));
  {
    RunEvent& e = emit(RunEvent::Kind::kFailed, run, now);
    e.cause = "join_timeout";
    e.reason = std::string(st.message());
  }
  for (const auto& [session, node] : run.nodes.all()) {
    if (!node.last_seen) continue;
    out.push_back(close_with(session, st));
    session_run_.erase(session);
  }
  runs_.erase(it);
  touch(run_id);
}

Decision StateMachine::on_tick(TimePoint now) {
  std::vector<Outgoing> out;
  // By id, not by iterator: a run's tick may drop it.
  std::vector<std::string> ids;
  ids.reserve(runs_.size());
  for (const auto& [id, run] : runs_) ids.push_back(id);
  for (const std::string& id : ids) tick_run(id, now, out);
  return decided(std::move(out));
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
    consider(run.reattach_until);
    consider(run.held_until);
    if (run.phase == Phase::kJoining) {
      if (run.nodes.expected_count() > 0) {
        for (const auto& [session, node] : run.nodes.all()) {
          if (node.expected_until && !survivor_back(node)) consider(node.expected_until);
        }
      }
    }
  }
  return best;
}
}  // namespace muster::rendezvous
