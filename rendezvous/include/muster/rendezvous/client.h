// The agent's end of a rendezvous Session stream.
//
// A reader thread starts the call (waiting for the server when asked to), blocks on the
// stream and posts each message, and finally the stream's status, onto the owner's
// io_context. open(), send() and close() are called from that io_context's thread and never
// wait for the server: the owner's loop keeps running (signals, timers) while it is away.
// To a server in this process (OpenOptions::local) there is no stream and no thread: the
// session is a LocalStream.
#pragma once

#include <boost/asio/io_context.hpp>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "muster/rendezvous/local_session.h"
#include "muster/rendezvous/tls.h"
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

  struct OpenOptions {
    std::string target;  // a gRPC target: host:port, ipv4:ADDR:PORT, ipv6:[ADDR]:PORT
    std::string name;    // what messages call the server (the endpoint as given); or target
    // Wait for the server to come up until connect_timeout passes (a timer on the
    // io_context; then on_closed gets DEADLINE_EXCEEDED "rendezvous server at X not
    // reachable within N s"); otherwise an unreachable server fails at once.
    bool wait_for_ready = false;
    std::chrono::milliseconds connect_timeout{std::chrono::seconds(60)};
    // After the connect timeout, ask gRPC why the server could not be reached (one call of up
    // to limits::kConnectErrorProbe) for on_closed's message. Off for the agent's short probe
    // attempts, which are many and whose reason nobody reads: their end must come on time.
    bool explain_timeout = true;
    // The run's liveness window (keep_alive_interval x keep_alive_max_attempt): each
    // connection attempt is given this long (at least limits::kMinConnectAttempt), so a
    // server that comes back, or a link that heals, is reached within about one window.
    // No transport keep-alive runs on this channel: the application's keep-alives, answered
    // by the server, are the one liveness rule (docs/rendezvous.md, "Liveness").
    std::chrono::milliseconds liveness_window{std::chrono::seconds(2)};
    // Called once, on the io_context, when the stream is up (the server was reached).
    std::function<void()> on_ready;
    // The server is in this process (launch's embedded one): the session goes to it without
    // a socket (local_session.h), and target, waits and TLS do not apply.
    std::shared_ptr<LocalServer> local;
    // TLS to the server (not enabled: plaintext). A server that the client cannot verify,
    // or that refuses the client's certificate, is unreachable to it: with wait_for_ready
    // the connect timeout then ends the wait.
    ClientTls tls;
  };

  // Opens the stream without blocking. Failures arrive through on_closed. The channel
  // accepts messages up to limits::kMaxServerMessageBytes.
  void open(OpenOptions options);

  // Writes one message; before the stream is up it is queued and written, in order, once it
  // is. Returns false when the stream has already ended.
  bool send(const v1::AgentMsg& msg);

  // Cancels the stream (the server sees this node leave), or the wait for the server, at
  // once, and joins the reader thread.
  // on_closed is not called after close() returns. Safe to call twice.
  void close();

  class Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

// One GetStatus call (blocking, bounded by `timeout`): what the server at `target` holds
// for `run_id`, or for every run when it is empty. With `tls` enabled, over TLS.
absl::StatusOr<v1::StatusReply> get_status(const std::string& target, const std::string& run_id,
                                           const std::string& token,
                                           std::chrono::milliseconds timeout,
                                           const ClientTls& tls = {});

}  // namespace muster::rendezvous
