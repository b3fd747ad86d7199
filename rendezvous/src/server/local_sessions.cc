#include "server/local_sessions.h"

#include <boost/asio/post.hpp>

#include "absl/strings/str_cat.h"
#include "client/status_convert.h"
#include "muster/rendezvous/limits.h"

namespace muster::rendezvous::server_internal {

// One session. Everything runs on the io thread (the core calls enqueue/finish there, under
// the link's lock), so its flags need no lock.
class LocalSessions::Session final : public SessionSink,
                                     public std::enable_shared_from_this<Session> {
 public:
  Session(std::shared_ptr<Core> core, Handlers handlers)
      : core_(std::move(core)),
        id_(core_->new_session_id()),
        link_(std::make_shared<SessionLink>()),
        handlers_(std::move(handlers)) {}

  void start() {
    {
      absl::MutexLock lock(&link_->mu);
      link_->sink = this;
    }
    boost::asio::post(core_->io(),
                      [core = core_, id = id_, link = link_] { core->on_open(id, link); });
  }

  void enqueue(v1::ServerMsg msg) override {
    boost::asio::post(core_->io(), [self = shared_from_this(), msg = std::move(msg)] {
      if (!self->ended_) self->handlers_.on_message(msg);
    });
  }

  void finish(grpc::Status status) override { end_later(from_grpc(status)); }

  void end_later(absl::Status status) {
    boost::asio::post(core_->io(), [self = shared_from_this(), status = std::move(status)] {
      if (self->ended_) return;
      self->detach();
      self->handlers_.on_closed(status);
    });
  }

  // The same checks as a stream's reactor, before the core sees a message.
  bool send(const v1::AgentMsg& msg) {
    if (ended_) return false;
    if (absl::Status why = core_->admit(msg); !why.ok()) {
      detach();
      end_with(std::move(why));
      return false;
    }
    boost::asio::post(core_->io(), [core = core_, id = id_, msg] { core->on_message(id, msg); });
    return true;
  }

  void close() {
    agent_closed_ = true;
    if (!ended_) detach();
  }

 private:
  // The core sees the stream end; nothing reaches the agent's handlers after this.
  void detach() {
    ended_ = true;
    {
      absl::MutexLock lock(&link_->mu);
      link_->sink = nullptr;
    }
    boost::asio::post(core_->io(), [core = core_, id = id_] { core->on_closed(id); });
  }
  // The agent is told (later, from a posted task) why its session ended.
  void end_with(absl::Status status) {
    boost::asio::post(core_->io(), [self = shared_from_this(), status = std::move(status)] {
      if (!self->agent_closed_) self->handlers_.on_closed(status);
    });
  }

  std::shared_ptr<Core> core_;
  const SessionId id_;
  std::shared_ptr<SessionLink> link_;
  Handlers handlers_;
  bool ended_ = false;         // the core has seen the session end
  bool agent_closed_ = false;  // close(): no handler is called any more
};

namespace {

class Handle final : public LocalStream {
 public:
  explicit Handle(std::shared_ptr<LocalSessions::Session> s) : s_(std::move(s)) {}
  ~Handle() override { s_->close(); }
  bool send(const v1::AgentMsg& msg) override { return s_->send(msg); }
  void close() override { s_->close(); }

 private:
  std::shared_ptr<LocalSessions::Session> s_;
};

}  // namespace

std::unique_ptr<LocalStream> LocalSessions::open(Handlers handlers) {
  auto session = std::make_shared<Session>(core_, std::move(handlers));
  session->start();
  bool stopped = false;
  {
    absl::MutexLock lock(&mu_);
    stopped = stopped_;
    std::erase_if(sessions_, [](const std::weak_ptr<Session>& w) { return w.expired(); });
    sessions_.push_back(session);
  }
  if (stopped)
    session->end_later(absl::UnavailableError("rendezvous: the server is shutting down"));
  return std::make_unique<Handle>(std::move(session));
}

void LocalSessions::shutdown() {
  std::vector<std::weak_ptr<Session>> sessions;
  {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
    sessions.swap(sessions_);
  }
  for (const auto& w : sessions) {
    if (auto s = w.lock())
      s->end_later(absl::UnavailableError("rendezvous: the server is shutting down"));
  }
}

}  // namespace muster::rendezvous::server_internal
