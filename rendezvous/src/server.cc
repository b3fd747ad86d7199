#include "muster/rendezvous/server.h"

#include <unistd.h>

#include <random>

#include <grpc/support/log.h>
#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <atomic>
#include <deque>
#include <map>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "muster/ops/build_info.h"
#include "muster/rendezvous/host_id.h"
#include "muster/rendezvous/limits.h"
#include "health.h"
#include "memory_trim.h"
#include "server_metrics.h"
#include "status_convert.h"
#include "tcpstore/agent_stores.h"
#include "store_server.h"
#include "muster/rendezvous/text.h"
#include "muster/v1/rendezvous.grpc.pb.h"

namespace muster::rendezvous {
namespace {

// What a standby answers a call it will not serve: who leads, when it knows (agents and
// workers move there; docs/rendezvous.md, "Replicated mode").
grpc::Status standby_refusal(const std::string& leader, const char* when = "") {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                      leader.empty() ? std::string("rendezvous: this rdzvd is a standby")
                                     : absl::StrCat("rendezvous: this rdzvd is a standby; ",
                                                    leader, " leads", when));
}

class SessionReactor;

// What the io thread holds for a session: a handle that outlives the reactor.
struct SessionLink {
  absl::Mutex mu;
  SessionReactor* reactor ABSL_GUARDED_BY(mu) = nullptr;  // null once the reactor is done
};

// A GetStatus call waiting for the io thread. Finished exactly once: by the io thread with
// the answer, or by shutdown (the io_context may have stopped: an embedded server outlives
// its agent's loop), so a status call can never hold up the server's Shutdown.
struct PendingStatus {
  absl::Mutex mu;
  grpc::ServerUnaryReactor* reactor ABSL_GUARDED_BY(mu) = nullptr;  // null once finished
  const v1::StatusRequest* request = nullptr;
  v1::StatusReply* reply ABSL_GUARDED_BY(mu) = nullptr;
};

}  // namespace

// State owned by the io thread: the state machine, the session table and the timer.
class Core : public std::enable_shared_from_this<Core> {
 public:
  Core(boost::asio::io_context& io, ServerOptions opts, std::shared_ptr<Credentials> credentials);

  boost::asio::io_context& io() { return io_; }
  // Any thread.
  const Credentials& credentials() const { return *credentials_; }

  // io thread only.
  void on_open(SessionId id, std::shared_ptr<SessionLink> link) { links_[id] = std::move(link); }
  void on_message(SessionId id, const v1::AgentMsg& msg);
  void on_closed(SessionId id);
  void apply(std::vector<Outgoing> out);
  // io thread: replicated mode (ServerOptions::standby). Until lead(), a session's messages
  // are held (its keep-alives answered), not decided; lead() restores from `store` and then
  // decides what was held, in order. set_leader(): another replica leads, so the held
  // sessions are told to go there.
  bool standby() const { return standby_; }
  // Any thread, at the start of a shutdown: with a run store, nothing is decided from now on,
  // so the streams the shutdown ends are not losses, and the runs stay in the store as they
  // were for whoever serves them next (a restarted server, or the replica that takes over).
  // Returns once no write is in flight: the store is not written after it (a replica may then
  // give its leadership up).
  void freeze() {
    frozen_ = true;
    absl::MutexLock lock(&write_mu_);  // waits for a write the io thread has begun
  }
  const std::string& leader_hint() const { return leader_hint_; }
  RestoreSummary lead(std::shared_ptr<RunStore> store);
  void set_leader(const std::string& name);
  // io thread: what GetStatus answers for `run_id` (every run when empty).
  void fill_status(const std::string& run_id, v1::StatusReply& reply) const {
    for (auto& run : machine_.status(run_id, Clock::now())) *reply.add_runs() = std::move(run);
    fill_store_stats(*reply.mutable_store());
    reply.set_server_version(std::string(ops::build_version()));
    reply.set_server_commit(std::string(ops::build_commit()));
  }

  void set_store(StoreServer* store) { store_ = store; }
  // io thread: what the metrics sample (server_metrics.h).
  ServerSample sample() const;
  // Before serving (no io thread runs the core yet): loads the run store into the machine.
  absl::StatusOr<RestoreSummary> restore();
  void fill_store_stats(v1::StoreStats& out) const {
    if (store_ != nullptr) out.set_parked_waits(static_cast<std::int64_t>(store_->parked_waits()));
  }

  // Any thread. Registers a status call; false once the server is stopping.
  bool add_pending(const std::shared_ptr<PendingStatus>& p) {
    absl::MutexLock lock(&pending_mu_);
    if (stopping_) return false;
    pending_.insert(p);
    return true;
  }
  void remove_pending(const std::shared_ptr<PendingStatus>& p) {
    absl::MutexLock lock(&pending_mu_);
    pending_.erase(p);
  }
  // Any thread but the io one. Answers every waiting status call with UNAVAILABLE.
  void stop_pending();
  // Before serving: the store's local target, stamped into every Assignment.
  void set_local_store(std::string target, std::string host) {
    local_store_target_ = std::move(target);
    host_identity_ = std::move(host);
  }

 // io thread: gives memory back to the system now and then (memory_trim.h).
  void start_housekeeping();

 private:
  void arm_timer();
  // Write-ahead: the records the decisions since the last flush changed go to the run store
  // before any of their messages is sent (false: the store is lost, nothing may be sent).
  bool persist();
  // Group commit: with a run store, apply() queues a decision's messages and one flush per
  // turn of the loop writes what every decision queued so far changed, then sends them all.
  void flush();
  void deliver(std::vector<Outgoing> out);
  void hold(SessionId id, const v1::AgentMsg& msg);
  void arm_hold_timer();
  void end_held(SessionId id, grpc::Status status);
  void send_to(SessionId id, v1::ServerMsg msg);

  boost::asio::io_context& io_;
  ServerOptions opts_;
  const std::shared_ptr<Credentials> credentials_;
  StateMachine machine_;
  boost::asio::steady_timer timer_;
  std::optional<TimePoint> armed_for_;
  boost::asio::steady_timer trim_timer_;
  std::unordered_map<SessionId, std::shared_ptr<SessionLink>> links_;

  // Drops the store tables of runs the state machine has forgotten.
  void drop_finished_tables();
  // A run's store tables, gRPC and TCPStore protocol (before its first Assignment).
  void open_tables(const std::string& run);

  absl::Mutex pending_mu_;
  std::set<std::shared_ptr<PendingStatus>> pending_ ABSL_GUARDED_BY(pending_mu_);
  bool stopping_ ABSL_GUARDED_BY(pending_mu_) = false;

  StoreServer* store_ = nullptr;  // outlives the core's use of it (shut down after the server)
  std::unique_ptr<AgentStores> agent_stores_;  // ServerOptions::agent_store; null when off
  std::string local_store_target_, host_identity_;
  std::set<std::string> seen_runs_;  // runs that have had a Join, for dropping their tables
  std::set<std::string> not_durable_;  // runs whose last write failed (said once each)

  std::vector<Outgoing> unsent_;  // decided, waiting for the flush that writes them
  bool flush_posted_ = false;
  bool store_lost_ = false;       // a write failed with on_store_lost set: nothing more is sent

  std::atomic<bool> frozen_{false};
  absl::Mutex write_mu_;  // held by the io thread while it writes the run store
  bool decides() const { return !(frozen_ && opts_.run_store); }

  bool standby_ = false;
  struct Held {
    std::vector<v1::AgentMsg> msgs;
    TimePoint until;
  };
  std::map<SessionId, Held> held_;  // by session id: the order streams came in
  boost::asio::steady_timer hold_timer_;
  std::string leader_hint_;
};

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
  if (opts_.agent_store && !opts_.tls.enabled() && !opts_.standby) {
    agent_stores_ = std::make_unique<AgentStores>(listen_host(opts_.listen_address),
                                                  opts_.store_limits);
  }
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
  (void)machine_.take_record_changes();  // what was just loaded is what the store holds
  return summary;
}

bool Core::persist() {
  if (!opts_.run_store) return true;
  StateMachine::RecordChanges changes = machine_.take_record_changes();
  for (const v1::RunRecord& r : changes.put) {
    absl::Status st = opts_.run_store->put(r);
    if (!st.ok() && opts_.on_store_lost) {
      opts_.on_store_lost(st);
      return false;
    }
    if (st.ok()) {
      if (not_durable_.erase(r.run_id()) > 0) {
        spdlog::info("rendezvous: run '{}' is durable again", printable_utf8(r.run_id(), limits::kMaxIdBytes));
      }
      continue;
    }
    // Better no record than a stale one: a restarted server that forgot the run lets its
    // nodes form it anew; one that went back to an older round would tell them the past.
    (void)opts_.run_store->erase(r.run_id());
    if (not_durable_.insert(r.run_id()).second) {
      spdlog::error("rendezvous: {}; run '{}' is not durable until a write succeeds (a restart "
                    "of the server would forget it)",
                    std::string(st.message()), printable_utf8(r.run_id(), limits::kMaxIdBytes));
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

namespace {

// One agent's stream. Reactions run on gRPC threads; no lock is held across a Start* call
// because a reaction may run on another thread before the call returns.
class SessionReactor : public grpc::ServerBidiReactor<v1::AgentMsg, v1::ServerMsg> {
 public:
  SessionReactor(std::shared_ptr<Core> core, SessionId id)
      : core_(std::move(core)), id_(id), link_(std::make_shared<SessionLink>()) {
    {
      absl::MutexLock lock(&link_->mu);
      link_->reactor = this;
    }
    boost::asio::post(core_->io(),
                      [core = core_, id = id_, link = link_] { core->on_open(id, link); });
    StartRead(&in_);
  }

  // Called from the io thread through the link, under link->mu.
  void enqueue(v1::ServerMsg msg) {
    v1::ServerMsg* start = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (finishing_) return;
      queue_.push_back(std::move(msg));
      if (!writing_) {
        writing_ = true;
        start = &queue_.front();
      }
    }
    if (start != nullptr) StartWrite(start);
  }

  void finish(grpc::Status status) {
    bool now = false;
    {
      absl::MutexLock lock(&mu_);
      if (finishing_) return;
      finishing_ = true;
      final_ = std::move(status);
      now = !writing_;
    }
    if (now) Finish(final_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the agent half-closed or the stream broke
      post_closed();
      finish(grpc::Status::OK);
      return;
    }
    // The server's receive cap is the store's (values of megabytes share the port); an
    // agent's message has the tighter bound of its own.
    if (in_.ByteSizeLong() > limits::kMaxAgentMessageBytes) {
      post_closed();
      finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("rendezvous: a message of ", in_.ByteSizeLong(),
                                       " bytes is over the limit of ",
                                       limits::kMaxAgentMessageBytes)));
      return;
    }
    // Before the state machine sees it: a join to a run this token does not open cannot
    // hold that run's round or change it in any way.
    if (in_.has_join() && !core_->credentials().allows(in_.join().run_id(), in_.join().token())) {
      post_closed();
      finish(grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                          "rendezvous refused the join: wrong or missing token for this run"));
      return;
    }
    boost::asio::post(core_->io(),
                      [core = core_, id = id_, msg = in_] { core->on_message(id, msg); });
    StartRead(&in_);
  }

  void OnWriteDone(bool ok) override {
    v1::ServerMsg* next = nullptr;
    bool finish_now = false;
    {
      absl::MutexLock lock(&mu_);
      queue_.pop_front();
      if (ok && !queue_.empty()) {
        next = &queue_.front();
      } else {
        writing_ = false;
        finish_now = finishing_;
      }
    }
    if (next != nullptr) {
      StartWrite(next);
    } else if (finish_now) {
      Finish(final_);
    } else if (!ok) {
      finish(grpc::Status::OK);
    }
  }

  // The client went away or the server is shutting down: a pending read or write also
  // completes (not ok), which finishes the call; this only makes the end prompt.
  void OnCancel() override {
    post_closed();
    finish(grpc::Status(grpc::StatusCode::CANCELLED, "rendezvous: the session was cancelled"));
  }

  void OnDone() override {
    post_closed();
    {
      absl::MutexLock lock(&link_->mu);
      link_->reactor = nullptr;
    }
    delete this;
  }

 private:
  void post_closed() {
    if (closed_posted_.exchange(true)) return;
    boost::asio::post(core_->io(), [core = core_, id = id_] { core->on_closed(id); });
  }

  std::shared_ptr<Core> core_;
  const SessionId id_;
  std::shared_ptr<SessionLink> link_;
  v1::AgentMsg in_;
  std::atomic<bool> closed_posted_{false};
  absl::Mutex mu_;
  std::deque<v1::ServerMsg> queue_ ABSL_GUARDED_BY(mu_);  // front() is being written
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status final_;
};

class Service final : public v1::Rendezvous::CallbackService {
 public:
  explicit Service(std::shared_ptr<Core> core) : core_(std::move(core)) {}
  grpc::ServerBidiReactor<v1::AgentMsg, v1::ServerMsg>* Session(
      grpc::CallbackServerContext*) override {
    return new SessionReactor(core_, next_id_.fetch_add(1));
  }

  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* ctx,
                                      const v1::StatusRequest* request,
                                      v1::StatusReply* reply) override {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    const Credentials& creds = core_->credentials();
    if (request->run_id().empty() ? !creds.allows_all_runs(request->token())
                                  : !creds.allows(request->run_id(), request->token())) {
      reactor->Finish(grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                                   "rendezvous refused the status call: wrong or missing token"));
      return reactor;
    }
    if (request->run_id().size() > limits::kMaxIdBytes || !is_valid_utf8(request->run_id())) {
      reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                   "status: the run id is longer than 256 bytes or not UTF-8"));
      return reactor;
    }
    auto pending = std::make_shared<PendingStatus>();
    {
      absl::MutexLock lock(&pending->mu);
      pending->reactor = reactor;
      pending->request = request;
      pending->reply = reply;
    }
    if (!core_->add_pending(pending)) {
      reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                   "rendezvous: the server is shutting down"));
      return reactor;
    }
    // request and reply stay valid until Finish.
    boost::asio::post(core_->io(), [core = core_, pending] {
      core->remove_pending(pending);
      absl::MutexLock lock(&pending->mu);
      if (pending->reactor == nullptr) return;  // shutdown answered it
      if (core->standby()) {
        pending->reactor->Finish(standby_refusal(core->leader_hint()));
        pending->reactor = nullptr;
        return;
      }
      core->fill_status(pending->request->run_id(), *pending->reply);
      pending->reactor->Finish(grpc::Status::OK);
      pending->reactor = nullptr;
    });
    return reactor;
  }

 private:
  std::shared_ptr<Core> core_;
  std::atomic<SessionId> next_id_{1};
};

}  // namespace

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
  if (it->second->reactor != nullptr) it->second->reactor->enqueue(std::move(msg));
}

void Core::end_held(SessionId id, grpc::Status status) {
  held_.erase(id);
  auto it = links_.find(id);
  if (it == links_.end()) return;
  absl::MutexLock lock(&it->second->mu);
  if (it->second->reactor != nullptr) it->second->reactor->finish(std::move(status));
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
  std::vector<Outgoing> out = machine_.on_message(id, msg, Clock::now());
  // The store serves only runs the state machine holds, so a run's table exists before its
  // first Assignment is sent and goes when the run goes (drop_finished_tables).
  if (msg.has_join()) {
    const std::string& run = msg.join().run_id();
    if (machine_.has_run(run) && seen_runs_.insert(run).second) open_tables(run);
  }
  apply(std::move(out));
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

void Core::apply(std::vector<Outgoing> out) {
  // Every call into the machine ends here (message, closed stream, tick).
  if (store_lost_) return;
  if (!opts_.run_store) {
    deliver(std::move(out));
    return;
  }
  for (Outgoing& o : out) unsent_.push_back(std::move(o));
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
    if (!persist()) {  // before any of the decisions' messages leaves
      store_lost_ = true;
      unsent_.clear();
      return;
    }
  }
  deliver(std::exchange(unsent_, {}));
}

void Core::deliver(std::vector<Outgoing> out) {
  for (const RunEvent& e : machine_.take_events()) {
    for (const auto& sink : opts_.event_sinks) sink(e);
  }
  for (Outgoing& o : out) {
    auto it = links_.find(o.session);
    if (it == links_.end()) continue;
    absl::MutexLock lock(&it->second->mu);
    SessionReactor* r = it->second->reactor;
    if (r == nullptr) continue;
    if (o.msg && o.msg->has_assignment() && !local_store_target_.empty()) {
      o.msg->mutable_assignment()->set_store_local_target(local_store_target_);
      o.msg->mutable_assignment()->set_server_host_identity(host_identity_);
    }
    if (o.msg && o.msg->has_assignment() && agent_stores_) {
      if (const std::string* run = machine_.run_id_of(o.session)) {
        o.msg->mutable_assignment()->set_agent_store_port(agent_stores_->port(*run));
      }
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

class RendezvousServer::Impl {
 public:
  std::shared_ptr<Core> core;
  std::unique_ptr<Service> service;
  std::unique_ptr<StoreServer> store;
  std::unique_ptr<grpc::Server> server;
  std::shared_ptr<Credentials> credentials;
  int port = 0;
  RestoreSummary restored;
  std::string local_target;
  bool stopped = false;
  ops::Registry* metrics_registry = nullptr;
  int metrics_collector = 0;  // the registry's id of our collector; 0: none
};

absl::StatusOr<std::unique_ptr<RendezvousServer>> RendezvousServer::start(
    boost::asio::io_context& io, ServerOptions options) {
  auto impl = std::make_unique<Impl>();
  std::string address = options.listen_address;
  const int max_bytes = static_cast<int>(options.max_message_bytes);
  std::shared_ptr<ServerMetrics> metrics;
  if (options.metrics != nullptr) {
    impl->metrics_registry = options.metrics;
    metrics = std::make_shared<ServerMetrics>();
    options.event_sinks.push_back([metrics](const RunEvent& e) { metrics->on_event(e); });
  }
  const bool tls = options.tls.enabled();
  impl->credentials = std::make_shared<Credentials>(options.token, std::move(options.run_tokens));
  impl->store = std::make_unique<StoreServer>(options.store_limits, impl->credentials);
  const std::shared_ptr<grpc::ServerCredentials> creds = server_credentials(options.tls);
  impl->core = std::make_shared<Core>(io, std::move(options), impl->credentials);
  impl->service = std::make_unique<Service>(impl->core);
  impl->core->set_store(impl->store.get());
  enable_health_service();
  if (!impl->core->standby()) {  // a standby restores when it comes to lead
    absl::StatusOr<RestoreSummary> restored = impl->core->restore();
    if (!restored.ok()) return restored.status();
    impl->restored = std::move(*restored);
  }
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, creds, &impl->port);
  // Also on an abstract Unix-domain socket: workers on this machine (and network namespace)
  // reach the store there, faster than over TCP loopback (docs/worker_runtime.md). Not with
  // TLS: a plaintext socket beside the TLS port would let a local client past the
  // client-certificate check.
  const std::string host = tls ? std::string() : host_identity();
  if (!host.empty()) {
    impl->local_target = absl::StrCat("unix-abstract:muster-rdzv-", ::getpid(), "-",
                                      std::random_device{}());
    builder.AddListeningPort(impl->local_target, grpc::InsecureServerCredentials());
    impl->core->set_local_store(impl->local_target, host);
  }
  builder.RegisterService(impl->service.get());
  impl->store->register_with(builder);
  builder.SetMaxReceiveMessageSize(max_bytes);
  builder.SetMaxSendMessageSize(max_bytes);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                             limits::kMaxConcurrentStreamsPerConnection);
  // Exactly one server per port: a second agent on this host must fail to bind and connect.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_OPTIMIZATION_TARGET, std::string("latency"));
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  // Silent nodes are the state machine's to drop, by their run's liveness window. The
  // transport keep-alive only reclaims connections silent for longer than any window may be
  // (limits.h), so it never decides first.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS,
                             static_cast<int>(limits::kMaxLivenessWindow.count()));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                             static_cast<int>(limits::kTransportKeepAliveTimeout.count()));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Clients that do ping (the workers' store channels) are never refused for it.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  impl->server = builder.BuildAndStart();
  boost::asio::post(io, [core = std::weak_ptr<Core>(impl->core)] {
    if (auto c = core.lock()) {
      c->start_housekeeping();
      c->apply({});  // the restored runs' events to the sinks, and their timers
    }
  });
  if (!impl->server || impl->port == 0) {
    return absl::UnavailableError(absl::StrCat("rendezvous server cannot listen on ", address));
  }
  set_serving(*impl->server, true);
  if (impl->core->standby()) set_leading(*impl->server, false);
  if (metrics) {
    metrics->attach(*impl->metrics_registry);
    // Removed by shutdown(), before the store goes: the collector reads it.
    impl->metrics_collector = impl->metrics_registry->add_collector(
        [&io, metrics, core = std::weak_ptr<Core>(impl->core), store = impl->store.get()] {
          metrics->collect(
              io, [core] { auto c = core.lock(); return c ? c->sample() : ServerSample{}; },
              *store);
        });
  }
  return std::unique_ptr<RendezvousServer>(new RendezvousServer(std::move(impl)));
}

RendezvousServer::RendezvousServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RendezvousServer::~RendezvousServer() { shutdown(); }

int RendezvousServer::port() const { return impl_->port; }

void RendezvousServer::set_run_tokens(RunTokens tokens) {
  impl_->credentials->set_run_tokens(std::move(tokens));
}
const RestoreSummary& RendezvousServer::restored() const { return impl_->restored; }

void RendezvousServer::lead(std::shared_ptr<RunStore> store,
                            std::function<void(const RestoreSummary&)> done) {
  if (!impl_->stopped) set_leading(*impl_->server, true);
  boost::asio::post(impl_->core->io(), [core = std::weak_ptr<Core>(impl_->core),
                                        store = std::move(store), done = std::move(done)] {
    auto c = core.lock();
    if (!c || !c->standby()) return;
    RestoreSummary summary = c->lead(store);
    if (done && !c->standby()) done(summary);
  });
}

void RendezvousServer::set_leader(std::string name) {
  boost::asio::post(impl_->core->io(), [core = std::weak_ptr<Core>(impl_->core),
                                        name = std::move(name)] {
    if (auto c = core.lock()) c->set_leader(name);
  });
}

const std::string& RendezvousServer::local_store_target() const { return impl_->local_target; }

void RendezvousServer::post_status(const std::string& run_id,
                                   std::function<void(v1::StatusReply)> done) {
  boost::asio::post(impl_->core->io(), [core = std::weak_ptr<Core>(impl_->core), run_id,
                                        done = std::move(done)] {
    auto c = core.lock();
    if (!c) return;
    v1::StatusReply reply;
    c->fill_status(run_id, reply);
    done(std::move(reply));
  });
}

void RendezvousServer::shutdown(std::chrono::milliseconds grace) {
  if (impl_->stopped) return;
  impl_->stopped = true;
  impl_->core->freeze();
  set_serving(*impl_->server, false);  // probes see it go first
  if (impl_->metrics_collector != 0) {
    impl_->metrics_registry->remove_collector(impl_->metrics_collector);
  }
  // Calls that would otherwise wait past the deadline end first: status calls waiting for the
  // io thread (which may have stopped) and parked store waits (up to their own timeouts).
  impl_->core->stop_pending();
  impl_->store->shutdown();
  impl_->server->Shutdown(std::chrono::system_clock::now() + grace);
  impl_->server->Wait();
}

void route_grpc_logs_to_spdlog() {
  gpr_set_log_function([](gpr_log_func_args* args) { spdlog::debug("grpc: {}", args->message); });
}

}  // namespace muster::rendezvous
