// The state machine's invariants (check_invariants): what every test and the chaos harness
// ask of it after every event.
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "muster/rendezvous/state_machine.h"
#include "machine/state_machine_internal.h"

namespace muster::rendezvous {

using namespace internal;

namespace {

template <typename... Parts>
absl::Status broken(Parts&&... what) {
  return absl::InternalError(absl::StrCat(std::forward<Parts>(what)...));
}

// The run's nodes: each in one of members and waiting, with a record, connected unless a
// detached member, kept without its token; every record is such a node's or an expected
// survivor's; the table's counts are what its records say.
template <typename Run, typename SessionRuns>
absl::Status check_nodes(const std::string& id, const Run& run, const SessionRuns& session_run) {
  std::set<SessionId> in_round;
  for (const auto* group : {&run.members, &run.waiting}) {
    for (const auto& n : *group) {
      if (!in_round.insert(n.session).second) {
        return broken("session ", n.session, " is twice in run '", id, "' (member/waiting)");
      }
      if (run.nodes.find(n.session) == nullptr) {
        return broken("session ", n.session, " of run '", id, "' has no record");
      }
      if (run.nodes.detached(n.session)) {
        if (n.session < kFirstDetachedSession || session_run.count(n.session) > 0) {
          return broken("detached member ", n.session, " of run '", id, "' has a stream");
        }
        if (group != &run.members) {
          return broken("detached session ", n.session, " of run '", id, "' is no member");
        }
      }
      if (!n.join.token().empty() || !n.join.GetReflection()->GetUnknownFields(n.join).empty()) {
        return broken("run '", id, "' keeps a token or unknown fields");
      }
      if (!ops::is_valid_utf8(n.join.node_id()) || !ops::is_valid_utf8(n.join.host())) {
        return broken("run '", id, "' keeps text that is not UTF-8");
      }
    }
  }
  std::size_t connected = 0, detached = 0, expected = 0, succeeded = 0;
  for (const auto& [session, node] : run.nodes.all()) {
    node.last_seen ? ++connected : ++detached;
    if (node.expected_until) ++expected;
    if (node.succeeded) ++succeeded;
    if (!node.last_seen && (node.expected_until || node.restarted_at || node.rejoin_took)) {
      return broken("detached session ", session, " of run '", id, "' is expected or restarted");
    }
    if (node.excluded && in_round.count(session)) {
      return broken("excluded session ", session, " of run '", id, "' is in a round");
    }
    if (node.succeeded && find_session(run.members, session) == run.members.end()) {
      return broken("session ", session, " succeeded in run '", id, "' but is no member");
    }
    if (!in_round.count(session) && !node.restarted_at && !node.excluded) {
      // Connected but in neither list: only a survivor not back yet (told Restart), or a
      // node excluded as a straggler, in its cool-down.
      return broken("session ", session, " of run '", id, "' is in no round and not a survivor");
    }
  }
  if (connected != run.nodes.connected_count() || detached != run.nodes.detached_count() ||
      expected != run.nodes.expected_count() || succeeded != run.nodes.succeeded_count()) {
    return broken("run '", id, "' counts its node records wrong");
  }
  if ((detached > 0) != run.reattach_until.has_value()) {
    return broken("run '", id, "' has detached members without a hold, or a hold without");
  }
  return absl::OkStatus();
}

// A joining run: survivors expected agree with the waiters, and the round closes when it can.
template <typename Run>
absl::Status check_joining(const std::string& id, const Run& run) {
  const int waiting = static_cast<int>(run.waiting.size());
  if (!run.members.empty()) return broken("joining run '", id, "' has members");
  if (run.nodes.connected_count() == 0 && !run.held_until) {
    return broken("run '", id, "' is held by nobody");
  }
  bool pending = false;
  for (const auto& [session, node] : run.nodes.all()) {
    if (!node.expected_until) continue;
    const bool waits = find_session(run.waiting, session) != run.waiting.end();
    if (waits != survivor_back(node)) {
      return broken("survivor ", session, " of run '", id, "': waiting ", waits, ", rejoined ",
                    survivor_back(node));
    }
    pending |= !waits;
  }
  if (!pending && waiting >= run.config.min_nodes &&
      (waiting >= run.config.max_nodes || run.nodes.expected_count() > 0)) {
    return broken("run '", id, "' should have closed its round");
  }
  if (waiting < run.config.min_nodes && !run.join_deadline) {
    return broken("run '", id, "' is below min without a join deadline");
  }
  if (pending && run.last_call_deadline) {
    return broken("run '", id, "' runs a last call while survivors are expected");
  }
  return absl::OkStatus();
}

// What the run's phase allows, and its restart budget.
template <typename Run>
absl::Status check_phase(const std::string& id, const Run& run) {
  using Phase = decltype(run.phase);
  if (run.restart_count - run.budget.from > run.config.max_restarts ||
      run.budget.from > run.restart_count) {
    return broken("run '", id, "' over its budget");
  }
  const int members = static_cast<int>(run.members.size());
  const int waiting = static_cast<int>(run.waiting.size());
  switch (run.phase) {
    case Phase::kFinished:
      if (members || waiting || !run.nodes.all().empty() ||
          !run.expires_at || !run.result) {
        return broken("finished run '", id, "' holds nodes or has no expiry");
      }
      break;
    case Phase::kRunning:
      if (members < run.config.min_nodes || members > run.config.max_nodes) {
        return broken("run '", id, "' runs with ", members, " members");
      }
      if (members < run.config.max_nodes && waiting > 0) {
        return broken("run '", id, "' has room but leaves ", waiting, " waiting");
      }
      if (run.nodes.expected_count() > 0 || run.join_deadline || run.last_call_deadline) {
        return broken("running run '", id, "' has joining state");
      }
      if (!run_held(run)) {
        return broken("running run '", id, "' is held by nobody");
      }
      break;
    case Phase::kJoining:
      return check_joining(id, run);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status StateMachine::check_invariants() const {
  if (runs_.size() > limits::kMaxRuns) return broken(runs_.size(), " runs held");
  for (const auto& [session, id] : session_run_) {
    auto r = runs_.find(id);
    if (r == runs_.end()) return broken("session ", session, " is in run '", id, "' not held");
    if (r->second.phase == Phase::kFinished) {
      return broken("session ", session, " is in finished run '", id, "'");
    }
    if (!r->second.nodes.connected(session)) {
      return broken("session ", session, " of run '", id, "' is not seen as connected");
    }
  }
  for (const auto& [id, run] : runs_) {
    if (run.id != id) return broken("run '", id, "' names itself '", run.id, "'");
    for (const auto& [session, node] : run.nodes.all()) {
      if (!node.last_seen) continue;
      auto s = session_run_.find(session);
      if (s == session_run_.end() || s->second != id) {
        return broken("session ", session, " is connected to run '", id, "' but not in it");
      }
    }
    if (absl::Status st = check_nodes(id, run, session_run_); !st.ok()) return st;
    if (absl::Status st = check_phase(id, run); !st.ok()) return st;
    if (recording_) {
      auto rec = recorded_.find(id);
      if (unrecorded_.count(id) == 0 &&
          (rec == recorded_.end() || rec->second != record_of(run).SerializeAsString())) {
        return broken("run '", id, "' changed its record without an event");
      }
    }
    if (run.phase != Phase::kFinished && !run.keep_alive_check) {
      return broken("run '", id, "' has no keep-alive check");
    }
  }
  return absl::OkStatus();
}

}  // namespace muster::rendezvous
