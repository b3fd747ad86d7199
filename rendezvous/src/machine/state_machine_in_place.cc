// The server's side of in-place recovery (docs/in_place.md): what it learns of one, for the
// events and status that show it next to the full restarts. The rules of the round do not
// change: a recovery is a restart like any other, counted the same. Nodes say that they
// rejoin with their workers kept (Join.in_place) and when those workers resumed
// (ReportResumed); a node whose recovery does not complete says so in its failure report.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "machine/state_machine_internal.h"
#include "muster/ops/text.h"
#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/state_machine.h"

namespace muster::rendezvous {

using std::chrono::milliseconds;
using namespace internal;

namespace {

std::int64_t ms_between(TimePoint from, TimePoint to) {
  return to < from ? 0 : std::chrono::duration_cast<milliseconds>(to - from).count();
}

}  // namespace

// The round after a restart has formed (close_round): the recovery it is. How many of its
// members kept their workers.
int StateMachine::recovery_formed(Run& run, TimePoint now) {
  Run::InPlace::Recovery& r = run.in_place.recovery.emplace();
  r.formed = now;
  v1::RecoveryStatus& st = r.status;
  st.set_round(run.round);
  st.set_cause(run.in_place.restart_cause);
  st.set_nodes(static_cast<int>(run.members.size()));
  st.set_nodes_in_place(static_cast<int>(std::count_if(
      run.members.begin(), run.members.end(), [](const Node& n) { return n.join.in_place(); })));
  if (run.restarted_since) st.set_formed_ms(ms_between(*run.restarted_since, now));
  return st.nodes_in_place();
}

void StateMachine::on_resumed(Run& run, SessionId session, const v1::ReportResumed& r,
                              TimePoint now, std::vector<Outgoing>& out) {
  if (r.abort_ms() < 0 || r.rendezvous_ms() < 0 || r.reform_ms() < 0 || r.workers() < 0) {
    refuse(session,
           absl::InvalidArgumentError(
               "resumed: workers, abort_ms, rendezvous_ms and reform_ms must be 0 or more"),
           now, out);
    return;
  }
  // Only a member of the running round that joined it in place, once; anything else is stale
  // (an older round's report, or one that crossed a restart) and changes nothing.
  auto m = find_session(run.members, session);
  if (run.phase != Phase::kRunning || m == run.members.end() || !m->join.in_place() ||
      r.round() != run.round || !run.in_place.recovery || run.in_place.recovery->status.round() != run.round ||
      !run.in_place.recovery->resumed.insert(session).second) {
    return;
  }
  v1::RecoveryStatus& st = run.in_place.recovery->status;
  st.set_nodes_resumed(static_cast<int>(run.in_place.recovery->resumed.size()));
  st.set_abort_ms(std::max(st.abort_ms(), r.abort_ms()));
  st.set_reform_ms(std::max(st.reform_ms(), r.reform_ms()));
  const std::int64_t since_restart = st.formed_ms() + ms_between(run.in_place.recovery->formed, now);
  if (st.nodes_resumed() == st.nodes_in_place()) {
    st.set_resumed_ms(since_restart);
    ++run.in_place.recoveries;
  }
  RunEvent& e = emit(RunEvent::Kind::kInPlaceResumed, run, now);
  e.node_id = m->join.node_id();
  e.host = m->join.host();
  e.resumed = st.nodes_resumed();
  e.in_place = st.nodes_in_place();
  e.took = milliseconds(since_restart);
  e.abort = milliseconds(r.abort_ms());
  e.rendezvous = milliseconds(r.rendezvous_ms());
  e.reform = milliseconds(r.reform_ms());
}

// A member's failure report for the running round (on_failure checked that) says that its
// in-place recovery did not complete: counted and shown; the failure then restarts the run.
void StateMachine::on_in_place_fallback(Run& run, SessionId session, const v1::ReportFailure& f,
                                        TimePoint now) {
  auto m = find_session(run.members, session);
  if (m == run.members.end()) return;
  ++run.in_place.fallbacks;
  RunEvent& e = emit(RunEvent::Kind::kInPlaceFallback, run, now);
  e.node_id = m->join.node_id();
  e.host = m->join.host();
  e.reason = ops::printable_utf8(f.root_cause().message(), limits::kMaxFailureMessageBytes);
}

}  // namespace muster::rendezvous
