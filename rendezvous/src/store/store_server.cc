#include "store/store_server.h"

#include <atomic>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "muster/rendezvous/limits.h"
#include "muster/v1/rendezvous.grpc.pb.h"
#include "client/status_convert.h"
#include "store/store_core.h"

namespace muster::rendezvous {

class StoreServer::Impl final : public v1::Store::CallbackService {
 public:
  Impl(StoreLimits limits, std::shared_ptr<const Credentials> credentials, bool require_open_runs)
      : core_(StoreCore::Options{limits, std::move(credentials), require_open_runs}) {
    core_.set_on_earlier_deadline([this] { poke_timer(); });
    timer_ = std::thread([this] { timer_loop(); });
  }
  ~Impl() override {
    {
      absl::MutexLock lock(&timer_mu_);
      stop_ = true;
      ++generation_;
    }
    timer_cv_.Signal();
    timer_.join();
  }

  class Reactor;
  // A parked request's handle, pointing back at its stream.
  struct Wait final : StoreWait {
    Wait(Reactor* r, const v1::StoreRequest* req, v1::StoreReply* rep)
        : StoreWait(req, rep), reactor(r) {}
    Reactor* const reactor;
  };

  // One client stream: read a request, serve it, write the reply, read the next. Reactions
  // run on gRPC's threads; a request is served on the thread that read it. A parked wait
  // keeps the reactor alive: no read is pending then, so only its answer (which some other
  // thread delivers, exactly once: see store_core.h) or OnCancel can move it on.
  class Reactor final : public grpc::ServerBidiReactor<v1::StoreRequest, v1::StoreReply> {
   public:
    explicit Reactor(Impl* impl) : impl_(impl) { StartRead(&req_); }
    void OnReadDone(bool ok) override {
      if (!ok) {
        Finish(grpc::Status::OK);
        return;
      }
      reply_.Clear();
      large_ = req_.ByteSizeLong() >= limits::kStoreReplyBudgetFrom;
      // A fresh wait per request: a StoreWait parks at most once. Published before the core
      // can park it, so that OnCancel always finds the wait it must take out.
      auto w = std::make_shared<Wait>(this, &req_, &reply_);
      {
        absl::MutexLock lock(&mu_);
        wait_ = w;
      }
      std::vector<StoreWaitPtr> woken;
      std::optional<absl::Status> st = impl_->core_.handle(w, StoreClock::now(), woken);
      if (st) respond(*st);
      Impl::deliver(woken);
      if (!st) {
        // Parked. A cancel that came before the wait was parked found nothing to take out.
        bool cancelled = false;
        {
          absl::MutexLock lock(&mu_);
          cancelled = cancelled_;
        }
        if (cancelled) cancel_parked(*w);
      }
    }
    void OnWriteDone(bool ok) override {
      impl_->release_reply(reserved_);
      reserved_ = 0;
      if (large_) {
        // Protobuf keeps a cleared field's capacity: an idle stream must not hold on to the
        // megabytes of its last request or reply.
        v1::StoreRequest().Swap(&req_);
        v1::StoreReply().Swap(&reply_);
        large_ = false;
      }
      if (!ok) {
        Finish(grpc::Status::OK);
      } else if (impl_->core_.shutting_down()) {
        Finish(to_grpc(StoreCore::unavailable()));  // no more requests: let Shutdown end
      } else {
        StartRead(&req_);
      }
    }
    // The client went or the server is shutting down. Only a parked wait needs us: a pending
    // read or write fails on its own.
    void OnCancel() override {
      std::shared_ptr<Wait> w;
      {
        absl::MutexLock lock(&mu_);
        cancelled_ = true;
        w = wait_;
      }
      if (w) cancel_parked(*w);
    }
    void OnDone() override { delete this; }

    // Answers the current request (exactly once per request).
    void respond(const absl::Status& status) {
      reply_.set_code(static_cast<int>(status.code()));
      if (!status.ok()) reply_.set_error(std::string(status.message()));
      // A reply stays in memory until its client reads it: large ones come out of a
      // server-wide budget, so clients that ask and never read cannot hold unbounded memory.
      const std::size_t size = reply_.ByteSizeLong();
      if (size >= limits::kStoreReplyBudgetFrom) {
        large_ = true;
        if (impl_->reserve_reply(size)) {
          reserved_ = size;
        } else {
          v1::StoreReply().Swap(&reply_);  // frees the value (Clear would keep its capacity)
          reply_.set_code(static_cast<int>(absl::StatusCode::kResourceExhausted));
          reply_.set_error(absl::StrCat("store: the server already holds ",
                                        limits::kMaxStoreUnreadReplyBytes >> 20,
                                        " MiB of replies its clients have not read; retry later"));
        }
      }
      StartWrite(&reply_);
    }

   private:
    void cancel_parked(Wait& w) {
      if (impl_->core_.cancel(w, absl::CancelledError("store: the call was cancelled"))) {
        Finish(grpc::Status(grpc::StatusCode::CANCELLED, "store: the call was cancelled"));
      }
    }

    Impl* impl_;
    v1::StoreRequest req_;
    v1::StoreReply reply_;
    std::size_t reserved_ = 0;  // of the reply budget, for the reply being written
    bool large_ = false;        // this request or its reply is large: free both once done
    absl::Mutex mu_;
    std::shared_ptr<Wait> wait_ ABSL_GUARDED_BY(mu_);  // the latest request's
    bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  };

  grpc::ServerBidiReactor<v1::StoreRequest, v1::StoreReply>* Stream(
      grpc::CallbackServerContext*) override {
    return new Reactor(this);
  }

  // Answers waits that have left the core. No lock is held here (Start* must not run under one).
  static void deliver(const std::vector<StoreWaitPtr>& waits) {
    for (const StoreWaitPtr& w : waits) static_cast<Wait&>(*w).reactor->respond(w->status);
  }

  StoreCore core_;

  bool reserve_reply(std::size_t bytes) {
    std::size_t held = unread_bytes_.load(std::memory_order_relaxed);
    do {
      if (held + bytes > limits::kMaxStoreUnreadReplyBytes) return false;
    } while (!unread_bytes_.compare_exchange_weak(held, held + bytes, std::memory_order_relaxed));
    return true;
  }
  void release_reply(std::size_t bytes) {
    if (bytes > 0) unread_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
  }

 private:
  std::atomic<std::size_t> unread_bytes_{0};  // large replies written but not yet read
  void poke_timer() {
    {
      absl::MutexLock lock(&timer_mu_);
      ++generation_;
    }
    timer_cv_.Signal();
  }

  // Sleeps until the earliest parked deadline (or a new, earlier one) and answers the waits
  // that are due. The core's locks are never taken under timer_mu_ (poke_timer runs under
  // them).
  void timer_loop() {
    for (;;) {
      std::uint64_t seen = 0;
      {
        absl::MutexLock lock(&timer_mu_);
        if (stop_) return;
        seen = generation_;
      }
      const std::optional<StoreClock::time_point> next = core_.next_deadline();
      {
        absl::MutexLock lock(&timer_mu_);
        if (stop_) return;
        if (generation_ == seen) {
          if (!next) {
            timer_cv_.Wait(&timer_mu_);
          } else {
            const auto left = *next - StoreClock::now();
            if (left > StoreClock::duration::zero()) {
              timer_cv_.WaitWithTimeout(&timer_mu_, absl::FromChrono(left));
            }
          }
        }
        if (stop_) return;
      }
      deliver(core_.expire(StoreClock::now()));
    }
  }

  absl::Mutex timer_mu_;
  absl::CondVar timer_cv_;
  bool stop_ ABSL_GUARDED_BY(timer_mu_) = false;
  std::uint64_t generation_ ABSL_GUARDED_BY(timer_mu_) = 0;
  std::thread timer_;
};

StoreServer::StoreServer(StoreLimits limits, std::shared_ptr<const Credentials> credentials,
                         bool require_open_runs)
    : impl_(std::make_unique<Impl>(limits, std::move(credentials), require_open_runs)) {}

StoreServer::~StoreServer() = default;

void StoreServer::register_with(grpc::ServerBuilder& builder) { builder.RegisterService(impl_.get()); }

void StoreServer::open_run(const std::string& run_id) { impl_->core_.open_run(run_id); }

void StoreServer::drop(const std::string& run_id) { Impl::deliver(impl_->core_.drop(run_id)); }

void StoreServer::shutdown() { Impl::deliver(impl_->core_.shutdown()); }

std::size_t StoreServer::parked_waits() const { return impl_->core_.parked_waits(); }

std::array<std::uint64_t, StoreServer::kNumOps> StoreServer::op_counts() const {
  std::array<std::uint64_t, kNumOps> out{};
  for (int op = 0; op < kNumOps; ++op) out[op] = impl_->core_.op_count(op);
  return out;
}

}  // namespace muster::rendezvous
