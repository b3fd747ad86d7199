#include "store_server.h"

#include <list>
#include <mutex>
#include <thread>
#include <unordered_map>

#include <grpcpp/alarm.h>

#include "absl/strings/str_cat.h"
#include "muster/rendezvous/kv_table.h"
#include "muster/rendezvous/state_machine.h"
#include "muster/v1/rendezvous.grpc.pb.h"

namespace muster::rendezvous {
namespace {

grpc::Status to_grpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

// Something that comes back out of the completion queue.
struct Tag {
  virtual ~Tag() = default;
  virtual void proceed(bool ok) = 0;
};

}  // namespace

class StoreServer::Impl {
 public:
  Impl(StoreLimits limits, std::string token) : limits_(limits), token_(std::move(token)) {}

  // One client stream: read a request, serve it, write the reply, read the next.
  class CallData final : public Tag {
   public:
    explicit CallData(Impl* impl) : impl_(impl), stream_(&ctx_) {
      impl_->service_.RequestStream(&ctx_, &stream_, impl_->cq_.get(), impl_->cq_.get(), this);
    }
    void proceed(bool ok) override {
      switch (state_) {
        case State::kConnect:
          if (!ok) break;  // shutting down
          new CallData(impl_);  // accept the next stream
          read();
          return;
        case State::kRead:
          if (!ok) {  // the client closed its side
            state_ = State::kFinish;
            stream_.Finish(grpc::Status::OK, this);
            return;
          }
          reply_.Clear();
          impl_->serve(this);
          return;
        case State::kWrite:
          if (ok) {
            read();
          } else {
            state_ = State::kFinish;
            stream_.Finish(grpc::Status::OK, this);
          }
          return;
        case State::kFinish:
          break;
      }
      delete this;
    }
    // Sends the reply to the current request.
    void finish(const grpc::Status& status) {
      reply_.set_code(status.error_code());
      if (!status.ok()) reply_.set_error(status.error_message());
      state_ = State::kWrite;
      stream_.Write(reply_, this);
    }
    const v1::StoreRequest& req() const { return req_; }
    v1::StoreReply& reply() { return reply_; }

   private:
    enum class State { kConnect, kRead, kWrite, kFinish };
    void read() {
      state_ = State::kRead;
      stream_.Read(&req_, this);
    }
    Impl* impl_;
    grpc::ServerContext ctx_;
    grpc::ServerAsyncReaderWriter<v1::StoreReply, v1::StoreRequest> stream_;
    v1::StoreRequest req_;
    v1::StoreReply reply_;
    State state_ = State::kConnect;
  };

  // A call waiting for keys; its alarm fires at the timeout or when cancelled.
  struct Waiter final : Tag {
    CallData* call;
    grpc::Alarm alarm;
    bool answered = false;
    std::list<Waiter*>* list = nullptr;
    std::list<Waiter*>::iterator pos;
    void proceed(bool ok) override {
      if (!answered) {  // the timeout passed first
        list->erase(pos);
        call->finish(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                                  absl::StrCat("store: timed out after ", call->req().timeout_ms(),
                                               " ms waiting for ", call->req().keys_size(),
                                               " key(s)")));
      }
      delete this;
    }
  };

  void serve(CallData* call);
  void wake(const std::string& run, KvTable& table);
  static void answer_read(const KvTable& table, const v1::StoreRequest& req, v1::StoreReply& r) {
    if (req.op() == v1::StoreRequest::WAIT) return;
    for (const auto& k : req.keys()) r.add_values(*table.find(k));
  }

  StoreLimits limits_;
  std::string token_;
  v1::Store::AsyncService service_;
  std::unique_ptr<grpc::ServerCompletionQueue> cq_;
  std::thread thread_;
  std::mutex mu_;  // tables_ and waiters_: the queue's thread, and drop() from the io thread
  std::unordered_map<std::string, KvTable> tables_;
  std::unordered_map<std::string, std::list<Waiter*>> waiters_;
};

void StoreServer::Impl::serve(CallData* call) {
  using R = v1::StoreRequest;
  const v1::StoreRequest& req = call->req();
  v1::StoreReply& reply = call->reply();
  if (!token_.empty() && req.token() != token_) {
    call->finish(grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
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
    call->finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "store: malformed request"));
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  KvTable& table = tables_.try_emplace(req.run_id(), limits_).first->second;
  absl::Status st;
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
        auto r = table.add(req.keys(0), req.delta());
        st = r.status();
        if (r.ok()) reply.set_number(*r);
        wrote = true;
        break;
      }
      case R::COMPARE_SET: {
        auto r = table.compare_set(req.keys(0), req.values(0), req.values(1));
        st = r.status();
        if (r.ok()) reply.add_values(*r);
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
        auto* w = new Waiter;
        w->call = call;
        w->list = &waiters_[req.run_id()];
        w->pos = w->list->insert(w->list->end(), w);
        w->alarm.Set(cq_.get(),
                     std::chrono::system_clock::now() +
                         std::chrono::milliseconds(std::max<std::int64_t>(0, req.timeout_ms())),
                     w);
        return;  // answered by a write or by the alarm
      }
    }
  }
  call->finish(to_grpc(st));
  if (wrote && st.ok()) wake(req.run_id(), table);
}

void StoreServer::Impl::wake(const std::string& run, KvTable& table) {
  auto wl = waiters_.find(run);
  if (wl == waiters_.end()) return;
  for (auto it = wl->second.begin(); it != wl->second.end();) {
    Waiter* w = *it;
    const auto& keys = w->call->req().keys();
    if (!table.contains_all({keys.begin(), keys.end()})) {
      ++it;
      continue;
    }
    answer_read(table, w->call->req(), w->call->reply());
    w->answered = true;
    w->call->finish(grpc::Status::OK);
    it = wl->second.erase(it);
    w->alarm.Cancel();  // its event comes back with ok=false and frees it
  }
}

StoreServer::StoreServer(StoreLimits limits, std::string token)
    : impl_(std::make_unique<Impl>(limits, std::move(token))) {}

StoreServer::~StoreServer() { shutdown(); }

void StoreServer::register_with(grpc::ServerBuilder& builder) {
  builder.RegisterService(&impl_->service_);
  impl_->cq_ = builder.AddCompletionQueue();
}

void StoreServer::start() {
  new Impl::CallData(impl_.get());
  impl_->thread_ = std::thread([impl = impl_.get()] {
    void* tag = nullptr;
    bool ok = false;
    while (impl->cq_->Next(&tag, &ok)) static_cast<Tag*>(tag)->proceed(ok);
  });
}

void StoreServer::drop(const std::string& run_id) {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  impl_->tables_.erase(run_id);  // waiters stay parked until their alarm
}

void StoreServer::shutdown() {
  if (!impl_->cq_) return;
  impl_->cq_->Shutdown();
  if (impl_->thread_.joinable()) {
    impl_->thread_.join();
  } else {  // never started: drain here
    void* tag = nullptr;
    bool ok = false;
    while (impl_->cq_->Next(&tag, &ok)) static_cast<Tag*>(tag)->proceed(ok);
  }
  impl_->cq_.reset();
}

}  // namespace muster::rendezvous
