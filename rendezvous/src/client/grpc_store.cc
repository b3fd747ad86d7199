#include "muster/rendezvous/grpc_store.h"
#include "muster/rendezvous/limits.h"


#include <atomic>
#include <cstdio>
#include <map>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "muster/v1/rendezvous.grpc.pb.h"

namespace muster::rendezvous {

using Op = v1::StoreRequest::Op;

// Cancels the stream of a call that has not been answered by its deadline: a server that is
// alive but does not answer would otherwise block the caller for good (a dead one fails the
// stream by itself). One thread, started by the first call, asleep until the next deadline.
class Watchdog {
 public:
  ~Watchdog() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
      cv_.Signal();
    }
    if (thread_.joinable()) thread_.join();
  }

  std::uint64_t arm(grpc::ClientContext* ctx, std::atomic<bool>* fired, absl::Duration after) {
    absl::MutexLock lock(&mu_);
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
    const std::uint64_t id = ++last_;
    const absl::Time deadline = absl::Now() + after;
    watches_[id] = Watch{deadline, ctx, fired};
    if (deadline < wake_) cv_.Signal();  // only when it must wake earlier (no switch per call)
    return id;
  }
  void disarm(std::uint64_t id) {
    absl::MutexLock lock(&mu_);
    watches_.erase(id);
  }

 private:
  struct Watch {
    absl::Time deadline;
    grpc::ClientContext* ctx;
    std::atomic<bool>* fired;
  };
  void run() {
    absl::MutexLock lock(&mu_);
    while (!stop_) {
      absl::Time next = absl::InfiniteFuture();
      const absl::Time now = absl::Now();
      for (auto it = watches_.begin(); it != watches_.end();) {
        if (it->second.deadline <= now) {
          it->second.fired->store(true);
          it->second.ctx->TryCancel();  // the caller's Read or Write returns false
          it = watches_.erase(it);
        } else {
          next = std::min(next, it->second.deadline);
          ++it;
        }
      }
      wake_ = next;
      cv_.WaitWithDeadline(&mu_, next);
      wake_ = absl::InfinitePast();  // awake: arm() need not signal
    }
  }

  absl::Mutex mu_;
  absl::CondVar cv_;
  std::map<std::uint64_t, Watch> watches_ ABSL_GUARDED_BY(mu_);
  std::uint64_t last_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time wake_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();  // when the thread will wake
  std::thread thread_;
};

class GrpcStore::Impl {
 public:
  explicit Impl(GrpcStoreOptions o) : opts(std::move(o)) {
    grpc::ChannelArguments args;
    // The server's bound on a store message, both ways (limits.h): client and server agree.
    args.SetMaxReceiveMessageSize(static_cast<int>(limits::kMaxStoreMessageBytes));
    args.SetMaxSendMessageSize(static_cast<int>(limits::kMaxStoreMessageBytes));
    // No transport keep-alive: a store call is bounded by its own timeout, and whether this
    // worker's node is still in its run is the agent's liveness rule to decide (it stops
    // the workers when it is out); a fixed rule here would end a stream within a blip the
    // run's rule tolerates.
    args.SetString(GRPC_ARG_OPTIMIZATION_TARGET, "latency");
    args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
    args.SetInt(GRPC_ARG_MINIMAL_STACK, 1);  // no per-call deadlines or census on these streams
    add_tls_channel_args(opts.tls, args);
    // A server that went away and came back (rdzvd restarted with --state_dir) is reached by
    // the first call after it is up again, within about a second: the channel retries at
    // least once a second, not on gRPC's default backoff of up to two minutes, during which
    // every call would fail with UNAVAILABLE.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    for (absl::string_view t : absl::StrSplit(opts.target, ';', absl::SkipEmpty())) {
      targets.emplace_back(t);
      stubs.push_back(v1::Store::NewStub(
          grpc::CreateCustomChannel(targets.back(), channel_credentials(opts.tls), args)));
    }
    if (stubs.empty()) {
      targets.push_back(opts.target);
      stubs.push_back(v1::Store::NewStub(
          grpc::CreateCustomChannel(opts.target, channel_credentials(opts.tls), args)));
    }
  }

  // An open stream. Requests on one stream are served in order, so a set may be written
  // behind: its reply ("ack") is read later, before the reply of the next request sent on it.
  struct Stream {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReaderWriter<v1::StoreRequest, v1::StoreReply>> rw;
    bool answered_once = false;    // the first request on a stream is never written behind
    bool finished = false;
    std::uint64_t watch = 0;       // the watchdog's entry for the call using it, if any
    std::atomic<bool> timed_out{false};
    std::vector<std::string> owed;  // keys of sets whose acks are still to be read
    std::size_t target = 0;         // which of `targets` it was opened to
  };

  absl::StatusOr<v1::StoreReply> call(Op op, std::vector<std::string> keys,
                                      std::vector<std::string> values = {},
                                      std::int64_t delta = 0,
                                      std::chrono::milliseconds wait = {}) {
    v1::StoreRequest req;
    req.set_run_id(opts.run_id);
    req.set_token(opts.token);
    req.set_op(op);
    for (auto& k : keys) req.add_keys(std::move(k));
    for (auto& v : values) req.add_values(std::move(v));
    req.set_delta(delta);
    req.set_timeout_ms(wait.count());
    std::unique_ptr<Stream> s = acquire();
    s->watch = watchdog.arm(&s->ctx, &s->timed_out, absl::FromChrono(opts.timeout + wait));
    const bool is_read = op == v1::StoreRequest::GET || op == v1::StoreRequest::WAIT ||
                         op == v1::StoreRequest::CHECK || op == v1::StoreRequest::MULTI_GET ||
                         op == v1::StoreRequest::NUM_KEYS;
    // A write must not be carried out behind a refused set: settle the acks before sending it.
    if (!is_read && op != v1::StoreRequest::SET) {
      if (absl::Status st = settle(*s); !st.ok()) {
        if (s->finished) return drop(std::move(s), st);  // the stream broke
        release(std::move(s));  // in step: every ack has been read
        return st;
      }
    }
    if (!s->rw->Write(req)) return drop(std::move(s), lost(*s));
    if (op == v1::StoreRequest::SET && s->answered_once && s->owed.size() < kMaxOwed) {
      s->owed.push_back(req.keys(0));
      release(std::move(s));
      return v1::StoreReply();
    }
    // A read sent behind sets: their acks come first. A refused set fails this call; the
    // read's answer is discarded (reads change nothing). One that may wait for keys is not
    // waited for: its stream is dropped.
    if (absl::Status st = settle(*s); !st.ok()) {
      const bool may_wait = (op == v1::StoreRequest::GET || op == v1::StoreRequest::WAIT ||
                             op == v1::StoreRequest::MULTI_GET) && wait.count() > 0;
      v1::StoreReply discarded;
      if (s->finished || may_wait || !s->rw->Read(&discarded)) return drop(std::move(s), st);
      release(std::move(s));
      return st;
    }
    v1::StoreReply reply;
    if (!s->rw->Read(&reply)) return drop(std::move(s), lost(*s));
    s->answered_once = true;
    release(std::move(s));
    if (reply.code() != 0) {
      return absl::Status(static_cast<absl::StatusCode>(reply.code()), reply.error());
    }
    return reply;
  }

  // Reads the acks owed on `s`; the first refusal is returned, naming its key.
  absl::Status settle(Stream& s) {
    absl::Status first;
    for (const std::string& key : s.owed) {
      v1::StoreReply ack;
      if (!s.rw->Read(&ack)) return lost(s);
      if (ack.code() != 0 && first.ok()) {
        first = absl::Status(static_cast<absl::StatusCode>(ack.code()),
                             absl::StrCat("store: the earlier set of \"", key,
                                          "\" was refused: ", ack.error()));
      }
    }
    s.owed.clear();
    absl::MutexLock lock(&mu);
    if (behind == &s) behind = nullptr;  // the server has applied every set written behind
    return first;
  }

  absl::Status lost(Stream& s) {
    s.ctx.TryCancel();
    grpc::Status st = s.rw->Finish();
    s.finished = true;
    if (s.timed_out) {
      return absl::DeadlineExceededError(absl::StrCat(
          "store: no answer from ", targets[s.target], " within ", opts.timeout.count(),
          " ms (beyond the call's own wait)"));
    }
    // Replicas (several targets): the server this stream had is gone, so later streams go to
    // the next one (the replica that takes over), round the list.
    std::size_t expected = s.target;
    at.compare_exchange_strong(expected, (s.target + 1) % stubs.size());
    return absl::UnavailableError(absl::StrCat(
        "store: lost the connection to ", targets[s.target],
        st.ok() ? std::string() : absl::StrCat(": ", st.error_message())));
  }

  // Abandons a stream whose replies are out of step (or broken), returning `st`.
  absl::Status drop(std::unique_ptr<Stream> s, absl::Status st) {
    watchdog.disarm(s->watch);
    if (!s->finished) {
      s->ctx.TryCancel();
      s->rw->Finish();
    }
    absl::MutexLock lock(&mu);
    if (behind == s.get()) behind = nullptr;
    return st;
  }

  // A free stream. While a stream has sets written behind, every call goes on that stream
  // (waiting for it if another thread has it), so no request can overtake them; a new stream
  // is opened only when none is behind and all are busy (e.g. one thread waits on a key that
  // another is about to set).
  std::unique_ptr<Stream> acquire() {
    absl::MutexLock lock(&mu);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
      if (behind == nullptr) return true;
      for (auto& f : free) if (f.get() == behind) return true;
      return false;
    };
    mu.Await(absl::Condition(&ready));
    for (auto it = free.begin(); it != free.end(); ++it) {
      if (behind == nullptr || it->get() == behind) {
        auto s = std::move(*it);
        free.erase(it);
        return s;
      }
    }
    auto s = std::make_unique<Stream>();
    s->target = at.load();
    s->rw = stubs[s->target]->Stream(&s->ctx);
    return s;
  }

  void release(std::unique_ptr<Stream> s) {
    watchdog.disarm(s->watch);
    absl::MutexLock lock(&mu);
    if (!s->owed.empty()) behind = s.get();
    free.push_back(std::move(s));
  }

  ~Impl() {
    absl::MutexLock lock(&mu);
    for (auto& s : free) {
      s->watch = watchdog.arm(&s->ctx, &s->timed_out, absl::FromChrono(opts.timeout));
      if (!s->owed.empty()) {
        mu.Unlock();
        absl::Status st = settle(*s);
        mu.Lock();
        // Nobody is left to return it to: say it once on stderr rather than lose it.
        if (!st.ok()) std::fprintf(stderr, "muster: %s\n", std::string(st.message()).c_str());
      }
      if (!s->finished) {
        s->rw->WritesDone();
        s->rw->Finish();
      }
      watchdog.disarm(s->watch);
    }
  }

  static constexpr std::size_t kMaxOwed = 64;
  GrpcStoreOptions opts;
  Watchdog watchdog;  // before the streams: destroyed after them
  std::vector<std::string> targets;  // opts.target's list, in order
  std::vector<std::unique_ptr<v1::Store::Stub>> stubs;
  std::atomic<std::size_t> at{0};    // where new streams go
  absl::Mutex mu;
  std::vector<std::unique_ptr<Stream>> free ABSL_GUARDED_BY(mu);
  Stream* behind ABSL_GUARDED_BY(mu) = nullptr;  // the stream with sets written behind, if any
};

GrpcStore::GrpcStore(GrpcStoreOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
GrpcStore::~GrpcStore() = default;

absl::Status GrpcStore::set(const std::string& key, const std::string& value) {
  return impl_->call(v1::StoreRequest::SET, {key}, {value}).status();
}

absl::StatusOr<std::string> GrpcStore::get(const std::string& key, Duration timeout) {
  auto r = impl_->call(v1::StoreRequest::GET, {key}, {}, 0, timeout);
  if (!r.ok()) return r.status();
  return r->values(0);
}

absl::StatusOr<std::int64_t> GrpcStore::add(const std::string& key, std::int64_t delta) {
  auto r = impl_->call(v1::StoreRequest::ADD, {key}, {}, delta);
  if (!r.ok()) return r.status();
  return r->number();
}

absl::StatusOr<std::string> GrpcStore::compare_set(const std::string& key,
                                                   const std::string& expected,
                                                   const std::string& desired) {
  auto r = impl_->call(v1::StoreRequest::COMPARE_SET, {key}, {expected, desired});
  if (!r.ok()) return r.status();
  return r->values(0);
}

absl::StatusOr<bool> GrpcStore::delete_key(const std::string& key) {
  auto r = impl_->call(v1::StoreRequest::DELETE, {key});
  if (!r.ok()) return r.status();
  return r->flag();
}

absl::StatusOr<bool> GrpcStore::check(const std::vector<std::string>& keys) {
  auto r = impl_->call(v1::StoreRequest::CHECK, keys);
  if (!r.ok()) return r.status();
  return r->flag();
}

absl::Status GrpcStore::wait(const std::vector<std::string>& keys, Duration timeout) {
  return impl_->call(v1::StoreRequest::WAIT, keys, {}, 0, timeout).status();
}

absl::StatusOr<std::int64_t> GrpcStore::num_keys() {
  auto r = impl_->call(v1::StoreRequest::NUM_KEYS, {});
  if (!r.ok()) return r.status();
  return r->number();
}

absl::StatusOr<std::vector<std::string>> GrpcStore::multi_get(const std::vector<std::string>& keys,
                                                              Duration timeout) {
  auto r = impl_->call(v1::StoreRequest::MULTI_GET, keys, {}, 0, timeout);
  if (!r.ok()) return r.status();
  return std::vector<std::string>(r->values().begin(), r->values().end());
}

absl::Status GrpcStore::multi_set(const std::vector<std::string>& keys,
                                  const std::vector<std::string>& values) {
  return impl_->call(v1::StoreRequest::MULTI_SET, keys, values).status();
}

}  // namespace muster::rendezvous
