#include "muster/rendezvous/server.h"

#include <grpc/support/log.h>
#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <deque>
#include <list>
#include <mutex>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "muster/rendezvous/kv_table.h"
#include "muster/v1/rendezvous.grpc.pb.h"

namespace muster::rendezvous {
namespace {

grpc::Status to_grpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

class SessionReactor;

// What the io thread holds for a session: a handle that outlives the reactor.
struct SessionLink {
  std::mutex mu;
  SessionReactor* reactor = nullptr;  // null once the reactor is done; guarded by mu
};

}  // namespace

// State owned by the io thread: the state machine, the session table and the timer.
class Core : public std::enable_shared_from_this<Core> {
 public:
  Core(boost::asio::io_context& io, ServerOptions opts);

  boost::asio::io_context& io() { return io_; }
  const std::string& token() const { return opts_.token; }

  // io thread only.
  void on_open(SessionId id, std::shared_ptr<SessionLink> link) { links_[id] = std::move(link); }
  void on_message(SessionId id, const v1::AgentMsg& msg);
  void on_closed(SessionId id);
  void apply(std::vector<Outgoing> out);
  std::vector<v1::RunStatus> status(const std::string& run_id) const {
    return machine_.status(run_id);
  }

  class StoreState& store() { return *store_; }

 private:
  void arm_timer();

  boost::asio::io_context& io_;
  ServerOptions opts_;
  StateMachine machine_;
  boost::asio::steady_timer timer_;
  std::optional<TimePoint> armed_for_;
  std::unordered_map<SessionId, std::shared_ptr<SessionLink>> links_;

  // Drops the store tables of runs the state machine has forgotten.
  void drop_finished_tables();

  std::unique_ptr<class StoreState> store_;
  std::set<std::string> seen_runs_;  // runs that have had a Join, for dropping their tables
};

// Every run's key-value table. Called on gRPC's callback threads (a store call is answered
// where it arrives, without a hop to the io thread) and so guarded by a mutex; only a wait's
// timeout runs on the io thread. Reactors are finished outside the lock.
class StoreState {
 public:
  StoreState(boost::asio::io_context& io, StoreLimits limits) : io_(io), limits_(limits) {}

  void call(const v1::StoreRequest* req, v1::StoreReply* reply, grpc::ServerUnaryReactor* reactor);
  void drop(const std::string& run) {
    std::lock_guard<std::mutex> lock(mu_);
    tables_.erase(run);
  }

 private:
  // A Get, Wait or MultiGet whose keys are not all there yet.
  struct Waiter {
    const v1::StoreRequest* req;
    v1::StoreReply* reply;
    grpc::ServerUnaryReactor* reactor;
    boost::asio::steady_timer timer;  // io thread only
    bool done = false;                // guarded by mu_
    Waiter(const v1::StoreRequest* q, v1::StoreReply* r, grpc::ServerUnaryReactor* re,
           boost::asio::io_context& io)
        : req(q), reply(r), reactor(re), timer(io) {}
  };
  // REQUIRES: mu_ held. Moves the waiters of `run` whose keys now all exist into `ready`.
  void collect_ready(const std::string& run, std::vector<std::shared_ptr<Waiter>>& ready);
  static void answer_read(const KvTable& table, const v1::StoreRequest& req, v1::StoreReply* reply);

  boost::asio::io_context& io_;
  const StoreLimits limits_;
  std::mutex mu_;
  std::unordered_map<std::string, KvTable> tables_;                               // guarded by mu_
  std::unordered_map<std::string, std::list<std::shared_ptr<Waiter>>> waiters_;  // guarded by mu_
};

Core::Core(boost::asio::io_context& io, ServerOptions opts)
    : io_(io),
      opts_(std::move(opts)),
      machine_(opts_.timeouts),
      timer_(io),
      store_(std::make_unique<StoreState>(io, opts_.store_limits)) {}

namespace {

// One agent's stream. Reactions run on gRPC threads; no lock is held across a Start* call
// because a reaction may run on another thread before the call returns.
class SessionReactor : public grpc::ServerBidiReactor<v1::AgentMsg, v1::ServerMsg> {
 public:
  SessionReactor(std::shared_ptr<Core> core, SessionId id)
      : core_(std::move(core)), id_(id), link_(std::make_shared<SessionLink>()) {
    link_->reactor = this;
    boost::asio::post(core_->io(),
                      [core = core_, id = id_, link = link_] { core->on_open(id, link); });
    StartRead(&in_);
  }

  // Called from the io thread through the link, under link->mu.
  void enqueue(v1::ServerMsg msg) {
    v1::ServerMsg* start = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
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
      std::lock_guard<std::mutex> lock(mu_);
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
    if (in_.has_join() && !core_->token().empty() && in_.join().token() != core_->token()) {
      post_closed();
      finish(grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                          "rendezvous refused the join: wrong or missing token"));
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
      std::lock_guard<std::mutex> lock(mu_);
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

  void OnDone() override {
    post_closed();
    {
      std::lock_guard<std::mutex> lock(link_->mu);
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
  std::mutex mu_;
  std::deque<v1::ServerMsg> queue_;  // guarded by mu_; front() is being written
  bool writing_ = false;             // guarded by mu_
  bool finishing_ = false;           // guarded by mu_
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
    if (!core_->token().empty() && request->token() != core_->token()) {
      reactor->Finish(grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                                   "rendezvous refused the status call: wrong or missing token"));
      return reactor;
    }
    // request and reply stay valid until Finish.
    boost::asio::post(core_->io(), [core = core_, request, reply, reactor] {
      for (auto& run : core->status(request->run_id())) *reply->add_runs() = std::move(run);
      reactor->Finish(grpc::Status::OK);
    });
    return reactor;
  }

 private:
  std::shared_ptr<Core> core_;
  std::atomic<SessionId> next_id_{1};
};

class StoreService final : public v1::Store::CallbackService {
 public:
  explicit StoreService(std::shared_ptr<Core> core) : core_(std::move(core)) {}
  grpc::ServerUnaryReactor* Call(grpc::CallbackServerContext* ctx, const v1::StoreRequest* req,
                                 v1::StoreReply* reply) override {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    if (!core_->token().empty() && req->token() != core_->token()) {
      reactor->Finish(grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                                   "store refused the call: wrong or missing token"));
      return reactor;
    }
    core_->store().call(req, reply, reactor);
    return reactor;
  }

 private:
  std::shared_ptr<Core> core_;
};

}  // namespace

void StoreState::answer_read(const KvTable& table, const v1::StoreRequest& req,
                             v1::StoreReply* reply) {
  if (req.op() == v1::StoreRequest::WAIT) return;
  for (const auto& k : req.keys()) reply->add_values(*table.find(k));
}

void StoreState::call(const v1::StoreRequest* req, v1::StoreReply* reply,
                      grpc::ServerUnaryReactor* reactor) {
  using R = v1::StoreRequest;
  const int nkeys = req->keys_size();
  const int nvalues = req->values_size();
  const bool one_key = nkeys == 1;
  bool shape_ok = true;
  switch (req->op()) {
    case R::SET: shape_ok = one_key && nvalues == 1; break;
    case R::GET: case R::ADD: case R::DELETE: shape_ok = one_key; break;
    case R::COMPARE_SET: shape_ok = one_key && nvalues == 2; break;
    case R::CHECK: case R::WAIT: case R::MULTI_GET: shape_ok = nkeys >= 1; break;
    case R::NUM_KEYS: break;
    case R::MULTI_SET: shape_ok = nkeys == nvalues; break;
    default: shape_ok = false;
  }
  if (!shape_ok || req->run_id().empty() || req->run_id().size() > kMaxIdLength) {
    reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "store: malformed request"));
    return;
  }
  absl::Status st;
  std::vector<std::shared_ptr<Waiter>> ready;
  {
    std::lock_guard<std::mutex> lock(mu_);
    KvTable& table = tables_.try_emplace(req->run_id(), limits_).first->second;
    for (const auto& k : req->keys()) {
      if (st.ok()) st = table.check_key(k);
    }
    bool wrote = false;
    if (st.ok()) {
      switch (req->op()) {
        case R::SET:
          st = table.set(req->keys(0), req->values(0));
          wrote = true;
          break;
        case R::ADD: {
          auto r = table.add(req->keys(0), req->delta());
          st = r.status();
          if (r.ok()) reply->set_number(*r);
          wrote = true;
          break;
        }
        case R::COMPARE_SET: {
          auto r = table.compare_set(req->keys(0), req->values(0), req->values(1));
          st = r.status();
          if (r.ok()) reply->add_values(*r);
          wrote = true;
          break;
        }
        case R::DELETE:
          reply->set_flag(table.erase(req->keys(0)));
          break;
        case R::CHECK:
          reply->set_flag(table.contains_all({req->keys().begin(), req->keys().end()}));
          break;
        case R::NUM_KEYS:
          reply->set_number(static_cast<std::int64_t>(table.size()));
          break;
        case R::MULTI_SET:
          for (int i = 0; i < nkeys && st.ok(); ++i) st = table.check_entry(req->keys(i), req->values(i));
          for (int i = 0; i < nkeys && st.ok(); ++i) st = table.set(req->keys(i), req->values(i));
          wrote = true;
          break;
        default: {  // GET, WAIT, MULTI_GET
          if (table.contains_all({req->keys().begin(), req->keys().end()})) {
            answer_read(table, *req, reply);
            break;
          }
          auto w = std::make_shared<Waiter>(req, reply, reactor, io_);
          waiters_[req->run_id()].push_back(w);
          const auto timeout = std::chrono::milliseconds(std::max<std::int64_t>(0, req->timeout_ms()));
          boost::asio::post(io_, [this, w, timeout] {
            w->timer.expires_after(timeout);
            w->timer.async_wait([this, w](const boost::system::error_code& ec) {
              if (ec) return;
              {
                std::lock_guard<std::mutex> lock(mu_);
                if (w->done) return;
                w->done = true;
                waiters_[w->req->run_id()].remove(w);
              }
              w->reactor->Finish(grpc::Status(
                  grpc::StatusCode::DEADLINE_EXCEEDED,
                  absl::StrCat("store: timed out after ", w->req->timeout_ms(),
                               " ms waiting for ", w->req->keys_size(), " key(s)")));
            });
          });
          return;  // answered later
        }
      }
    }
    if (wrote && st.ok()) collect_ready(req->run_id(), ready);
  }
  reactor->Finish(to_grpc(st));
  for (auto& w : ready) {
    w->reactor->Finish(grpc::Status::OK);
    boost::asio::post(io_, [w] { w->timer.cancel(); });
  }
}

void StoreState::collect_ready(const std::string& run, std::vector<std::shared_ptr<Waiter>>& ready) {
  auto wl = waiters_.find(run);
  if (wl == waiters_.end()) return;
  const KvTable& table = tables_.at(run);
  for (auto it = wl->second.begin(); it != wl->second.end();) {
    Waiter& w = **it;
    if (!table.contains_all({w.req->keys().begin(), w.req->keys().end()})) {
      ++it;
      continue;
    }
    answer_read(table, *w.req, w.reply);
    w.done = true;
    ready.push_back(*it);
    it = wl->second.erase(it);
  }
}

void Core::drop_finished_tables() {
  for (auto it = seen_runs_.begin(); it != seen_runs_.end();) {
    if (machine_.has_run(*it)) {
      ++it;
      continue;
    }
    store_->drop(*it);  // pending waiters keep their own timers and time out on their own
    it = seen_runs_.erase(it);
  }
}

void Core::on_message(SessionId id, const v1::AgentMsg& msg) {
  if (msg.has_join()) seen_runs_.insert(msg.join().run_id());
  apply(machine_.on_message(id, msg, Clock::now()));
}

void Core::on_closed(SessionId id) {
  links_.erase(id);
  apply(machine_.on_stream_closed(id, Clock::now()));
}

void Core::apply(std::vector<Outgoing> out) {
  for (Outgoing& o : out) {
    auto it = links_.find(o.session);
    if (it == links_.end()) continue;
    std::lock_guard<std::mutex> lock(it->second->mu);
    SessionReactor* r = it->second->reactor;
    if (r == nullptr) continue;
    if (o.msg) r->enqueue(std::move(*o.msg));
    if (o.close) r->finish(to_grpc(o.status));
  }
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
    if (ec || !core || core->armed_for_ != when) return;
    core->armed_for_.reset();
    core->apply(core->machine_.on_tick(Clock::now()));
    core->drop_finished_tables();
  });
}

class RendezvousServer::Impl {
 public:
  std::shared_ptr<Core> core;
  std::unique_ptr<Service> service;
  std::unique_ptr<StoreService> store_service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  bool stopped = false;
};

absl::StatusOr<std::unique_ptr<RendezvousServer>> RendezvousServer::start(
    boost::asio::io_context& io, ServerOptions options) {
  auto impl = std::make_unique<Impl>();
  std::string address = options.listen_address;
  int max_bytes = options.max_message_bytes;
  impl->core = std::make_shared<Core>(io, std::move(options));
  impl->service = std::make_unique<Service>(impl->core);
  impl->store_service = std::make_unique<StoreService>(impl->core);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &impl->port);
  builder.RegisterService(impl->service.get());
  builder.RegisterService(impl->store_service.get());
  builder.SetMaxReceiveMessageSize(max_bytes);
  // Exactly one server per port: a second agent on this host must fail to bind and connect.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Notice silent peers: ping idle connections (a dead agent's socket usually closes at once).
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  impl->server = builder.BuildAndStart();
  if (!impl->server || impl->port == 0) {
    return absl::UnavailableError(absl::StrCat("rendezvous server cannot listen on ", address));
  }
  return std::unique_ptr<RendezvousServer>(new RendezvousServer(std::move(impl)));
}

RendezvousServer::RendezvousServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RendezvousServer::~RendezvousServer() { shutdown(); }

int RendezvousServer::port() const { return impl_->port; }

void RendezvousServer::shutdown(std::chrono::milliseconds grace) {
  if (impl_->stopped) return;
  impl_->stopped = true;
  impl_->server->Shutdown(std::chrono::system_clock::now() + grace);
  impl_->server->Wait();
}

void route_grpc_logs_to_spdlog() {
  gpr_set_log_function([](gpr_log_func_args* args) { spdlog::debug("grpc: {}", args->message); });
}

}  // namespace muster::rendezvous
