// A rendezvous server in this process (launch's embedded one, --standalone), reached without
// a socket: the agent's session goes to the server's core as calls posted on the io_context
// the two share. Nothing of gRPC starts for it (docs/launch.md, "What start-up costs").
//
// Threads: open(), send() and close() are called on that io_context's thread; the handlers
// run there too, always from a posted task, never inside one of these calls.
#pragma once

#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "muster/v1/rendezvous.pb.h"

namespace muster::rendezvous {

// One session, the agent's end.
class LocalStream {
 public:
  virtual ~LocalStream() = default;
  // False once the session has ended (the server finished it, or close()).
  virtual bool send(const v1::AgentMsg& msg) = 0;
  // The server sees this node's stream end, as when a gRPC stream is cancelled. No handler
  // is called after it returns. Safe to call twice.
  virtual void close() = 0;
};

class LocalServer {
 public:
  virtual ~LocalServer() = default;
  struct Handlers {
    std::function<void(const v1::ServerMsg&)> on_message;
    // Once, when the server ends the session: OK after Done/Fail, else why (as a gRPC
    // stream's status would say it).
    std::function<void(const absl::Status&)> on_closed;
  };
  // Opens a session; its first message is the agent's Join, as on a stream.
  virtual std::unique_ptr<LocalStream> open(Handlers handlers) = 0;
};

}  // namespace muster::rendezvous
