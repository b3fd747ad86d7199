#include "store_server.h"

#include <list>
#include <unordered_map>

#include <grpcpp/alarm.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "muster/rendezvous/kv_table.h"
#include "muster/rendezvous/state_machine.h"
#include "muster/v1/rendezvous.grpc.pb.h"
#include "status_convert.h"

namespace muster::rendezvous {

class StoreServer::Impl final : public v1::Store::CallbackService {
 public:
  Impl(StoreLimits limits, std::string token, bool require_open_runs)
      : limits_(limits), token_(std::move(token)), require_open_runs_(require_open_runs) {}

  // One client stream: read a request, serve it, write the reply, read the next. Reactions
  // run on gRPC's threads; a request is served on the thread that read it. A parked wait
  // keeps the reactor alive: no read is pending then, so it cannot finish before the reply.
  class Reactor final : public grpc::ServerBidiReactor<v1::StoreRequest, v1::StoreReply> {
   public:
    explicit Reactor(Impl* impl) : impl_(impl) { StartRead(&req_); }
    void OnReadDone(bool ok) override {
      if (!ok) {
        Finish(grpc::Status::OK);
        return;
      }
      reply_.Clear();
      impl_->serve(this);
    }
    void OnWriteDone(bool ok) override {
      if (ok) {
        StartRead(&req_);
      } else {
        Finish(grpc::Status::OK);
      }
    }
    void OnDone() override { delete this; }
    void respond(const grpc::Status& status) {
      reply_.set_code(status.error_code());
      if (!status.ok()) reply_.set_error(status.error_message());
      StartWrite(&reply_);
    }
    const v1::StoreRequest& req() const { return req_; }
    v1::StoreReply& reply() { return reply_; }

   private:
    Impl* impl_;
    v1::StoreRequest req_;
    v1::StoreReply reply_;
  };

  grpc::ServerBidiReactor<v1::StoreRequest, v1::StoreReply>* Stream(
      grpc::CallbackServerContext*) override {
    return new Reactor(this);
  }

  void open_run(const std::string& run) {
    absl::MutexLock lock(&mu_);
    tables_.try_emplace(run, limits_);
  }
  void drop(const std::string& run) {
    absl::MutexLock lock(&mu_);
    tables_.erase(run);  // parked waits stay until their alarm
  }
  void shutdown() {
    std::vector<Reactor*> ready;
    {
      absl::MutexLock lock(&mu_);
      shutting_down_ = true;
      for (auto& [run, list] : waiters_) {
        for (Waiter* w : list) {
          w->answered = true;
          ready.push_back(w->reactor);
          w->alarm.Cancel();
        }
        list.clear();
      }
    }
    for (Reactor* r : ready) r->respond(unavailable());
  }
  std::size_t parked_waits() const {
    absl::MutexLock lock(&mu_);
    std::size_t n = 0;
    for (auto& [run, list] : waiters_) n += list.size();
    return n;
  }
  static grpc::Status unavailable() {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "store: the server is shutting down");
  }

 private:
  // A request waiting for keys; its alarm calls back once: at the timeout, or cancelled.
  struct Waiter {
    explicit Waiter(Reactor* r) : reactor(r) {}
    Reactor* reactor;
    grpc::Alarm alarm;
    bool answered = false;  // guarded by the Impl's mu_
    std::list<Waiter*>::iterator pos;
  };

  void serve(Reactor* r);
  // Answers the waiters of `run` whose keys now all exist.
  void collect_ready(const std::string& run, const KvTable& table, std::vector<Reactor*>& ready)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void answer_read(const KvTable& table, const v1::StoreRequest& req, v1::StoreReply& out) {
    if (req.op() == v1::StoreRequest::WAIT) return;
    for (const auto& k : req.keys()) out.add_values(*table.find(k));
  }

  const StoreLimits limits_;
  const std::string token_;
  const bool require_open_runs_;
  mutable absl::Mutex mu_;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  std::unordered_map<std::string, KvTable> tables_ ABSL_GUARDED_BY(mu_);
  std::unordered_map<std::string, std::list<Waiter*>> waiters_ ABSL_GUARDED_BY(mu_);
};

void StoreServer::Impl::serve(Reactor* r) {
  using R = v1::StoreRequest;
  const v1::StoreRequest& req = r->req();
  v1::StoreReply& reply = r->reply();
  if (!token_.empty() && req.token() != token_) {
    r->respond(grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                            "store refused the call: wrong or missing token"));
    return;
  }
  const int nkeys = req.keys_size();
  const int nvalues = req.values_size();
  bool shape_ok = true;
  switch (req.op()) {
    case R::SET: shape_ok = nkeys == 1 && nvalues == 1; break;
    case R::GET: case R::ADD: case R::DELETE: shape_ok = nkeys == 1; break;
    case R::COMPARE_SET: shape_ok = nkeys == 1 && nvalues == 2; break;
    case R::CHECK: case R::WAIT: case R::MULTI_GET: shape_ok = nkeys >= 1; break;
    case R::NUM_KEYS: break;
    case R::MULTI_SET: shape_ok = nkeys == nvalues; break;
    default: shape_ok = false;
  }
  if (!shape_ok || req.run_id().empty() || req.run_id().size() > kMaxIdLength) {
    r->respond(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "store: malformed request"));
    return;
  }
  absl::Status st;
  std::vector<Reactor*> ready;
  {
    absl::ReleasableMutexLock lock(&mu_);
    if (shutting_down_) {
      st = absl::UnavailableError("store: the server is shutting down");
    } else if (require_open_runs_ && tables_.count(req.run_id()) == 0) {
      st = absl::FailedPreconditionError(absl::StrCat("store: unknown run '", req.run_id(), "'"));
    }
    if (!st.ok()) {
      lock.Release();  // never hold the lock across StartWrite
      r->respond(to_grpc(st));
      return;
    }
    KvTable& table = tables_.try_emplace(req.run_id(), limits_).first->second;
    for (const auto& k : req.keys()) {
      if (st.ok()) st = table.check_key(k);
    }
    bool wrote = false;
    if (st.ok()) {
      switch (req.op()) {
        case R::SET:
          st = table.set(req.keys(0), req.values(0));
          wrote = true;
          break;
        case R::ADD: {
          auto v = table.add(req.keys(0), req.delta());
          st = v.status();
          if (v.ok()) reply.set_number(*v);
          wrote = true;
          break;
        }
        case R::COMPARE_SET: {
          auto v = table.compare_set(req.keys(0), req.values(0), req.values(1));
          st = v.status();
          if (v.ok()) reply.add_values(*v);
          wrote = true;
          break;
        }
        case R::DELETE:
          reply.set_flag(table.erase(req.keys(0)));
          break;
        case R::CHECK:
          reply.set_flag(table.contains_all({req.keys().begin(), req.keys().end()}));
          break;
        case R::NUM_KEYS:
          reply.set_number(static_cast<std::int64_t>(table.size()));
          break;
        case R::MULTI_SET:
          for (int i = 0; i < nkeys && st.ok(); ++i) st = table.check_entry(req.keys(i), req.values(i));
          for (int i = 0; i < nkeys && st.ok(); ++i) st = table.set(req.keys(i), req.values(i));
          wrote = true;
          break;
        default: {  // GET, WAIT, MULTI_GET
          if (table.contains_all({req.keys().begin(), req.keys().end()})) {
            answer_read(table, req, reply);
            break;
          }
          auto* w = new Waiter(r);
          std::list<Waiter*>& list = waiters_[req.run_id()];
          w->pos = list.insert(list.end(), w);
          const std::string run = req.run_id();
          const std::int64_t timeout_ms = std::max<std::int64_t>(0, req.timeout_ms());
          const int keys = nkeys;
          w->alarm.Set(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms),
                       [this, w, run, timeout_ms, keys](bool) {
                         bool timed_out = false;
                         {
                           absl::MutexLock lock(&mu_);
                           if (!w->answered) {
                             timed_out = true;
                             waiters_[run].erase(w->pos);
                           }
                         }
                         if (timed_out) {
                           w->reactor->respond(grpc::Status(
                               grpc::StatusCode::DEADLINE_EXCEEDED,
                               absl::StrCat("store: timed out after ", timeout_ms,
                                            " ms waiting for ", keys, " key(s)")));
                         }
                         delete w;  // the alarm has called back: nothing refers to it now
                       });
          return;  // answered by a write, or by the alarm
        }
      }
    }
    if (wrote && st.ok()) collect_ready(req.run_id(), table, ready);
  }
  r->respond(to_grpc(st));
  for (Reactor* w : ready) w->respond(grpc::Status::OK);
}

void StoreServer::Impl::collect_ready(const std::string& run, const KvTable& table,
                                      std::vector<Reactor*>& ready) {
  auto wl = waiters_.find(run);
  if (wl == waiters_.end()) return;
  for (auto it = wl->second.begin(); it != wl->second.end();) {
    Waiter* w = *it;
    const auto& keys = w->reactor->req().keys();
    if (!table.contains_all({keys.begin(), keys.end()})) {
      ++it;
      continue;
    }
    answer_read(table, w->reactor->req(), w->reactor->reply());
    w->answered = true;
    ready.push_back(w->reactor);
    it = wl->second.erase(it);
    w->alarm.Cancel();  // calls back with ok=false and frees the waiter
  }
}

StoreServer::StoreServer(StoreLimits limits, std::string token, bool require_open_runs)
    : impl_(std::make_unique<Impl>(limits, std::move(token), require_open_runs)) {}

StoreServer::~StoreServer() = default;

void StoreServer::register_with(grpc::ServerBuilder& builder) { builder.RegisterService(impl_.get()); }

void StoreServer::drop(const std::string& run_id) { impl_->drop(run_id); }

void StoreServer::open_run(const std::string& run_id) { impl_->open_run(run_id); }

void StoreServer::shutdown() { impl_->shutdown(); }

std::size_t StoreServer::parked_waits() const { return impl_->parked_waits(); }

}  // namespace muster::rendezvous
