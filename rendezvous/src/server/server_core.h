// The rendezvous server's core (private to server*.cc): the state machine on the io thread,
// the session table, write-ahead to the run store, the standby's held sessions. The gRPC
// service (rendezvous_service.h) and each stream's reactor (session_reactor.h) call into it;
// RendezvousServer (server.cc) owns it.
#pragma once

#include <unistd.h>

#include "muster/rendezvous/server.h"

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
#include "muster/ops/host_id.h"
#include "muster/rendezvous/limits.h"
#include "server/server_metrics.h"
#include "client/status_convert.h"
#include "store/tcpstore/agent_stores.h"
#include "store/store_server.h"
#include "muster/ops/text.h"
#include "muster/v1/rendezvous.grpc.pb.h"

namespace muster::rendezvous::server_internal {

// What a standby answers a call it will not serve: who leads, when it knows (agents and
// workers move there; docs/rendezvous.md, "Replicated mode").
grpc::Status standby_refusal(const std::string& leader, const char* when = "");

// A session's server end, as the core sees it: a gRPC stream's reactor
// (session_reactor.h) or an agent in this process (local_sessions.h). Called on the io
// thread, under the session's SessionLink::mu; neither call may call back into the core.
class SessionSink {
 public:
  virtual void enqueue(v1::ServerMsg msg) = 0;
  virtual void finish(grpc::Status status) = 0;

 protected:
  ~SessionSink() = default;
};

// What the io thread holds for a session: a handle that outlives the sink.
struct SessionLink {
  absl::Mutex mu;
  SessionSink* sink ABSL_GUARDED_BY(mu) = nullptr;  // null once the session is done
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



// State owned by the io thread: the state machine, the session table and the timer.
class Core : public std::enable_shared_from_this<Core> {
 public:
  Core(boost::asio::io_context& io, ServerOptions opts, std::shared_ptr<Credentials> credentials);

  boost::asio::io_context& io() { return io_; }
  // Any thread.
  const Credentials& credentials() const { return *credentials_; }
  // Any thread: the edge's checks of an agent's message, a gRPC stream's or a local
  // session's, before the state machine sees it: its size (kMaxAgentMessageBytes; the
  // server's receive cap is the store's), and a join's token must open its run (a join this
  // token does not open cannot hold that run's round or change it). OK, or why not.
  absl::Status admit(const v1::AgentMsg& msg) const;
  // Any thread: the id of a new session (gRPC streams and local ones share the count).
  SessionId new_session_id() { return next_session_id_.fetch_add(1); }

  // io thread only.
  void on_open(SessionId id, std::shared_ptr<SessionLink> link) { links_[id] = std::move(link); }
  void on_message(SessionId id, const v1::AgentMsg& msg);
  void on_closed(SessionId id);
  void apply(Decision decision);
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
  // The worlds' TCPStore-protocol tables the agents relay to (null: ServerOptions::agent_store
  // off). Any thread.
  const std::shared_ptr<AgentStores>& agent_stores() const { return agent_stores_; }
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
  // Write-ahead: the records of the runs the decisions since the last flush touched go to
  // the run store before any of their messages is sent (false: the store is lost, nothing
  // may be sent).
  bool persist(const std::set<std::string>& touched);
  // Group commit: with a run store, apply() merges a decision into uncommitted_ and one
  // flush per turn of the loop writes what every decision merged so far changed, then sends
  // them all.
  void flush();
  void deliver(Decision decision);
  void hold(SessionId id, const v1::AgentMsg& msg);
  void arm_hold_timer();
  void end_held(SessionId id, grpc::Status status);
  void send_to(SessionId id, v1::ServerMsg msg);

  boost::asio::io_context& io_;
  std::atomic<SessionId> next_session_id_{1};
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
  std::shared_ptr<AgentStores> agent_stores_;  // ServerOptions::agent_store; null when off
  std::string local_store_target_, host_identity_;
  std::set<std::string> seen_runs_;  // runs that have had a Join, for dropping their tables
  std::set<std::string> not_durable_;  // runs whose last write failed (said once each)

  Decision uncommitted_;  // decided, waiting for the flush that writes them
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

}  // namespace muster::rendezvous::server_internal
