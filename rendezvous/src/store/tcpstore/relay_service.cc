#include "store/tcpstore/relay_service.h"

#include <deque>
#include <unordered_set>
#include <unordered_map>
#include <vector>

#include <spdlog/spdlog.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/tcpstore_protocol.h"
#include "muster/rendezvous/limits.h"
#include "muster/v1/rendezvous.grpc.pb.h"

namespace muster::rendezvous {

class RelayStream;

namespace {

using tcpstore::Parsed;
using tcpstore::Request;

// One worker connection an agent relays: a connection of its world's table.
struct Relayed final : tcpstore::Conn {
  Relayed(std::weak_ptr<RelayStream> s, std::uint64_t id, std::shared_ptr<TcpStoreWorld> w)
      : stream(std::move(s)), id(id), world(std::move(w)) {}
  void flush() override;
  void fail(const std::string& why) override;
  void end(const std::string& why) override;
  // Out of its table and its stream, with nothing sent (the agent closed it, or the stream went).
  void leave();

  const std::weak_ptr<RelayStream> stream;
  const std::uint64_t id;
  const std::shared_ptr<TcpStoreWorld> world;
  std::string in;
};

}  // namespace

class RelayService::Impl final : public v1::StoreRelay::CallbackService {
 public:
  Impl(std::shared_ptr<AgentStores> worlds, std::shared_ptr<const Credentials> credentials)
      : worlds_(std::move(worlds)), credentials_(std::move(credentials)) {}

  grpc::ServerBidiReactor<v1::RelayUp, v1::RelayDown>* Relay(
      grpc::CallbackServerContext* ctx) override;
  void shutdown();
  void forget(RelayStream* s) {
    absl::MutexLock lock(&mu_);
    streams_.erase(s);
  }

  std::shared_ptr<AgentStores> worlds_;
  std::shared_ptr<const Credentials> credentials_;

 private:
  absl::Mutex mu_;
  std::unordered_set<RelayStream*> streams_ ABSL_GUARDED_BY(mu_);  // begun, not done
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

// One agent's stream: the reactor (gRPC's threads) and the relayed connections (the loop's).
// Every StartRead and Finish happens on the loop's thread; StartWrite on the loop's or in
// OnWriteDone, never after Finish (the flags below decide, under mu).
class RelayStream final : public grpc::ServerBidiReactor<v1::RelayUp, v1::RelayDown>,
                          public tcpstore::KeyHolder,
                          public std::enable_shared_from_this<RelayStream> {
 public:
  RelayStream(RelayService::Impl* service, std::string peer)
      : service_(service), io_(service->worlds_->io()), peer_(std::move(peer)) {}

  void begin(std::shared_ptr<RelayStream> self) {
    self_ = std::move(self);
    StartRead(&up_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) return post_finish(grpc::Status::OK);
    const bool first = run_.empty();
    if (first) {
      const std::string run = up_.run_id();
      if (run.empty()) {
        return post_finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                        "store relay: the first message names no run"));
      }
      if (service_->credentials_ && !service_->credentials_->allows(run, up_.token())) {
        return post_finish(grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                                        "store relay: the token does not open run '" + run + "'"));
      }
      if (!service_->worlds_->holds(run)) {
        return post_finish(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                                        "store relay: unknown run '" + run + "'"));
      }
      run_ = run;
      caches_ = up_.caches();
    }
    auto frames = std::make_shared<v1::RelayUp>();
    frames->Swap(&up_);
    boost::asio::post(io_, [this, frames, first] {
      if (first) {  // conn 0: the stream is served (the agent lets its workers' queries go)
        v1::RelayFrame ready;
        ready.set_conn(0);
        ready.set_caches(caches_);
        send(std::move(ready));
      }
      serve(*frames);
      bool read = false;
      {
        absl::MutexLock lock(&mu_);
        read = !finished_;
      }
      if (read) StartRead(&up_);
    });
  }

  void OnWriteDone(bool ok) override {
    bool more = false, finish = false;
    {
      absl::MutexLock lock(&mu_);
      pending_bytes_ -= sent_bytes_;
      sent_bytes_ = 0;
      sending_.Clear();
      if (!ok || finished_) {
        writing_ = false;
        finish = true;
      } else if (!pending_.empty()) {
        take_batch();
        more = true;
      } else {
        writing_ = false;
        finish = finish_pending_;
      }
    }
    if (more) StartWrite(&sending_);
    if (finish) post_finish(status_or_ok());
  }

  void OnCancel() override { post_finish(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled")); }

  void OnDone() override {
    service_->forget(this);
    // The connections leave their tables on the loop; the last holder frees the stream.
    boost::asio::post(io_, [self = std::move(self_)] { self->leave_all(); });
  }

  // A frame down to the agent (on the loop's thread). Past the unsent bound, the stream ends.
  void send(v1::RelayFrame frame) {
    bool start = false, overflow = false;
    {
      absl::MutexLock lock(&mu_);
      if (finished_ || finish_pending_) return;
      pending_bytes_ += frame.ByteSizeLong();
      if (pending_bytes_ > limits::kMaxRelayUnsentBytes) {
        overflow = true;
        status_ = grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                               "store relay: the agent does not read its replies");
        pending_.clear();
        finish_pending_ = true;
      } else {
        pending_.push_back(std::move(frame));
        if (!writing_) {
          writing_ = true;
          take_batch();
          start = true;
        }
      }
    }
    if (overflow) {
      spdlog::warn("store relay: ended the stream of {} (run '{}'): it does not read its replies "
                   "(over {} bytes unsent)",
                   peer_, run_, limits::kMaxRelayUnsentBytes);
      return post_finish(status_or_ok());
    }
    if (start) StartWrite(&sending_);
  }

  // A key this agent's node set was written by another client (the loop's thread, inside the
  // table's serve: before any reply that write could lead to).
  void dropped(int round, const std::string& key) override {
    v1::RelayFrame f;
    f.set_conn(0);
    f.set_round(round);
    f.add_dropped(key);
    send(std::move(f));
  }

  // Ends the stream with `st` (after the write in flight). Any thread.
  void end(grpc::Status st) { post_finish(std::move(st)); }

  const std::string& run() const { return run_; }
  const std::string& peer() const { return peer_; }
  std::unordered_map<std::uint64_t, std::shared_ptr<Relayed>>& conns() { return conns_; }

 private:
  grpc::Status status_or_ok() {
    absl::MutexLock lock(&mu_);
    return status_ ? *status_ : grpc::Status::OK;
  }

  // Frames of pending_ into sending_, up to the batch size (one at least).
  void take_batch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::size_t bytes = 0;
    while (!pending_.empty() && (bytes == 0 || bytes + pending_.front().ByteSizeLong() <=
                                                   limits::kRelayBatchBytes)) {
      bytes += pending_.front().ByteSizeLong();
      *sending_.add_frames() = std::move(pending_.front());
      pending_.pop_front();
    }
    sent_bytes_ = bytes;
  }

  void post_finish(grpc::Status st) {
    boost::asio::post(io_, [this, st = std::move(st)] {
      {
        absl::MutexLock lock(&mu_);
        if (finished_) return;
        if (writing_) {  // after the write in flight (OnWriteDone posts again)
          finish_pending_ = true;
          if (!status_) status_ = st;
          return;
        }
        finished_ = true;
      }
      Finish(st);
    });
  }

  // The frames of one message, in order (on the loop's thread).
  void serve(v1::RelayUp& up) {
    for (v1::RelayFrame& f : *up.mutable_frames()) {
      auto it = conns_.find(f.conn());
      if (it == conns_.end()) {
        if (f.closed()) continue;
        it = open(f);
        if (it == conns_.end()) continue;
      }
      std::shared_ptr<Relayed> c = it->second;
      if (f.closed()) {
        c->leave();
        continue;
      }
      if (f.has_prefetch()) c->prefetch = f.prefetch();
      c->in.append(f.data());
      std::size_t pos = 0;
      Request req;
      const StoreLimits& l = service_->worlds_->limits();
      const tcpstore::FrameLimits frame{l.max_key_bytes, l.max_value_bytes,
                                        l.max_keys_per_request, limits::kMaxTcpStoreFrameBytes};
      while (!c->closed && pos < c->in.size()) {
        const auto r = tcpstore::parse(c->dialect, c->in.data() + pos, c->in.size() - pos,
                                       frame, req);
        if (r.what == Parsed::kError) {
          c->fail(r.error);
          break;
        }
        if (r.what == Parsed::kNeedMore) {
          c->fail("half a frame (the agent relays whole frames)");
          break;
        }
        pos += r.consumed;
        c->world->table.serve(c, req);
      }
      if (c->closed) continue;
      c->in.clear();
      c->flush();
    }
  }

  std::unordered_map<std::uint64_t, std::shared_ptr<Relayed>>::iterator open(
      const v1::RelayFrame& f) {
    auto refuse = [&](const std::string& why) {
      v1::RelayFrame down;
      down.set_conn(f.conn());
      down.set_closed(true);
      down.set_error(why);
      send(std::move(down));
      return conns_.end();
    };
    std::shared_ptr<TcpStoreWorld> w = service_->worlds_->world(run_, f.round());
    if (!w || w->closed) {
      return refuse("round " + std::to_string(f.round()) + " of run '" + run_ +
                    "' has no store (not a world of the run, or one closed already)");
    }
    if (w->conns.size() >= limits::kMaxRelayedConnectionsPerWorld) {
      return refuse("round " + std::to_string(f.round()) + " holds " +
                    std::to_string(w->conns.size()) + " connections already");
    }
    auto c = std::make_shared<Relayed>(weak_from_this(), f.conn(), w);
    if (caches_) c->holder = weak_from_this();
    w->conns.insert(c);
    return conns_.emplace(f.conn(), std::move(c)).first;
  }

  void leave_all() {
    for (auto& [id, c] : std::unordered_map<std::uint64_t, std::shared_ptr<Relayed>>(conns_)) {
      c->leave();
    }
  }

  RelayService::Impl* const service_;
  boost::asio::io_context& io_;
  const std::string peer_;
  std::shared_ptr<RelayStream> self_;  // held from begin() until OnDone
  std::string run_;                // set by the first message (gRPC's thread, before any serve)
  bool caches_ = false;            // likewise: the agent keeps what its node sets
  v1::RelayUp up_;
  // The loop's:
  std::unordered_map<std::uint64_t, std::shared_ptr<Relayed>> conns_;

  absl::Mutex mu_;
  std::deque<v1::RelayFrame> pending_ ABSL_GUARDED_BY(mu_);
  std::size_t pending_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  v1::RelayDown sending_ ABSL_GUARDED_BY(mu_);
  std::size_t sent_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_pending_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> status_ ABSL_GUARDED_BY(mu_);
};

namespace {

void Relayed::flush() {
  if (closed || (out.empty() && !prefetched)) return;
  auto s = stream.lock();
  if (!s) return;
  v1::RelayFrame f;
  f.set_conn(id);
  f.set_replies(replies);
  replies = 0;
  f.set_data(std::move(out));
  out.clear();
  if (prefetched) {
    f.set_prefetched(std::move(*prefetched));
    f.set_has_prefetched(true);
    prefetched.reset();
  }
  s->send(std::move(f));
}

void Relayed::fail(const std::string& why) {
  if (closed) return;
  auto s = stream.lock();
  spdlog::warn("store relay: closed connection {} of {} (run '{}', round {}): {}", id,
               s ? s->peer() : std::string("?"), world->run, world->round, why);
  end(why);
}

void Relayed::end(const std::string& why) {
  if (closed) return;
  auto s = stream.lock();
  leave();
  if (!s) return;
  v1::RelayFrame f;
  f.set_conn(id);
  f.set_closed(true);
  f.set_error(why);
  s->send(std::move(f));
}

void Relayed::leave() {
  if (closed) return;
  closed = true;
  world->table.unpark(*this);
  world->conns.erase(shared_from_this());
  if (auto s = stream.lock()) s->conns().erase(id);
}

}  // namespace

grpc::ServerBidiReactor<v1::RelayUp, v1::RelayDown>* RelayService::Impl::Relay(
    grpc::CallbackServerContext* ctx) {
  auto s = std::make_shared<RelayStream>(this, ctx->peer());
  RelayStream* raw = s.get();
  bool stopping = false;
  {
    absl::MutexLock lock(&mu_);
    stopping = stopping_;
    streams_.insert(raw);
  }
  raw->begin(std::move(s));
  if (stopping) raw->end(grpc::Status(grpc::StatusCode::UNAVAILABLE, "store relay: the server is shutting down"));
  return raw;
}

void RelayService::Impl::shutdown() {
  absl::MutexLock lock(&mu_);
  stopping_ = true;
  for (RelayStream* s : streams_) s->end(grpc::Status(grpc::StatusCode::UNAVAILABLE, "store relay: the server is shutting down"));
}

RelayService::RelayService(std::shared_ptr<AgentStores> worlds,
                           std::shared_ptr<const Credentials> credentials)
    : impl_(std::make_unique<Impl>(std::move(worlds), std::move(credentials))) {}

RelayService::~RelayService() = default;

void RelayService::register_with(grpc::ServerBuilder& builder) {
  builder.RegisterService(impl_.get());
}

void RelayService::shutdown() { impl_->shutdown(); }

}  // namespace muster::rendezvous
