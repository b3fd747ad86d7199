// Exclusion (launch --exclude_stragglers; docs/stragglers.md, "Exclusion"): a node named as a
// straggler leaves the world in place when that costs less than keeping it (the pure rule,
// exclusion_kept in straggler.h). It is told with a Restart that carries its cool-down, the
// others get a plain Restart (cause "straggler_excluded", not counted against the budget) and
// re-form without it, and a spare waiting beyond MAX takes its place. The excluded node's
// stream stays open (it keeps its session, in none of the round's tables) and its Join is
// refused until its cool-down is over; each exclusion of the same node doubles the next one.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "machine/state_machine_internal.h"
#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/state_machine.h"
#include "muster/rendezvous/straggler.h"

namespace muster::rendezvous {

using std::chrono::milliseconds;
using namespace internal;

namespace {

milliseconds doubled(milliseconds base, int times) {
  milliseconds d = base;
  for (int i = 1; i < times && d < limits::kMaxStragglerCooldown; ++i) d *= 2;
  return std::min(d, limits::kMaxStragglerCooldown);
}

std::int64_t ms_left(TimePoint until, TimePoint now) {
  return until <= now ? 0 : std::chrono::duration_cast<milliseconds>(until - now).count();
}

}  // namespace

bool StateMachine::consider_exclusion(Run& run, TimePoint now, std::vector<Outgoing>& out) {
  if (!run.stragglers.exclude || run.phase != Phase::kRunning ||
      (run.stragglers.ranks.named().empty() && run.stragglers.links.named().empty())) {
    return false;
  }
  // Join.in_place says a node came back in place; on a first round nobody has. Each node that
  // asks for exclusion runs --in_place (launch refuses the one without the other).
  const bool in_place = std::all_of(run.members.begin(), run.members.end(), [](const Node& n) {
    return n.join.in_place() || n.join.exclude_stragglers();
  });
  const milliseconds reform =
      run.in_place.recovery && run.in_place.recovery->status.resumed_ms() > 0
          ? milliseconds(run.in_place.recovery->status.resumed_ms())
          : limits::kDefaultReformCost;
  // The candidate: the slowest named rank whose node may leave now.
  const Straggler* pick = nullptr;
  const std::vector<Straggler> named = named_stragglers(run);
  for (const Straggler& s : named) {
    const int rank = s.rank;
    ExclusionCase c;
    c.nodes = static_cast<int>(run.members.size());
    c.min_nodes = run.config.min_nodes;
    c.spare = !run.waiting.empty();
    c.in_place = in_place;
    c.cause = s.cause;
    c.slowdown = s.slowdown;
    if (auto at = run.stragglers.named_at.find(rank); at != run.stragglers.named_at.end()) {
      c.named_for = std::chrono::duration_cast<milliseconds>(now - at->second);
    }
    c.reform_cost = reform;
    std::string kept = exclusion_kept(c);
    if (kept.empty() && (pick == nullptr || s.slowdown > pick->slowdown)) pick = &s;
    run.stragglers.kept[rank] = std::move(kept);
  }
  if (pick == nullptr) return false;
  const Straggler s = *pick;

  const Node* member = member_holding(run.members, s.rank).node;
  if (member == nullptr) return false;
  const std::string node_id = member->join.node_id();
  const SessionId session = member->session;

  // The run remembers a bounded number of excluded nodes: the one whose cool-down ended
  // first goes when another must be kept.
  if (run.stragglers.excluded.count(node_id) == 0 &&
      static_cast<int>(run.stragglers.excluded.size()) >= limits::kMaxExcludedNodes) {
    auto oldest = std::min_element(run.stragglers.excluded.begin(), run.stragglers.excluded.end(),
                                   [](const auto& a, const auto& b) {
                                     return a.second.until < b.second.until;
                                   });
    run.stragglers.excluded.erase(oldest);
  }
  Run::Stragglers::Excluded& x = run.stragglers.excluded[node_id];
  x.host = member->join.host();
  ++x.times;
  x.cooldown = doubled(run.stragglers.cooldown, x.times);
  x.until = after(now, x.cooldown);
  x.slowdown = s.slowdown;
  x.cause = s.cause;

  const std::string reason = absl::StrFormat(
      "node %s excluded as a straggler: %s; out for %.0f s (exclusion %d)", node_id,
      s.describe(), std::chrono::duration<double>(x.cooldown).count(), x.times);
  {
    RunEvent& e = emit(RunEvent::Kind::kStragglerExcluded, run, now);
    e.rank = s.rank;
    e.host = x.host;
    e.node_id = node_id;
    e.cause = s.cause;
    e.slowdown = s.slowdown;
    e.step = s.step;
    e.reason = reason;
    e.cooldown = x.cooldown;
    e.times_excluded = x.times;
  }
  // The node hears it first; it stays connected, out of the round, until it joins again.
  v1::ServerMsg msg;
  msg.mutable_restart()->set_reason(reason);
  msg.mutable_restart()->set_restart_count(run.restart_count);
  msg.mutable_restart()->set_excluded_ms(x.cooldown.count());
  out.push_back(send(session, std::move(msg)));
  run.members.erase(find_session(run.members, session));
  run.nodes.set_succeeded(session, false);
  run.nodes.set_excluded(session, true);
  restart(run, reason, "straggler_excluded", false, now, out);
  return true;
}

absl::Status StateMachine::excluded_join(const Run& run, const v1::Join& join,
                                         TimePoint now) const {
  auto x = run.stragglers.excluded.find(join.node_id());
  if (x == run.stragglers.excluded.end() || x->second.until <= now) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrFormat(
      "node %s was excluded from run '%s' as a straggler; it may join again in %.1f s",
      join.node_id(), run.id, ms_left(x->second.until, now) / 1000.0));
}

void StateMachine::exclusion_status(const Run& run, v1::RunStatus& s,
                                    std::optional<TimePoint> now) const {
  s.set_excluding_stragglers(run.stragglers.exclude);
  for (const auto& [node_id, x] : run.stragglers.excluded) {
    v1::ExcludedStatus* e = s.add_excluded();
    e->set_node_id(node_id);
    e->set_host(x.host);
    e->set_times(x.times);
    e->set_cooldown_ms(x.cooldown.count());
    if (now) e->set_left_ms(ms_left(x.until, *now));
    e->set_slowdown(x.slowdown);
    e->set_cause(x.cause);
  }
}

}  // namespace muster::rendezvous
