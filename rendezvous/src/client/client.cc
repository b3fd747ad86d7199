#include "muster/rendezvous/client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "muster/rendezvous/limits.h"

#include "muster/v1/rendezvous.grpc.pb.h"
#include "client/status_convert.h"

namespace muster::rendezvous {

class SessionClient::Impl : public std::enable_shared_from_this<Impl> {
 public:
  using Stream = grpc::ClientReaderWriter<v1::AgentMsg, v1::ServerMsg>;

  Impl(boost::asio::io_context& io, OnMessage m, OnClosed c)
      : io(io), on_message(std::move(m)), on_closed(std::move(c)) {}

  boost::asio::io_context& io;
  OnMessage on_message;
  OnClosed on_closed;
  std::string target;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Rendezvous::Stub> stub;
  grpc::ClientContext ctx;
  std::thread reader;
  std::atomic<bool> closed{false};
  std::unique_ptr<LocalStream> local;  // OpenOptions::local: the session, without a stream

  // Until the reader thread has the stream, messages wait here, in order.
  std::mutex mu;
  std::unique_ptr<Stream> stream;  // set once, under mu; then used without it
  std::vector<v1::AgentMsg> pending;
  bool ready = false;   // under mu: stream is set and `pending` has been written
  bool broken = false;  // under mu: a write failed (the stream has ended)

  std::function<void()> on_ready;

  // io thread only.
  std::unique_ptr<boost::asio::steady_timer> connect_timer;
  // Set by the connect timer (io thread) before it cancels the call; read by the reader too.
  std::atomic<bool> timed_out{false};
  std::chrono::milliseconds connect_timeout{0};
  bool explain_timeout = true;

  // The reader thread, after the connect timeout: what a call that does not wait for the
  // server gets now (gRPC's last connection error), or "" when that says nothing more.
  std::string connect_error() {
    grpc::ClientContext probe;
    probe.set_deadline(std::chrono::system_clock::now() + limits::kConnectErrorProbe);
    v1::StatusRequest req;
    v1::StatusReply reply;
    const grpc::Status st = stub->GetStatus(&probe, req, &reply);
    return st.error_code() == grpc::StatusCode::UNAVAILABLE ? st.error_message() : std::string();
  }

  // The reader thread: starts the call (with wait_for_ready this blocks until the server is
  // reachable, or the call is cancelled by close() or the connect timer), writes what was
  // queued, then reads until the stream ends.
  void run() {
    std::unique_ptr<Stream> s = stub->Session(&ctx);
    Stream* raw = s.get();
    {
      std::lock_guard<std::mutex> lock(mu);
      stream = std::move(s);
      for (const auto& msg : pending) {
        if (!stream->Write(msg)) {
          broken = true;
          break;
        }
      }
      pending.clear();
      ready = true;
    }
    boost::asio::post(io, [self = shared_from_this()] {
      if (self->connect_timer) self->connect_timer->cancel();
      if (!self->closed && self->on_ready) self->on_ready();
    });
    v1::ServerMsg msg;
    while (raw->Read(&msg)) {
      boost::asio::post(io, [self = shared_from_this(), msg] {
        if (!self->closed) self->on_message(msg);
      });
    }
    absl::Status status = from_grpc(raw->Finish());
    // The connect timer ended the wait (not close()): why the server could not be reached
    // (refused, a TLS handshake that failed) is the channel's to tell.
    std::string why;
    if (timed_out && !closed && explain_timeout) why = connect_error();
    boost::asio::post(io, [self = shared_from_this(), status, why] {
      if (self->closed) return;
      if (self->timed_out) {
        self->on_closed(absl::DeadlineExceededError(absl::StrFormat(
            "rendezvous server at %s not reachable within %g s%s", self->target,
            static_cast<double>(self->connect_timeout.count()) / 1000,
            why.empty() ? "" : absl::StrCat(" (", why, ")"))));
        return;
      }
      self->on_closed(status);
    });
  }
};

SessionClient::SessionClient(boost::asio::io_context& io, OnMessage on_message, OnClosed on_closed)
    : impl_(std::make_shared<Impl>(io, std::move(on_message), std::move(on_closed))) {}

SessionClient::~SessionClient() { close(); }

void SessionClient::open(OpenOptions o) {
  if (o.local) {
    impl_->target = o.name.empty() ? o.target : o.name;
    std::weak_ptr<Impl> weak = impl_;
    impl_->local = o.local->open(
        {[weak](const v1::ServerMsg& m) {
           if (auto self = weak.lock(); self && !self->closed) self->on_message(m);
         },
         [weak](const absl::Status& s) {
           if (auto self = weak.lock(); self && !self->closed) self->on_closed(s);
         }});
    boost::asio::post(impl_->io, [weak, on_ready = std::move(o.on_ready)] {
      if (auto self = weak.lock(); self && !self->closed && on_ready) on_ready();
    });
    return;
  }
  grpc::ChannelArguments args;
  // No transport keep-alive (gRPC's default on clients): the agent's keep-alives and the
  // server's answers decide, with the run's window; a second, fixed rule here would end the
  // stream before the one the user set.
  // Each agent gets its own connection, never one shared through gRPC's subchannel pool.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // The server's bound on what it sends (a Fail with capped failures), so both ends agree.
  args.SetMaxReceiveMessageSize(static_cast<int>(limits::kMaxServerMessageBytes));
  // A node that starts before its server (or whose link is down) retries at least once a
  // second, not on gRPC's default backoff of up to two minutes, and gives each attempt one
  // liveness window, not gRPC's default 20 s: a SYN lost in a partition is sent again soon
  // after the link heals.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  const auto attempt = std::max(o.liveness_window, limits::kMinConnectAttempt);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS,
              static_cast<int>(std::min<std::int64_t>(attempt.count(), 1 << 30)));
  impl_->target = o.name.empty() ? o.target : o.name;
  impl_->on_ready = std::move(o.on_ready);
  add_tls_channel_args(o.tls, args);
  impl_->channel = grpc::CreateCustomChannel(o.target, channel_credentials(o.tls), args);
  impl_->stub = v1::Rendezvous::NewStub(impl_->channel);
  if (o.wait_for_ready) {
    // The wait is the reader thread's (the caller's loop keeps serving signals); the timeout
    // is a timer on the caller's loop, so close() and the timer both end it by cancelling.
    impl_->ctx.set_wait_for_ready(true);
    impl_->connect_timeout = o.connect_timeout;
    impl_->explain_timeout = o.explain_timeout;
    impl_->connect_timer =
        std::make_unique<boost::asio::steady_timer>(impl_->io, o.connect_timeout);
    impl_->connect_timer->async_wait([self = impl_](const boost::system::error_code& ec) {
      if (ec || self->closed) return;
      self->timed_out = true;
      self->ctx.TryCancel();
    });
  }
  impl_->reader = std::thread([impl = impl_] { impl->run(); });
}

bool SessionClient::send(const v1::AgentMsg& msg) {
  if (impl_->closed) return false;
  if (impl_->local) return impl_->local->send(msg);
  Impl::Stream* stream = nullptr;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->broken) return false;
    if (!impl_->ready) {
      if (!impl_->reader.joinable()) return false;  // never opened
      impl_->pending.push_back(msg);
      return true;
    }
    stream = impl_->stream.get();
  }
  if (!stream->Write(msg)) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->broken = true;
    return false;
  }
  return true;
}

void SessionClient::close() {
  if (impl_->closed.exchange(true)) return;
  if (impl_->local) {
    impl_->local->close();
    return;
  }
  // Cancelling first: it ends a wait for the server, a blocked write and the read at once
  // (a call not yet started is cancelled as it starts).
  impl_->ctx.TryCancel();
  if (impl_->reader.joinable()) impl_->reader.join();
  impl_->connect_timer.reset();
}

absl::StatusOr<v1::StatusReply> get_status(const std::string& target, const std::string& run_id,
                                           const std::string& token,
                                           std::chrono::milliseconds timeout,
                                           const ClientTls& tls) {
  grpc::ChannelArguments args;
  add_tls_channel_args(tls, args);
  auto stub = v1::Rendezvous::NewStub(
      grpc::CreateCustomChannel(target, channel_credentials(tls), args));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + timeout);
  v1::StatusRequest req;
  req.set_run_id(run_id);
  req.set_token(token);
  v1::StatusReply reply;
  if (absl::Status st = from_grpc(stub->GetStatus(&ctx, req, &reply)); !st.ok()) return st;
  return reply;
}

}  // namespace muster::rendezvous
