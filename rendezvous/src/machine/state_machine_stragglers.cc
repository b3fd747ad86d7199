// The server's side of the straggler watch (docs/stragglers.md): each node's progress pages,
// with their time per phase kind, scored by the pure rule in straggler.h over every rank of
// the running round. A rank named or cleared is an event (the event log, metrics) and part of
// the run's status. Naming changes nothing in the run by itself; with --exclude_stragglers a
// named rank's node may then leave it (state_machine_exclusion.cc).
#include <algorithm>

#include "machine/state_machine_internal.h"
#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/state_machine.h"

namespace muster::rendezvous {

using std::chrono::milliseconds;
using namespace internal;

namespace {

// A node named for a slow link, as the straggler its first rank stands for.
template <typename Run>
Straggler as_straggler(const Run& run, const SlowLink& l) {
  Straggler s;
  s.cause = "network";
  s.slowdown = l.slowdown();
  const auto at = place_member(run.members, [&l](const auto& n) { return n.join.node_id() == l.node; });
  if (at.node != nullptr) {
    s.rank = at.first_rank;
    s.node = at.node->join.host();
  }
  s.link_mbps = l.mbps;
  s.link_median = l.median;
  return s;
}

void fill(RunEvent& e, const Straggler& s) {
  e.rank = s.rank;
  e.host = s.node;
  e.cause = s.cause;
  e.slowdown = s.slowdown;
  e.step = s.step;
  e.reason = s.describe();
}

}  // namespace

bool StateMachine::watch_stragglers(Run& run, SessionId session, const v1::Progress& p,
                                    TimePoint now, std::vector<Outgoing>& out) {
  // The node, and its global ranks (contiguous per node, by group rank): a report of a rank
  // that is not the node's own is not scored (a node cannot make the table grow).
  const auto at = place_member(run.members, [session](const Node& n) { return n.session == session; });
  const Node* node = at.node;
  const int first = at.first_rank;
  if (node == nullptr) return false;
  for (const v1::RankProgress& r : p.ranks()) {
    if (r.reports() == 0 || r.rank() < first ||
        r.rank() >= first + node->join.local_world_size()) {
      continue;
    }
    run.stragglers.ranks.update(r.rank(), node->join.host(), r.step(),
                          std::vector<std::uint64_t>(r.kind_ns().begin(), r.kind_ns().end()));
  }
  if (p.links_size() > 0) {
    std::vector<LinkJudge::Link> links;
    for (const v1::LinkRate& l : p.links()) links.push_back({l.local(), l.remote(), l.mbps()});
    run.stragglers.links.update(node->join.node_id(), std::move(links));
  }
  // Over every rank: at most once per sampling period, not on every node's report.
  if (run.stragglers.next_check && now < *run.stragglers.next_check) return false;
  run.stragglers.next_check = after(now, limits::kStragglerSampling);
  StragglerChange change = run.stragglers.ranks.evaluate();
  auto node_of = [&run](int rank) -> std::string {
    const auto at = member_holding(run.members, rank);
    return at.node != nullptr ? at.node->join.node_id() : "";
  };
  for (const Straggler& s : change.named) {
    run.stragglers.named_at[s.rank] = now;
    RunEvent& e = emit(RunEvent::Kind::kStragglerNamed, run, now);
    fill(e, s);
    e.node_id = node_of(s.rank);
  }
  for (const Straggler& s : change.cleared) {
    run.stragglers.named_at.erase(s.rank);
    run.stragglers.kept.erase(s.rank);
    RunEvent& e = emit(RunEvent::Kind::kStragglerCleared, run, now);
    fill(e, s);
    e.node_id = node_of(s.rank);
  }
  // Slow links: a node, named as its first rank with cause "network".
  LinkJudge::Change links = run.stragglers.links.evaluate();
  for (const auto* list : {&links.named, &links.cleared}) {
    for (const SlowLink& l : *list) {
      const Straggler s = as_straggler(run, l);
      const bool named = list == &links.named;
      if (named) {
        run.stragglers.named_at[s.rank] = now;
      } else {
        run.stragglers.named_at.erase(s.rank);
        run.stragglers.kept.erase(s.rank);
      }
      RunEvent& e =
          emit(named ? RunEvent::Kind::kStragglerNamed : RunEvent::Kind::kStragglerCleared, run,
               now);
      fill(e, s);
      e.node_id = l.node;
    }
  }
  return consider_exclusion(run, now, out);
}

void StateMachine::end_straggler_round(Run& run, TimePoint now) {
  // The ranks named in the round that ends are cleared with it: the next round's ranks are
  // scored afresh (a rank number may be another process, on another node, then).
  for (const Straggler& s : named_stragglers(run)) {
    RunEvent& e = emit(RunEvent::Kind::kStragglerCleared, run, now);
    fill(e, s);
    e.reason = s.describe() + "; the round ended";
  }
  run.stragglers.new_round();
}

std::vector<Straggler> StateMachine::named_stragglers(const Run& run) const {
  std::vector<Straggler> out;
  for (const auto& [rank, s] : run.stragglers.ranks.named()) out.push_back(s);
  for (const auto& [node, l] : run.stragglers.links.named()) out.push_back(as_straggler(run, l));
  return out;
}

void StateMachine::straggler_status(const Run& run, v1::RunStatus& s,
                                    std::optional<TimePoint> now) const {
  s.set_watching_stragglers(run.stragglers.watch);
  for (const Straggler& named : named_stragglers(run)) {
    const int rank = named.rank;
    v1::StragglerStatus* x = s.add_stragglers();
    x->set_rank(rank);
    x->set_host(named.node);
    if (const auto at = member_holding(run.members, rank); at.node != nullptr) {
      x->set_node_id(at.node->join.node_id());
    }
    x->set_cause(named.cause);
    x->set_slowdown(named.slowdown);
    x->set_step(named.step);
    auto at = run.stragglers.named_at.find(rank);
    if (now && at != run.stragglers.named_at.end() && *now >= at->second) {
      x->set_age_ms(std::chrono::duration_cast<milliseconds>(*now - at->second).count());
    }
    if (auto k = run.stragglers.kept.find(rank); k != run.stragglers.kept.end()) {
      x->set_kept(k->second);
    }
  }
  exclusion_status(run, s, now);
}

}  // namespace muster::rendezvous
