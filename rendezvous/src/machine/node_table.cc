// A run's node records (StateMachine::NodeTable): one per node, and the counts kept with them.
#include "muster/rendezvous/state_machine.h"

#include <utility>

namespace muster::rendezvous {


void StateMachine::NodeTable::count(const NodeState& n, int sign) {
  auto add = [sign](std::size_t& c, bool yes) {
    if (yes) c = sign > 0 ? c + 1 : c - 1;
  };
  add(connected_, n.last_seen.has_value());
  add(detached_, !n.last_seen.has_value());
  add(expected_, n.expected_until.has_value());
  add(succeeded_, n.succeeded);
}

const StateMachine::NodeState* StateMachine::NodeTable::find(SessionId s) const {
  auto it = nodes_.find(s);
  return it == nodes_.end() ? nullptr : &it->second;
}

bool StateMachine::NodeTable::connected(SessionId s) const {
  const NodeState* n = find(s);
  return n != nullptr && n->last_seen.has_value();
}

bool StateMachine::NodeTable::detached(SessionId s) const {
  const NodeState* n = find(s);
  return n != nullptr && !n->last_seen.has_value();
}

void StateMachine::NodeTable::seen(SessionId s, TimePoint now) {
  auto [it, fresh] = nodes_.try_emplace(s);
  NodeState& n = it->second;
  if (n.last_seen) {
    n.last_seen = now;
    return;
  }
  if (!fresh) count(n, -1);  // a detached member connects
  n.last_seen = now;
  count(n, +1);
}

void StateMachine::NodeTable::refresh(SessionId s, TimePoint now) {
  auto it = nodes_.find(s);
  if (it != nodes_.end() && it->second.last_seen) it->second.last_seen = now;
}

void StateMachine::NodeTable::add_detached(SessionId s) {
  auto [it, fresh] = nodes_.try_emplace(s);
  if (fresh) count(it->second, +1);
}

void StateMachine::NodeTable::set_expected(SessionId s, TimePoint until) {
  NodeState& n = nodes_.at(s);
  if (!n.expected_until) ++expected_;
  n.expected_until = until;
}

void StateMachine::NodeTable::clear_expected(SessionId s) {
  auto it = nodes_.find(s);
  if (it == nodes_.end() || !it->second.expected_until) return;
  it->second.expected_until.reset();
  --expected_;
}

void StateMachine::NodeTable::clear_all_expected() {
  if (expected_ == 0) return;
  for (auto& [s, n] : nodes_) n.expected_until.reset();
  expected_ = 0;
}

void StateMachine::NodeTable::set_restarted(SessionId s, TimePoint at) { nodes_.at(s).restarted_at = at; }

std::optional<TimePoint> StateMachine::NodeTable::take_restarted(SessionId s) {
  auto it = nodes_.find(s);
  if (it == nodes_.end()) return std::nullopt;
  return std::exchange(it->second.restarted_at, std::nullopt);
}

void StateMachine::NodeTable::set_rejoin_took(SessionId s, std::optional<std::chrono::milliseconds> took) {
  nodes_.at(s).rejoin_took = took;
}

void StateMachine::NodeTable::set_progress(SessionId s, TimePoint at, v1::Progress p) {
  auto it = nodes_.find(s);
  if (it != nodes_.end()) it->second.progress.emplace(at, std::move(p));
}

void StateMachine::NodeTable::clear_all_progress() {
  for (auto& [s, n] : nodes_) n.progress.reset();
}

void StateMachine::NodeTable::set_succeeded(SessionId s, bool succeeded) {
  auto it = nodes_.find(s);
  if (it == nodes_.end() || it->second.succeeded == succeeded) return;
  it->second.succeeded = succeeded;
  succeeded ? ++succeeded_ : --succeeded_;
}

void StateMachine::NodeTable::set_excluded(SessionId s, bool excluded) {
  if (auto it = nodes_.find(s); it != nodes_.end()) it->second.excluded = excluded;
}

void StateMachine::NodeTable::clear_all_succeeded() {
  if (succeeded_ == 0) return;
  for (auto& [s, n] : nodes_) n.succeeded = false;
  succeeded_ = 0;
}

StateMachine::NodeState StateMachine::NodeTable::erase(SessionId s) {
  auto it = nodes_.find(s);
  if (it == nodes_.end()) return {};
  NodeState n = std::move(it->second);
  count(n, -1);
  nodes_.erase(it);
  return n;
}

void StateMachine::NodeTable::clear() {
  nodes_.clear();
  connected_ = detached_ = expected_ = succeeded_ = 0;
}

}  // namespace muster::rendezvous
