#include "muster/rendezvous/state_machine.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "muster/rendezvous/stall.h"
#include "machine/state_machine_internal.h"

namespace muster::rendezvous {

using namespace internal;
using std::chrono::milliseconds;

RunEvent& StateMachine::emit(RunEvent::Kind kind, const Run& run, TimePoint now) {
  touch(run.id);  // every change to a run's durable state comes with one of its events
  if (events_.size() >= limits::kMaxPendingEvents) events_.erase(events_.begin());
  RunEvent& e = events_.emplace_back();
  e.kind = kind;
  e.run_id = run.id;
  e.round = run.round;
  e.at = now;
  e.restart_count = run.restart_count;
  return e;
}

void Decision::merge(Decision&& later) {
  for (Outgoing& o : later.messages) messages.push_back(std::move(o));
  for (RunEvent& e : later.events) events.push_back(std::move(e));
  // A commit held back by a slow store keeps the newest events, like the machine does.
  if (events.size() > limits::kMaxPendingEvents) {
    events.erase(events.begin(),
                 events.begin() + static_cast<std::ptrdiff_t>(events.size() -
                                                              limits::kMaxPendingEvents));
  }
  touched.merge(later.touched);
}

Decision StateMachine::decided(std::vector<Outgoing> out) {
  Decision d;
  d.messages = std::move(out);
  d.events.swap(events_);
  d.touched.swap(touched_);
  return d;
}

StateMachine::Run* StateMachine::run_of(SessionId session) {
  auto it = session_run_.find(session);
  if (it == session_run_.end()) return nullptr;
  auto r = runs_.find(it->second);
  return r == runs_.end() ? nullptr : &r->second;
}

Decision StateMachine::on_message(SessionId session, const v1::AgentMsg& msg, TimePoint now) {
  return decided(handle_message(session, msg, now));
}

std::vector<Outgoing> StateMachine::handle_message(SessionId session, const v1::AgentMsg& msg,
                                                   TimePoint now) {
  std::vector<Outgoing> out;
  // The server refuses larger messages before they get here; this is the second edge, so
  // that nothing larger is ever kept or forwarded whoever drives the machine.
  if (const std::size_t size = msg.ByteSizeLong(); size > limits::kMaxAgentMessageBytes) {
    refuse(session,
           absl::ResourceExhaustedError(absl::StrCat("message of ", size,
                                                     " bytes is larger than the limit of ",
                                                     limits::kMaxAgentMessageBytes)),
           now, out);
    return out;
  }
  if (msg.has_join()) return on_join(session, msg.join(), now);
  Run* run = run_of(session);
  if (run == nullptr) {
    // A node whose re-attach was refused is in no run until its plain Join, while it stops
    // its workers: its keep-alives are answered and its progress reports ignored.
    if (msg.has_keep_alive()) {
      v1::ServerMsg ack;
      ack.mutable_keep_alive();
      out.push_back(send(session, std::move(ack)));
      return out;
    }
    if (msg.has_progress() || msg.has_resumed()) return out;
    out.push_back(
        close_with(session, absl::FailedPreconditionError("protocol error: message before join")));
    return out;
  }
  run->nodes.refresh(session, now);
  if (msg.has_failure()) {
    on_failure(*run, session, msg.failure(), now, out);
  } else if (msg.has_success()) {
    on_success(*run, session, msg.success(), now, out);
  } else if (msg.has_progress()) {
    on_progress(*run, session, msg.progress(), now, out);
  } else if (msg.has_resumed()) {
    on_resumed(*run, session, msg.resumed(), now, out);
  } else if (msg.has_keep_alive()) {
    // Being heard from (above), and an answer: the agent's proof that the server hears it.
    v1::ServerMsg ack;
    ack.mutable_keep_alive();
    out.push_back(Outgoing{session, std::move(ack), false, absl::OkStatus()});
  }
  return out;
}

std::vector<Outgoing> StateMachine::on_join(SessionId session, const v1::Join& join,
                                            TimePoint now) {
  std::vector<Outgoing> out;
  if (absl::Status st = validate(join); !st.ok()) {
    refuse(session, st, now, out);
    return out;
  }
  if (join.reattach_round() > 0) return on_reattach(session, join, now);
  // A session serves one run: a stream that could join a second run would stay a member
  // (a ghost) of the first, holding it up.
  if (auto cur = session_run_.find(session);
      cur != session_run_.end() && cur->second != join.run_id()) {
    refuse(session,
           absl::InvalidArgumentError(absl::StrCat(
               "this stream is in run '", cur->second, "' and cannot join run '",
               join.run_id(), "': a stream serves one run (it has been taken out of '",
               cur->second, "')")),
           now, out);
    return out;
  }
  auto it = runs_.find(join.run_id());
  if (it == runs_.end()) {
    if (runs_.size() >= limits::kMaxRuns) {
      refuse(session,
             absl::ResourceExhaustedError(absl::StrCat(
                 "the rendezvous server holds ", runs_.size(), " runs, its limit; run '",
                 join.run_id(), "' cannot be created now")),
             now, out);
      return out;
    }
    it = create_run(join, now);
  }
  Run& run = it->second;
  if (absl::Status st = join_fits(run, join); !st.ok()) {
    refuse(session, st, now, out);
    return out;
  }
  if (absl::Status st = excluded_join(run, join, now); !st.ok()) {
    refuse(session, st, now, out);
    return out;
  }
  // The node of a place held for its re-attach joins afresh: it gave the place up (its
  // agent stopped its workers), so the round has lost it.
  bool was_member = give_up_held_place(run, join, now);
  // A member that joins again while its round runs has left the round (its agent restarted
  // on its own): it must not be member and waiter at once.
  if (run.phase == Phase::kRunning) {
    if (auto m = find_session(run.members, session); m != run.members.end()) {
      run.members.erase(m);
      run.nodes.set_succeeded(session, false);
      was_member = true;
    }
  }
  add_waiting(run, session, join, was_member, now);
  if (run.phase == Phase::kRunning) {
    if (was_member) {
      restart(run, absl::StrCat("node ", join.node_id(), " joined again; restarting"), "rejoin",
              false, now, out);
    } else if (static_cast<int>(run.members.size()) < run.config.max_nodes) {
      // A newcomer while a round runs: scale up if there is room, else it waits as a spare.
      restart(run, absl::StrCat("node ", join.node_id(), " joined; scaling up"), "node_joined",
              false, now, out);
    }
    return out;
  }
  maybe_close_round(run, now, out);
  return out;
}

std::map<std::string, StateMachine::Run>::iterator StateMachine::create_run(const v1::Join& join,
                                                                            TimePoint now) {
  auto it = runs_.try_emplace(join.run_id()).first;
  Run& run = it->second;
  run.id = join.run_id();
  run.phase_since = now;
  run.config.min_nodes = join.min_nodes();
  run.config.max_nodes = join.max_nodes();
  run.config.max_restarts = join.max_restarts();
  run.budget.max_restarts_without_progress =
      std::clamp(join.max_restarts_without_progress(), 0, limits::kMaxRestartsWithoutProgress);
  run.budget.reset_steps = std::max<std::int64_t>(0, join.restart_budget_reset_after_steps());
  run.stragglers.watch = join.watch_stragglers() || join.exclude_stragglers();
  run.stragglers.exclude = join.exclude_stragglers();
  run.stragglers.cooldown = client_duration(join.straggler_cooldown_ms(),
                                           limits::kDefaultStragglerCooldown,
                                           limits::kMaxStragglerCooldown);
  // The first node sets the run's timing, within bounds: one client must not be able to
  // make a run (or its nodes) wait for ever, nor make a deadline wrap.
  run.config.timeouts = run_timing(timeouts_, timing_asked(join), TimingSource::kJoin);
  return it;
}

absl::Status StateMachine::join_fits(const Run& run, const v1::Join& join) const {
  if (run.phase == Phase::kFinished) {
    return absl::FailedPreconditionError(absl::StrCat("run '", run.id, "' has already finished"));
  }
  if (join.min_nodes() != run.config.min_nodes || join.max_nodes() != run.config.max_nodes ||
      join.max_restarts() != run.config.max_restarts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "run '", run.id, "' is configured with nnodes=", run.config.min_nodes, ":",
        run.config.max_nodes, " max_restarts=", run.config.max_restarts, ", this node asked for ",
        join.min_nodes(), ":",
        join.max_nodes(), " max_restarts=", join.max_restarts()));
  }
  return absl::OkStatus();
}

bool StateMachine::give_up_held_place(Run& run, const v1::Join& join, TimePoint now) {
  if (run.phase != Phase::kRunning || run.nodes.detached_count() == 0) return false;
  auto m = std::find_if(run.members.begin(), run.members.end(), [&](const Node& n) {
    return run.nodes.detached(n.session) && n.join.node_id() == join.node_id();
  });
  if (m == run.members.end()) return false;
  RunEvent& e = emit(RunEvent::Kind::kNodeLost, run, now);
  e.cause = "rejoined";
  e.member = true;
  e.node_id = m->join.node_id();
  e.host = m->join.host();
  run.nodes.erase(m->session);
  run.members.erase(m);
  if (run.nodes.detached_count() == 0) run.reattach_until.reset();
  return true;
}

void StateMachine::add_waiting(Run& run, SessionId session, const v1::Join& join, bool was_member,
                               TimePoint now) {
  // Keep only what the node needs: not the credential, not fields this server does not know.
  v1::Join kept = join;
  kept.clear_token();
  kept.DiscardUnknownFields();
  const NodeState* known = run.nodes.find(session);
  const bool newcomer = !was_member && (known == nullptr || !known->restarted_at) &&
                        find_session(run.waiting, session) == run.waiting.end();
  if (newcomer) {
    RunEvent& e = emit(RunEvent::Kind::kNodeJoined, run, now);
    e.node_id = kept.node_id();
    e.host = kept.host();
  }
  run.nodes.seen(session, now);
  run.nodes.set_excluded(session, false);  // back from its cool-down
  // A survivor back after a restart: learn how long it takes, if longer than it says.
  if (auto r = run.nodes.take_restarted(session)) {
    const auto took = std::chrono::duration_cast<milliseconds>(now - *r);
    run.nodes.set_rejoin_took(session, took > shutdown_timeout_of(join)
                                           ? std::optional<milliseconds>(took)
                                           : std::nullopt);
  }
  // A rejoin on the same stream (after a Restart) replaces any earlier entry.
  if (auto w = find_session(run.waiting, session); w != run.waiting.end()) run.waiting.erase(w);
  run.waiting.push_back(Node{session, std::move(kept)});
  session_run_[session] = run.id;
  if (!run.keep_alive_check) {
    run.keep_alive_check = deadline(now, run.config.timeouts.keep_alive_interval);
  }
}

std::vector<Outgoing> StateMachine::on_reattach(SessionId session, const v1::Join& join,
                                                TimePoint now) {
  std::vector<Outgoing> out;
  if (session_run_.count(session) > 0) {
    refuse(session,
           absl::InvalidArgumentError(
               "a re-attach must be the first message of its stream (this one is in a run)"),
           now, out);
    return out;
  }
  const int round = join.reattach_round();
  const int g = join.reattach_group_rank();
  auto answer = [&](bool ok, std::string reason, const Run* run) {
    v1::ServerMsg msg;
    v1::Attached* a = msg.mutable_attached();
    a->set_round(round);
    a->set_ok(ok);
    a->set_reason(std::move(reason));
    if (run != nullptr) a->set_restart_count(run->restart_count);
    out.push_back(send(session, std::move(msg)));
  };
  auto it = runs_.find(join.run_id());
  if (it == runs_.end()) {
    answer(false, absl::StrCat("the server does not hold run '", join.run_id(), "'"), nullptr);
    return out;
  }
  Run& run = it->second;
  if (run.phase == Phase::kFinished) {
    // A member that missed the end (the server stopped before it was told): tell it now.
    auto r = run.places.find(join.node_id());
    if (run.result && run.round == round && r != run.places.end() && r->second.group_rank == g) {
      out.push_back(send(session, *run.result));
      out.push_back(close_with(session, absl::OkStatus()));
      return out;
    }
    answer(false, absl::StrCat("run '", run.id, "' has already finished"), &run);
    return out;
  }
  if (run.phase != Phase::kRunning || run.round != round) {
    answer(false,
           run.phase == Phase::kRunning
               ? absl::StrCat("run '", run.id, "' is in round ", run.round, ", not ", round)
               : absl::StrCat("run '", run.id, "' is forming round ", run.round + 1),
           &run);
    return out;
  }
  if (g >= static_cast<int>(run.members.size()) ||
      run.members[g].join.node_id() != join.node_id()) {
    answer(false,
           absl::StrCat("node ", join.node_id(), " is not group rank ", g, " of round ", round,
                        " of run '", run.id, "'"),
           &run);
    return out;
  }
  Node& member = run.members[g];
  const SessionId old = member.session;
  if (!run.nodes.detached(old)) {
    // Its old stream is still open here (its end not seen yet): the newer one takes over.
    out.push_back(close_with(old, absl::AbortedError("replaced by a newer stream of the same "
                                                     "node (it re-attached)")));
    session_run_.erase(old);
  }
  const bool succeeded = run.nodes.erase(old).succeeded;  // what it reported stays with it
  if (run.nodes.detached_count() == 0) run.reattach_until.reset();
  member.session = session;
  session_run_[session] = run.id;
  run.nodes.seen(session, now);  // its liveness counts from here
  run.nodes.set_succeeded(session, succeeded);
  const TimePoint keep_alive = deadline(now, run.config.timeouts.keep_alive_interval);
  if (!run.keep_alive_check || *run.keep_alive_check > keep_alive) run.keep_alive_check = keep_alive;
  {
    RunEvent& e = emit(RunEvent::Kind::kNodeReattached, run, now);
    e.node_id = member.join.node_id();
    e.host = member.join.host();
    e.detached = static_cast<int>(run.nodes.detached_count());  // places still waiting
  }
  answer(true, "", &run);
  return out;
}

std::vector<std::string> StateMachine::drop_detached(Run& run, TimePoint now,
                                                     std::string_view cause) {
  std::vector<std::string> lost;
  if (run.nodes.detached_count() == 0) return lost;
  for (auto m = run.members.begin(); m != run.members.end();) {
    if (!run.nodes.detached(m->session)) {
      ++m;
      continue;
    }
    RunEvent& e = emit(RunEvent::Kind::kNodeLost, run, now);
    e.cause = std::string(cause);
    e.member = true;
    e.node_id = m->join.node_id();
    e.host = m->join.host();
    lost.push_back(m->join.node_id());
    run.nodes.erase(m->session);
    m = run.members.erase(m);
  }
  run.reattach_until.reset();
  return lost;
}

void StateMachine::maybe_close_round(Run& run, TimePoint now, std::vector<Outgoing>& out) {
  if (run.phase != Phase::kJoining) return;
  const int n = static_cast<int>(run.waiting.size());
  if (n < run.config.min_nodes) {
    run.last_call_deadline.reset();
    if (!run.join_deadline) run.join_deadline = deadline(now, run.config.timeouts.join_timeout);
    return;
  }
  // After a restart the round waits for every survivor still expected (each for a bounded
  // time): a round closed without them is restarted again by their Join, and with workers
  // slower to stop than the last call that repeats for ever.
  bool pending = false;
  if (run.nodes.expected_count() > 0) {
    for (const auto& [session, node] : run.nodes.all()) {
      if (node.expected_until && !survivor_back(node)) pending = true;
    }
  }
  if (pending) {
    run.last_call_deadline.reset();
    return;
  }
  // Full, or every survivor is back: nobody else is worth waiting for.
  if (n >= run.config.max_nodes || run.nodes.expected_count() > 0) {
    close_round(run, now, out);
    return;
  }
  if (!run.last_call_deadline) {
    run.last_call_deadline = deadline(now, run.config.timeouts.last_call_timeout);
  }
  if (now >= *run.last_call_deadline) close_round(run, now, out);
}

void StateMachine::close_round(Run& run, TimePoint now, std::vector<Outgoing>& out) {
  end_straggler_round(run, now);
  run.nodes.clear_all_progress();
  run.stall_sent = false;
  run.next_stall_check.reset();
  run.budget.new_round();
  const int count = std::min<int>(run.config.max_nodes, run.waiting.size());
  // Who gets in: requested ranks and previous members first, then join order.
  std::stable_partition(run.waiting.begin(), run.waiting.end(), [&](const Node& n) {
    return n.join.requested_rank() >= 0 || run.places.count(n.join.node_id()) > 0;
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
    auto prev = run.places.find(members[i].join.node_id());
    if (rank[i] < 0 && prev != run.places.end()) claim(i, prev->second.group_rank);
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
  run.nodes.clear_all_succeeded();
  run.places.clear();
  run.phase = Phase::kRunning;
  run.phase_since = now;
  run.nodes.clear_all_expected();
  run.join_deadline.reset();
  run.last_call_deadline.reset();

  int world_size = 0;
  for (const Node& n : run.members) world_size += n.join.local_world_size();
  const v1::Join& master = run.members.front().join;
  int offset = 0;
  for (int r = 0; r < count; ++r) {
    const Node& n = run.members[r];
    run.places[n.join.node_id()] = Run::Place{r, offset, n.join.local_world_size()};
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
    a->set_hang_timeout_ms(run.config.timeouts.hang_timeout.count());
    a->set_wants_progress(run.config.timeouts.hang_timeout.count() > 0 ||
                          run.budget.max_restarts_without_progress > 0 || run.budget.reset_steps > 0 ||
                          run.stragglers.watch);
    a->set_watch_stragglers(run.stragglers.watch);
    // Only a server that keeps its runs can take a node back whose stream ended.
    if (recording_) a->set_reattach_timeout_ms(run.config.timeouts.reattach_timeout.count());
    out.push_back(send(n.session, std::move(msg)));
    offset += n.join.local_world_size();
  }
  RunEvent& e = emit(RunEvent::Kind::kRoundFormed, run, now);
  e.nodes = count;
  e.world_size = world_size;
  e.spares = static_cast<int>(run.waiting.size());
  if (run.restarted_since) {
    e.took = std::chrono::duration_cast<milliseconds>(now - *run.restarted_since);
    e.in_place = recovery_formed(run, now);
    run.restarted_since.reset();
  }
  // Spares left over keep waiting for the next round (max_nodes is met: no join deadline).
}

void StateMachine::restart(Run& run, const std::string& reason, std::string_view cause,
                           bool counts, TimePoint now, std::vector<Outgoing>& out) {
  if (counts) ++run.restart_count;
  run.in_place.restart_cause = std::string(cause);
  // Members still detached cannot be told: their places go (they re-attach in vain, then
  // join again).
  drop_detached(run, now, "not_reattached");
  {
    RunEvent& e = emit(RunEvent::Kind::kRestart, run, now);
    e.cause = std::string(cause);
    e.reason = reason;
    e.counts = counts;
  }
  run.restarted_since = now;
  run.nodes.clear_all_expected();
  // The global ranks of the round's members that are gone (in-place recovery's `lost`).
  std::vector<int> lost;
  for (auto& [gone_id, place] : run.places) {
    // A structured binding cannot be captured before C++20 (clang refuses): name a copy.
    const std::string& node_id = gone_id;
    const bool kept = std::any_of(run.members.begin(), run.members.end(),
                                  [&](const Node& n) { return n.join.node_id() == node_id; });
    for (int k = 0; !kept && k < place.ranks; ++k) lost.push_back(place.first_rank + k);
    place.ranks = 0;  // named once
  }
  std::sort(lost.begin(), lost.end());
  for (const Node& n : run.members) {
    // Each survivor holds the next round for as long as its agent may take to stop its
    // workers, plus a margin: bounded, so a node that never comes back cannot stall the run.
    run.nodes.set_expected(n.session, after(after(now, hold_of(run, n)), limits::kRejoinMargin));
    run.nodes.set_restarted(n.session, now);
    v1::ServerMsg msg;
    msg.mutable_restart()->set_reason(reason);
    msg.mutable_restart()->set_restart_count(run.restart_count);
    for (int r : lost) msg.mutable_restart()->add_lost_ranks(r);
    out.push_back(send(n.session, std::move(msg)));
  }
  run.members.clear();
  run.nodes.clear_all_succeeded();
  run.phase = Phase::kJoining;
  run.phase_since = now;
  run.join_deadline.reset();  // a fresh one, from now, while below min
  run.last_call_deadline.reset();
  maybe_close_round(run, now, out);  // spares may already make a round
}

std::chrono::milliseconds StateMachine::hold_of(const Run& run, const Node& node) const {
  milliseconds hold = shutdown_timeout_of(node.join);
  if (const NodeState* n = run.nodes.find(node.session); n != nullptr && n->rejoin_took) {
    hold = std::max(hold, *n->rejoin_took);
  }
  return std::min(hold, limits::kMaxShutdownTimeout);
}

void StateMachine::finish(Run& run, const v1::ServerMsg& last, TimePoint now,
                          std::vector<Outgoing>& out) {
  if (last.has_fail()) {
    RunEvent& e = emit(RunEvent::Kind::kFailed, run, now);
    e.cause = last.fail().do_not_requeue() ? "no_progress" : "budget_spent";
    e.reason = last.fail().reason();
  } else {
    emit(RunEvent::Kind::kSucceeded, run, now);
  }
  // Every connected node hears the end: members, spares, and a survivor that was not back
  // in time for the round.
  for (const auto& [session, node] : run.nodes.all()) {
    if (!node.last_seen) continue;
    out.push_back(send(session, last));
    out.push_back(close_with(session, absl::OkStatus()));
    session_run_.erase(session);
  }
  run.members.clear();
  run.waiting.clear();
  run.nodes.clear();
  run.phase = Phase::kFinished;
  run.result = last;
  run.reattach_until.reset();
  run.held_until.reset();
  run.phase_since = now;
  run.join_deadline.reset();
  run.last_call_deadline.reset();
  run.keep_alive_check.reset();
  run.expires_at = deadline(now, run.config.timeouts.finished_run_grace);
}

void StateMachine::on_failure(Run& run, SessionId session, const v1::ReportFailure& f,
                              TimePoint now, std::vector<Outgoing>& out) {
  // Only the running round's members count; a report for an older round is stale.
  if (run.phase != Phase::kRunning || find_session(run.members, session) == run.members.end() ||
      f.round() != run.round) {
    return;
  }
  if (f.in_place_fallback()) on_in_place_fallback(run, session, f, now);
  // Cut before anything is kept or forwarded: a Fail goes to every node of the run.
  const v1::WorkerFailure rc = cap_failure(f.root_cause());
  {
    RunEvent& e = emit(RunEvent::Kind::kWorkerFailed, run, now);
    e.host = ops::printable_utf8(rc.host(), limits::kMaxIdBytes);
    e.rank = rc.rank();
    e.exit_code = rc.exit_code();
    e.signal = rc.signal();
    if (auto m = find_session(run.members, session); m != run.members.end()) {
      e.node_id = m->join.node_id();
    }
    v1::FailureStatus& last = run.last_failure.emplace();
    last.set_round(run.round);
    last.set_rank(e.rank);
    last.set_host(e.host);
    last.set_node_id(e.node_id);
    last.set_exit_code(e.exit_code);
    last.set_signal(e.signal);
    last.set_timestamp_ms(rc.timestamp_ms());
    run.last_failure_at = now;
  }
  // The budget that knows progress: the most steps a rank made in this round.
  std::uint64_t steps = 0;
  for (const auto& [rank, span] : run.budget.round_steps) steps = std::max(steps, span.second - span.first);
  std::string note;
  if (run.budget.reset_steps > 0 && steps >= static_cast<std::uint64_t>(run.budget.reset_steps) &&
      run.restart_count > run.budget.from) {
    run.budget.from = run.restart_count;  // long progress: the whole budget is back
    note = absl::StrCat(" (", steps, " steps made: the restart budget is back)");
  }
  bool no_progress_stop = false;
  if (run.budget.max_restarts_without_progress > 0) {
    run.budget.restarts_without_progress = steps > 0 ? 0 : run.budget.restarts_without_progress + 1;
    no_progress_stop = run.budget.restarts_without_progress > run.budget.max_restarts_without_progress;
  }
  const int spent = run.restart_count - run.budget.from;
  if (spent < run.config.max_restarts && !no_progress_stop) {
    const std::string reason = absl::StrCat(
        "worker rank ", rc.rank(), " on ", ops::printable_utf8(rc.host(), limits::kMaxIdBytes),
        " failed; restart ", spent + 1, " of ", run.config.max_restarts, note);
    run.last_failure->set_reason(reason);
    restart(run, reason, "worker_failure", true, now, out);
    return;
  }
  v1::ServerMsg msg;
  v1::Fail* fail = msg.mutable_fail();
  if (no_progress_stop) {
    fail->set_do_not_requeue(true);
    fail->set_reason(absl::StrCat("a worker failed in ", run.budget.restarts_without_progress,
                                  " rounds in a row before any rank made a step "
                                  "(max_restarts_without_progress ",
                                  run.budget.max_restarts_without_progress, "); do not requeue"));
  } else {
    const int max_restarts = run.config.max_restarts;
    fail->set_reason(max_restarts == 0 ? std::string("a worker failed and max_restarts is 0")
                                       : absl::StrCat("a worker failed and all ", max_restarts,
                                                      " restarts are spent"));
  }
  *fail->mutable_root_cause() = rc;
  run.last_failure->set_reason(fail->reason());
  const int others = std::min<int>(f.others_size(), limits::kMaxFailureOthers);
  for (int i = 0; i < others; ++i) *fail->add_others() = cap_failure(f.others(i));
  finish(run, msg, now, out);
}

void StateMachine::on_success(Run& run, SessionId session, const v1::ReportSuccess& s,
                              TimePoint now, std::vector<Outgoing>& out) {
  if (run.phase != Phase::kRunning || find_session(run.members, session) == run.members.end() ||
      s.round() != run.round) {
    return;
  }
  run.nodes.set_succeeded(session, true);
  if (run.nodes.succeeded_count() == run.members.size()) {
    v1::ServerMsg msg;
    msg.mutable_done();
    finish(run, msg, now, out);
  }
}

Decision StateMachine::on_stream_closed(SessionId session, TimePoint now) {
  std::vector<Outgoing> out;
  leave(session, now, out);
  return decided(std::move(out));
}

void StateMachine::leave(SessionId session, TimePoint now, std::vector<Outgoing>& out) {
  Run* run = run_of(session);
  if (run == nullptr) {
    session_run_.erase(session);
    return;
  }
  const std::string id = run->id;
  drop_session(*run, session, now, out);
  drop_if_unheld(id);
}

void StateMachine::refuse(SessionId session, absl::Status status, TimePoint now,
                          std::vector<Outgoing>& out) {
  out.push_back(close_with(session, std::move(status)));
  // The stream is ending: the session is out of its run now, not when the close is seen.
  leave(session, now, out);
}

bool StateMachine::drop_if_unheld(const std::string& run_id) {
  auto it = runs_.find(run_id);
  if (it == runs_.end() || it->second.phase == Phase::kFinished ||
      run_held(it->second) || it->second.held_until) {
    return false;
  }
  // Nobody holds the run: whatever its round, nobody can finish it or be told about it.
  runs_.erase(it);
  touch(run_id);
  return true;
}

std::optional<std::string> StateMachine::remove_session(Run& run, SessionId session,
                                                       TimePoint now, std::string_view cause) {
  if (run.phase != Phase::kFinished && run.nodes.connected(session)) {
    const Node* node = nullptr;
    if (auto m = find_session(run.members, session); m != run.members.end()) node = &*m;
    if (auto w = find_session(run.waiting, session); w != run.waiting.end()) node = &*w;
    RunEvent& e = emit(RunEvent::Kind::kNodeLost, run, now);
    e.cause = std::string(cause);
    e.member = run.phase == Phase::kRunning &&
               find_session(run.members, session) != run.members.end();
    if (node != nullptr) {
      e.node_id = node->join.node_id();
      e.host = node->join.host();
    }
  }
  session_run_.erase(session);
  // Its record goes: a survivor that dies before it rejoins is no longer waited for.
  if (run.nodes.connected(session)) run.nodes.erase(session);
  if (auto w = find_session(run.waiting, session); w != run.waiting.end()) run.waiting.erase(w);
  auto member = find_session(run.members, session);
  if (run.phase != Phase::kRunning || member == run.members.end()) return std::nullopt;
  std::string node = member->join.node_id();
  run.members.erase(member);
  return node;
}

void StateMachine::after_loss(Run& run, const std::vector<std::string>& lost_members,
                              TimePoint now, std::vector<Outgoing>& out) {
  if (run.phase == Phase::kRunning && !lost_members.empty()) {
    restart(run,
            absl::StrCat(lost_members.size() == 1 ? "node " : "nodes ",
                         absl::StrJoin(lost_members, ", "), " left the run"),
            "node_lost", false, now, out);
  } else if (run.phase == Phase::kJoining) {
    maybe_close_round(run, now, out);
  }
}

void StateMachine::drop_session(Run& run, SessionId session, TimePoint now,
                                std::vector<Outgoing>& out) {
  std::vector<std::string> lost;
  if (auto node = remove_session(run, session, now, "stream_closed")) lost.push_back(std::move(*node));
  after_loss(run, lost, now, out);
}

}  // namespace muster::rendezvous
