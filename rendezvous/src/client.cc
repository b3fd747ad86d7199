#include "muster/rendezvous/client.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <boost/asio/post.hpp>
#include <thread>

#include "muster/v1/rendezvous.grpc.pb.h"
#include "status_convert.h"

namespace muster::rendezvous {

class SessionClient::Impl : public std::enable_shared_from_this<Impl> {
 public:
  Impl(boost::asio::io_context& io, OnMessage m, OnClosed c)
      : io(io), on_message(std::move(m)), on_closed(std::move(c)) {}

  boost::asio::io_context& io;
  OnMessage on_message;
  OnClosed on_closed;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Rendezvous::Stub> stub;
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::AgentMsg, v1::ServerMsg>> stream;
  std::thread reader;
  std::atomic<bool> closed{false};

  void read_loop() {
    v1::ServerMsg msg;
    while (stream->Read(&msg)) {
      boost::asio::post(io, [self = shared_from_this(), msg] {
        if (!self->closed) self->on_message(msg);
      });
    }
    absl::Status status = from_grpc(stream->Finish());
    boost::asio::post(io, [self = shared_from_this(), status] {
      if (!self->closed) self->on_closed(status);
    });
  }
};

SessionClient::SessionClient(boost::asio::io_context& io, OnMessage on_message, OnClosed on_closed)
    : impl_(std::make_shared<Impl>(io, std::move(on_message), std::move(on_closed))) {}

SessionClient::~SessionClient() { close(); }

void SessionClient::open(const std::string& target, bool wait_for_ready,
                         std::chrono::milliseconds connect_timeout) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // Each agent gets its own connection, never one shared through gRPC's subchannel pool.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  impl_->channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  impl_->stub = v1::Rendezvous::NewStub(impl_->channel);
  if (wait_for_ready) {
    impl_->ctx.set_wait_for_ready(true);
    if (!impl_->channel->WaitForConnected(std::chrono::system_clock::now() + connect_timeout)) {
      // Fall through: the stream fails with UNAVAILABLE and reports through on_closed.
      impl_->ctx.set_wait_for_ready(false);
    }
  }
  impl_->stream = impl_->stub->Session(&impl_->ctx);
  impl_->reader = std::thread([impl = impl_] { impl->read_loop(); });
}

bool SessionClient::send(const v1::AgentMsg& msg) {
  if (!impl_->stream || impl_->closed) return false;
  return impl_->stream->Write(msg);
}

void SessionClient::close() {
  if (impl_->closed.exchange(true)) return;
  if (!impl_->stream) return;
  impl_->ctx.TryCancel();
  if (impl_->reader.joinable()) impl_->reader.join();
}

absl::StatusOr<v1::StatusReply> get_status(const std::string& target, const std::string& run_id,
                                           const std::string& token,
                                           std::chrono::milliseconds timeout) {
  auto stub =
      v1::Rendezvous::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
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
