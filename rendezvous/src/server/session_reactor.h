// One agent's Session stream on the server (private to server*.cc).
#pragma once

#include "client/status_convert.h"
#include "server/server_core.h"

namespace muster::rendezvous::server_internal {


// One agent's stream. Reactions run on gRPC threads; no lock is held across a Start* call
// because a reaction may run on another thread before the call returns.
class SessionReactor final : public grpc::ServerBidiReactor<v1::AgentMsg, v1::ServerMsg>,
                             public SessionSink {
 public:
  SessionReactor(std::shared_ptr<Core> core, SessionId id)
      : core_(std::move(core)), id_(id), link_(std::make_shared<SessionLink>()) {
    {
      absl::MutexLock lock(&link_->mu);
      link_->sink = this;
    }
    boost::asio::post(core_->io(),
                      [core = core_, id = id_, link = link_] { core->on_open(id, link); });
    StartRead(&in_);
  }

  // Called from the io thread through the link, under link->mu.
  void enqueue(v1::ServerMsg msg) override {
    v1::ServerMsg* start = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (finishing_) return;
      queue_.push_back(std::move(msg));
      if (!writing_) {
        writing_ = true;
        start = &queue_.front();
      }
    }
    if (start != nullptr) StartWrite(start);
  }

  void finish(grpc::Status status) override {
    bool now = false;
    {
      absl::MutexLock lock(&mu_);
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
    if (absl::Status why = core_->admit(in_); !why.ok()) {
      post_closed();
      finish(to_grpc(why));
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
      absl::MutexLock lock(&mu_);
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

  // The client went away or the server is shutting down: a pending read or write also
  // completes (not ok), which finishes the call; this only makes the end prompt.
  void OnCancel() override {
    post_closed();
    finish(grpc::Status(grpc::StatusCode::CANCELLED, "rendezvous: the session was cancelled"));
  }

  void OnDone() override {
    post_closed();
    {
      absl::MutexLock lock(&link_->mu);
      link_->sink = nullptr;
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
  absl::Mutex mu_;
  std::deque<v1::ServerMsg> queue_ ABSL_GUARDED_BY(mu_);  // front() is being written
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status final_;
};

}  // namespace muster::rendezvous::server_internal
