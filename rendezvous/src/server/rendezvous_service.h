// The Rendezvous gRPC service (rendezvous.proto): Session streams and GetStatus calls, handed
// to the core (private to server*.cc).
#pragma once

#include "server/server_core.h"
#include "server/session_reactor.h"

namespace muster::rendezvous::server_internal {

class Service final : public v1::Rendezvous::CallbackService {
 public:
  explicit Service(std::shared_ptr<Core> core) : core_(std::move(core)) {}
  grpc::ServerBidiReactor<v1::AgentMsg, v1::ServerMsg>* Session(
      grpc::CallbackServerContext*) override {
    return new SessionReactor(core_, core_->new_session_id());
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
    if (request->run_id().size() > limits::kMaxIdBytes || !ops::is_valid_utf8(request->run_id())) {
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
};

}  // namespace muster::rendezvous::server_internal
