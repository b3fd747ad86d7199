// The agent's end of a rendezvous Session stream.
//
// A reader thread blocks on the stream and posts each message, and finally the stream's
// status, onto the owner's io_context. send() and close() are called from that io_context.
#pragma once

#include <boost/asio/io_context.hpp>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "muster/v1/rendezvous.pb.h"

namespace muster::rendezvous {

class SessionClient {
 public:
  using OnMessage = std::function<void(const v1::ServerMsg&)>;
  // Called once, when the stream has ended: OK after Done/Fail, else the server's error.
  using OnClosed = std::function<void(const absl::Status&)>;

  SessionClient(boost::asio::io_context& io, OnMessage on_message, OnClosed on_closed);
  ~SessionClient();  // close()s
  SessionClient(const SessionClient&) = delete;
  SessionClient& operator=(const SessionClient&) = delete;

  // Opens the stream to `target` (host:port). When wait_for_ready, the call waits for the
  // server to come up until `connect_timeout` passes; otherwise an unreachable server fails
  // at once. Failures arrive through on_closed.
  void open(const std::string& target, bool wait_for_ready,
            std::chrono::milliseconds connect_timeout);

  // Writes one message. Returns false when the stream has already ended.
  bool send(const v1::AgentMsg& msg);

  // Cancels the stream (the server sees this node leave) and joins the reader thread.
  // on_closed is not called after close() returns. Safe to call twice.
  void close();

  class Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

// One GetStatus call (blocking, bounded by `timeout`): what the server at `target` holds
// for `run_id`, or for every run when it is empty.
absl::StatusOr<v1::StatusReply> get_status(const std::string& target, const std::string& run_id,
                                           const std::string& token,
                                           std::chrono::milliseconds timeout);

}  // namespace muster::rendezvous
