#include "server/server_core.h"

#include "server/health.h"
#include "server/memory_trim.h"
#include "server/session_reactor.h"

namespace muster::rendezvous::server_internal {


// What a standby answers a call it will not serve: who leads, when it knows (agents and
// workers move there; docs/rendezvous.md, "Replicated mode").
grpc::Status standby_refusal(const std::string& leader, const char* when) {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                      leader.empty() ? std::string("rendezvous: this rdzvd is a standby")
                                     : absl::StrCat("rendezvous: this rdzvd is a standby; ",
                                                    leader, " leads", when));
}

Core::Core(boost::asio::io_context& io, ServerOptions opts,
           std::shared_ptr<Credentials> credentials)
    : io_(io),
      opts_(std::move(opts)),
      credentials_(std::move(credentials)),
      machine_(opts_.timeouts),
      timer_(io),
      trim_timer_(io),
      standby_(opts_.standby),
      hold_timer_(io) {
  if (opts_.run_store) machine_.enable_records();
  if (opts_.agent_store) agent_stores_ = std::make_shared<AgentStores>(opts_.store_limits);
}

absl::Status Core::admit(const v1::AgentMsg& msg) const {
  if (msg.ByteSizeLong() > limits::kMaxAgentMessageBytes) {
    return absl::ResourceExhaustedError(absl::StrCat("rendezvous: a message of ",
                                                     msg.ByteSizeLong(), " bytes is over the limit of ",
                                                     limits::kMaxAgentMessageBytes));
  }
  if (msg.has_join() && !credentials_->allows(msg.join().run_id(), msg.join().token())) {
    return absl::PermissionDeniedError(
        "rendezvous refused the join: wrong or missing token for this run");
  }
  return absl::OkStatus();
}

void Core::open_tables(const std::string& run) {
  if (store_ != nullptr) store_->open_run(run);
  if (agent_stores_) agent_stores_->open(run);
}

absl::StatusOr<RestoreSummary> Core::restore() {
  RestoreSummary summary;
  if (!opts_.run_store) return summary;
  absl::StatusOr<RunStore::Loaded> loaded = opts_.run_store->load_all();
  if (!loaded.ok()) return loaded.status();
  summary.skipped = std::move(loaded->skipped);
  StateMachine::RestoreResult r = machine_.restore(loaded->records, Clock::now());
  for (std::string& line : r.refused) summary.skipped.push_back(std::move(line));
  Decision restored;
  restored.events = std::move(r.events);  // to the sinks with the next decision
  uncommitted_.merge(std::move(restored));
  for (const v1::RunRecord& rec : loaded->records) {
    // A record the machine refused (said in `skipped`) is left where it is: it may be of a
    // newer server's format. A run of that id formed anew writes over it.
    if (!machine_.has_run(rec.run_id())) continue;
    ++summary.runs;
    if (rec.phase() == v1::RunRecord::RUNNING) ++summary.running;
    // The store serves only runs the machine holds: a restored run's table is there (empty:
    // the keys workers set are not kept) for its workers' next call.
    if (seen_runs_.insert(rec.run_id()).second) open_tables(rec.run_id());
  }
  return summary;
}

bool Core::persist(const std::set<std::string>& touched) {
  if (!opts_.run_store) return true;
  StateMachine::RecordChanges changes = machine_.records(touched);
  for (const v1::RunRecord& r : changes.put) {
    absl::Status st = opts_.run_store->put(r);
    if (!st.ok() && opts_.on_store_lost) {
      opts_.on_store_lost(st);
      return false;
    }
    if (st.ok()) {
      if (not_durable_.erase(r.run_id()) > 0) {
        spdlog::info("rendezvous: run '{}' is durable again", ops::printable_utf8(r.run_id(), limits::kMaxIdBytes));
      }
      continue;
    }
    // Better no record than a stale one: a restarted server that forgot the run lets its
    // nodes form it anew; one that went back to an older round would tell them the past.
    (void)opts_.run_store->erase(r.run_id());
    if (not_durable_.insert(r.run_id()).second) {
      spdlog::error("rendezvous: {}; run '{}' is not durable until a write succeeds (a restart "
                    "of the server would forget it)",
                    std::string(st.message()), ops::printable_utf8(r.run_id(), limits::kMaxIdBytes));
    }
  }
  for (const std::string& id : changes.erased) {
    not_durable_.erase(id);
    if (absl::Status st = opts_.run_store->erase(id); !st.ok()) {
      if (opts_.on_store_lost) {
        opts_.on_store_lost(st);
        return false;
      }
      spdlog::error("rendezvous: {}", std::string(st.message()));
    }
  }
  return true;
}

void Core::start_housekeeping() {
  trim_timer_.expires_after(limits::kMemoryTrimInterval);
  trim_timer_.async_wait([self = weak_from_this()](const boost::system::error_code& ec) {
    auto core = self.lock();
    if (ec || !core) return;
    trim_free_memory(limits::kMemoryTrimThreshold);
    core->start_housekeeping();
  });
}

void Core::stop_pending() {
  std::set<std::shared_ptr<PendingStatus>> pending;
  {
    absl::MutexLock lock(&pending_mu_);
    stopping_ = true;
    pending.swap(pending_);
  }
  for (const auto& p : pending) {
    absl::MutexLock lock(&p->mu);
    if (p->reactor == nullptr) continue;
    p->reactor->Finish(
        grpc::Status(grpc::StatusCode::UNAVAILABLE, "rendezvous: the server is shutting down"));
    p->reactor = nullptr;
  }
}

ServerSample Core::sample() const {
  ServerSample s;
  const StateMachine::Counts c = machine_.counts();
  s.runs_joining = c.joining;
  s.runs_running = c.running;
  s.runs_finished = c.finished;
  s.nodes_members = c.members;
  s.nodes_waiting = c.waiting;
  s.nodes_connected = static_cast<std::int64_t>(machine_.num_sessions());
  s.agent_streams = static_cast<std::int64_t>(links_.size());
  return s;
}

void Core::drop_finished_tables() {
  for (auto it = seen_runs_.begin(); it != seen_runs_.end();) {
    if (machine_.has_run(*it)) {
      ++it;
      continue;
    }
    if (store_ != nullptr) store_->drop(*it);
    if (agent_stores_) agent_stores_->drop(*it);
    it = seen_runs_.erase(it);
  }
}

RestoreSummary Core::lead(std::shared_ptr<RunStore> store) {
  opts_.run_store = std::move(store);
  machine_.enable_records();
  RestoreSummary summary;
  absl::StatusOr<RestoreSummary> restored = restore();
  if (!restored.ok()) {
    // Leading without the runs would tell their nodes the runs are gone: better not lead.
    store_lost_ = true;
    if (opts_.on_store_lost) opts_.on_store_lost(restored.status());
    return summary;
  }
  summary = std::move(*restored);
  standby_ = false;
  hold_timer_.cancel();
  std::map<SessionId, Held> held = std::move(held_);
  held_.clear();
  apply({});  // the restored runs' events, timers and first write
  for (auto& [id, h] : held) {
    for (const v1::AgentMsg& msg : h.msgs) {
      if (links_.count(id) == 0) break;  // gone meanwhile
      on_message(id, msg);
    }
  }
  return summary;
}

void Core::set_leader(const std::string& name) {
  leader_hint_ = name;
  if (!standby_) return;
  std::vector<SessionId> ids;
  for (const auto& [id, h] : held_) ids.push_back(id);
  for (SessionId id : ids) {
    end_held(id, standby_refusal(name, " now"));
  }
}

void Core::send_to(SessionId id, v1::ServerMsg msg) {
  auto it = links_.find(id);
  if (it == links_.end()) return;
  absl::MutexLock lock(&it->second->mu);
  if (it->second->sink != nullptr) it->second->sink->enqueue(std::move(msg));
}

void Core::end_held(SessionId id, grpc::Status status) {
  held_.erase(id);
  auto it = links_.find(id);
  if (it == links_.end()) return;
  absl::MutexLock lock(&it->second->mu);
  if (it->second->sink != nullptr) it->second->sink->finish(std::move(status));
}

void Core::hold(SessionId id, const v1::AgentMsg& msg) {
  if (msg.has_keep_alive()) {
    // Answered, as the leader would: the agent keeps this stream while the replica may
    // come to lead.
    v1::ServerMsg reply;
    reply.mutable_keep_alive();
    send_to(id, std::move(reply));
    return;
  }
  // A node that joins afresh while another replica is known to lead goes there at once; one
  // that re-attaches is held: the leader it knew may be the one that just died.
  if (msg.has_join() && msg.join().reattach_round() == 0 && !leader_hint_.empty() &&
      held_.count(id) == 0) {
    end_held(id, standby_refusal(leader_hint_));
    return;
  }
  auto [it, fresh] = held_.try_emplace(id);
  if (fresh) it->second.until = Clock::now() + opts_.standby_hold;
  if (it->second.msgs.size() >= limits::kStandbyMaxHeldMessages) {
    end_held(id, grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                              "rendezvous: too many messages to a standby rdzvd"));
    return;
  }
  it->second.msgs.push_back(msg);
  if (fresh) arm_hold_timer();
}

void Core::arm_hold_timer() {
  if (held_.empty()) return;
  TimePoint first = held_.begin()->second.until;
  for (const auto& [id, h] : held_) first = std::min(first, h.until);
  hold_timer_.expires_at(first);
  hold_timer_.async_wait([self = weak_from_this()](const boost::system::error_code& ec) {
    auto core = self.lock();
    if (ec || !core || !core->standby_) return;
    const TimePoint now = Clock::now();
    std::vector<SessionId> due;
    for (const auto& [id, h] : core->held_) {
      if (h.until <= now) due.push_back(id);
    }
    for (SessionId id : due) {
      core->end_held(id, standby_refusal(core->leader_hint_));
    }
    core->arm_hold_timer();
  });
}

void Core::on_message(SessionId id, const v1::AgentMsg& msg) {
  if (standby_) {
    hold(id, msg);
    return;
  }
  if (!decides()) return;
  Decision decision = machine_.on_message(id, msg, Clock::now());
  // The store serves only runs the state machine holds, so a run's table exists before its
  // first Assignment is sent and goes when the run goes (drop_finished_tables).
  if (msg.has_join()) {
    const std::string& run = msg.join().run_id();
    if (machine_.has_run(run) && seen_runs_.insert(run).second) open_tables(run);
  }
  apply(std::move(decision));
}

void Core::on_closed(SessionId id) {
  links_.erase(id);
  if (standby_) {
    held_.erase(id);
    return;
  }
  if (!decides()) return;
  apply(machine_.on_stream_closed(id, Clock::now()));
}

void Core::apply(Decision decision) {
  // Every call into the machine ends here (message, closed stream, tick).
  if (store_lost_) return;
  if (!opts_.run_store) {
    deliver(std::move(decision));
    return;
  }
  uncommitted_.merge(std::move(decision));
  if (flush_posted_) return;
  flush_posted_ = true;
  // After what the loop already holds: a burst of joins is written once, not once each.
  boost::asio::post(io_, [self = weak_from_this()] {
    if (auto core = self.lock()) core->flush();
  });
}

void Core::flush() {
  flush_posted_ = false;
  {
    absl::MutexLock lock(&write_mu_);
    if (store_lost_ || !decides()) return;
    if (!persist(uncommitted_.touched)) {  // before any of the decisions' messages leaves
      store_lost_ = true;
      uncommitted_ = {};
      return;
    }
  }
  deliver(std::exchange(uncommitted_, {}));
}

void Core::deliver(Decision decision) {
  for (const RunEvent& e : decision.events) {
    for (const auto& sink : opts_.event_sinks) sink(e);
  }
  for (Outgoing& o : decision.messages) {
    auto it = links_.find(o.session);
    if (it == links_.end()) continue;
    absl::MutexLock lock(&it->second->mu);
    SessionSink* r = it->second->sink;
    if (r == nullptr) continue;
    if (o.msg && o.msg->has_assignment() && !local_store_target_.empty()) {
      o.msg->mutable_assignment()->set_store_local_target(local_store_target_);
      o.msg->mutable_assignment()->set_server_host_identity(host_identity_);
    }
    if (o.msg && o.msg->has_assignment() && agent_stores_) {
      // The round's world opens now (closing those before the newest kept), so that workers
      // of a world two rounds old find no table even before anyone names the new one.
      if (const std::string* run = machine_.run_id_of(o.session)) {
        agent_stores_->world(*run, o.msg->assignment().round());
      }
      o.msg->mutable_assignment()->set_store_relay(true);
    }
    if (o.msg) r->enqueue(std::move(*o.msg));
    if (o.close) r->finish(to_grpc(o.status));
  }
  // A run may have gone with this event (its last node left): its table goes now, before a
  // later Join could create a run of the same id and find the old keys. (Every run the
  // machine holds has had its table opened, so fewer runs than tables means one went.)
  if (machine_.num_runs() < seen_runs_.size()) drop_finished_tables();
  arm_timer();
}

void Core::arm_timer() {
  std::optional<TimePoint> when = machine_.next_deadline();
  if (when == armed_for_) return;
  armed_for_ = when;
  timer_.cancel();
  if (!when) return;
  timer_.expires_at(*when);
  timer_.async_wait([self = weak_from_this(), when](const boost::system::error_code& ec) {
    auto core = self.lock();
    if (ec || !core || core->armed_for_ != when || !core->decides()) return;
    core->armed_for_.reset();
    core->apply(core->machine_.on_tick(Clock::now()));
  });
}

}  // namespace muster::rendezvous::server_internal
