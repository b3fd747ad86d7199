// The state machine's durable state: RunRecords out (record, records) and back in
// (restore). The rules are in state_machine.h ("Durability and re-attach").
#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "muster/rendezvous/state_machine.h"
#include "machine/state_machine_internal.h"

namespace muster::rendezvous {

using namespace internal;

namespace {

using std::chrono::milliseconds;

absl::Status check_record(const v1::RunRecord& r) {
  auto bad = [](auto&&... what) { return absl::InvalidArgumentError(absl::StrCat(what...)); };
  if (r.format() != kRunRecordFormat) {
    return bad("record format ", r.format(), " (this server reads ", kRunRecordFormat, ")");
  }
  if (r.run_id().empty() || r.run_id().size() > limits::kMaxIdBytes ||
      !ops::is_valid_utf8(r.run_id())) {
    return bad("the run id is empty, too long or not UTF-8");
  }
  if (r.min_nodes() < 1 || r.max_nodes() < r.min_nodes() || r.max_nodes() > kMaxNodes ||
      r.max_restarts() < 0) {
    return bad("bad node range ", r.min_nodes(), ":", r.max_nodes(), " or max_restarts ",
               r.max_restarts());
  }
  if (r.round() < 0 || r.restart_count() < 0 || r.budget_from() < 0 ||
      r.budget_from() > r.restart_count() ||
      r.restart_count() - r.budget_from() > r.max_restarts() ||
      r.restarts_without_progress() < 0) {
    return bad("bad round ", r.round(), " or restart count ", r.restart_count(), " (budget from ",
               r.budget_from(), ", max ", r.max_restarts(), ")");
  }
  const bool running = r.phase() == v1::RunRecord::RUNNING;
  switch (r.phase()) {
    case v1::RunRecord::JOINING:
      break;
    case v1::RunRecord::RUNNING:
      if (r.round() < 1 || r.members_size() < r.min_nodes() || r.members_size() > r.max_nodes()) {
        return bad("running round ", r.round(), " with ", r.members_size(), " members");
      }
      break;
    case v1::RunRecord::FINISHED:
      if (!r.result().has_done() && !r.result().has_fail()) return bad("finished without a result");
      break;
    default:
      return bad("unknown phase ", static_cast<int>(r.phase()));
  }
  if (!running && r.members_size() > 0) return bad("members outside a running round");
  std::set<std::string> nodes;
  for (const v1::Join& j : r.members()) {
    if (absl::Status st = validate(j); !st.ok()) return st;
    if (j.run_id() != r.run_id() || j.min_nodes() != r.min_nodes() ||
        j.max_nodes() != r.max_nodes() || !j.token().empty() || j.reattach_round() != 0) {
      return bad("member ", j.node_id(), " does not match its run");
    }
    if (!nodes.insert(j.node_id()).second) return bad("node ", j.node_id(), " is twice a member");
  }
  if (r.last_rank_size() > r.max_nodes()) return bad(r.last_rank_size(), " last ranks");
  for (const v1::RankOf& l : r.last_rank()) {
    if (l.rank() < 0 || l.rank() >= r.max_nodes() || l.node_id().size() > limits::kMaxIdBytes ||
        !ops::is_valid_utf8(l.node_id())) {
      return bad("bad last rank ", l.rank());
    }
  }
  return absl::OkStatus();
}

}  // namespace

v1::RunRecord StateMachine::record_of(const Run& run) const {
  v1::RunRecord r;
  r.set_format(kRunRecordFormat);
  r.set_run_id(run.id);
  r.set_phase(run.phase == Phase::kJoining   ? v1::RunRecord::JOINING
              : run.phase == Phase::kRunning ? v1::RunRecord::RUNNING
                                             : v1::RunRecord::FINISHED);
  r.set_round(run.round);
  r.set_restart_count(run.restart_count);
  r.set_min_nodes(run.config.min_nodes);
  r.set_max_nodes(run.config.max_nodes);
  r.set_max_restarts(run.config.max_restarts);
  const RendezvousTimeouts& t = run.config.timeouts;
  r.set_join_timeout_ms(t.join_timeout.count());
  r.set_last_call_timeout_ms(t.last_call_timeout.count());
  r.set_keep_alive_interval_ms(t.keep_alive_interval.count());
  r.set_keep_alive_max_attempt(t.keep_alive_max_attempt);
  r.set_hang_timeout_ms(t.hang_timeout.count());
  r.set_finished_run_grace_ms(t.finished_run_grace.count());
  r.set_reattach_timeout_ms(t.reattach_timeout.count());
  r.set_max_restarts_without_progress(run.budget.max_restarts_without_progress);
  r.set_budget_reset_steps(run.budget.reset_steps);
  r.set_restarts_without_progress(run.budget.restarts_without_progress);
  r.set_budget_from(run.budget.from);
  r.set_watch_stragglers(run.stragglers.watch);
  r.set_exclude_stragglers(run.stragglers.exclude);
  r.set_straggler_cooldown_ms(run.stragglers.cooldown.count());
  if (run.phase == Phase::kRunning) {
    for (const Node& n : run.members) *r.add_members() = n.join;
  }
  for (const auto& [node, place] : run.places) {
    v1::RankOf* l = r.add_last_rank();
    l->set_node_id(node);
    l->set_rank(place.group_rank);
  }
  if (run.phase == Phase::kFinished && run.result) *r.mutable_result() = *run.result;
  return r;
}

std::optional<v1::RunRecord> StateMachine::record(const std::string& run_id) const {
  auto it = runs_.find(run_id);
  if (it == runs_.end()) return std::nullopt;
  return record_of(it->second);
}

StateMachine::RecordChanges StateMachine::records(const std::set<std::string>& runs) {
  RecordChanges c;
  if (!recording_) return c;
  for (const std::string& id : runs) {
    unrecorded_.erase(id);
    auto it = runs_.find(id);
    if (it == runs_.end()) {
      if (recorded_.erase(id) > 0) c.erased.push_back(id);
      continue;
    }
    v1::RunRecord r = record_of(it->second);
    std::string bytes = r.SerializeAsString();
    std::string& last = recorded_[id];
    if (!last.empty() && last == bytes) continue;  // an event that changed nothing durable
    last = std::move(bytes);
    c.put.push_back(std::move(r));
  }
  return c;
}

StateMachine::RestoreResult StateMachine::restore(const std::vector<v1::RunRecord>& records,
                                                  TimePoint now) {
  RestoreResult res;
  for (const v1::RunRecord& rec : records) {
    const std::string name = ops::printable_utf8(rec.run_id(), limits::kMaxIdBytes);
    if (absl::Status st = check_record(rec); !st.ok()) {
      res.refused.push_back(absl::StrCat("run '", name, "': ", st.message()));
      continue;
    }
    if (runs_.count(rec.run_id()) > 0) {
      res.refused.push_back(absl::StrCat("run '", name, "': held already"));
      continue;
    }
    if (runs_.size() >= limits::kMaxRuns) {
      res.refused.push_back(absl::StrCat("run '", name, "': the server holds ", runs_.size(),
                                         " runs, its limit"));
      continue;
    }
    Run& run = runs_[rec.run_id()];
    run.id = rec.run_id();
    run.config.min_nodes = rec.min_nodes();
    run.config.max_nodes = rec.max_nodes();
    run.config.max_restarts = rec.max_restarts();
    run.round = rec.round();
    run.restart_count = rec.restart_count();
    run.budget.max_restarts_without_progress =
        std::clamp(rec.max_restarts_without_progress(), 0, limits::kMaxRestartsWithoutProgress);
    run.budget.reset_steps = std::max<std::int64_t>(0, rec.budget_reset_steps());
    run.budget.restarts_without_progress = rec.restarts_without_progress();
    run.budget.from = rec.budget_from();
    run.stragglers.watch = rec.watch_stragglers();
    run.stragglers.exclude = rec.exclude_stragglers();
    run.stragglers.cooldown = client_duration(rec.straggler_cooldown_ms(),
                                             limits::kDefaultStragglerCooldown,
                                             limits::kMaxStragglerCooldown);
    // The timing within the bounds a Join gets, or the operator's own (unclamped) defaults
    // where those are larger (a record is input too); 0 or less: the server's default.
    TimingRequest asked = timing_asked(rec);
    asked.finished_run_grace_ms = rec.finished_run_grace_ms();
    run.config.timeouts = run_timing(timeouts_, asked, TimingSource::kRecord);
    const RendezvousTimeouts& t = run.config.timeouts;
    for (const v1::RankOf& l : rec.last_rank()) run.places[l.node_id()].group_rank = l.rank();
    switch (rec.phase()) {
      case v1::RunRecord::RUNNING:
        run.phase = Phase::kRunning;
        for (const v1::Join& j : rec.members()) {
          const SessionId placeholder = next_detached_++;
          run.members.push_back(Node{placeholder, j});
          run.nodes.add_detached(placeholder);
        }
        run.reattach_until = deadline(now, t.reattach_timeout);
        run.keep_alive_check = deadline(now, t.keep_alive_interval);
        break;
      case v1::RunRecord::JOINING:
        run.phase = Phase::kJoining;
        run.held_until = deadline(now, t.reattach_timeout);
        run.join_deadline = deadline(now, t.join_timeout);
        run.keep_alive_check = deadline(now, t.keep_alive_interval);
        break;
      default:
        run.phase = Phase::kFinished;
        run.result = rec.result();
        run.expires_at = deadline(now, t.finished_run_grace);
        break;
    }
    run.phase_since = now;  // for status(): the phase as this server has seen it
    {
      RunEvent& e = emit(RunEvent::Kind::kRunRestored, run, now);
      e.detached = static_cast<int>(run.members.size());
    }
    if (recording_) recorded_[run.id] = record_of(run).SerializeAsString();
    // What was just loaded is what the store holds: nothing to write for it.
    touched_.erase(run.id);
    unrecorded_.erase(run.id);
    ++res.restored;
  }
  res.events.swap(events_);
  return res;
}

}  // namespace muster::rendezvous
