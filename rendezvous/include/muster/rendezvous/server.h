// The rendezvous server: the gRPC `Rendezvous` service around a StateMachine, and the `Store`
// service holding each run's key-value table (dropped with the run).
//
// Threads: the state machine and the session table live on the io_context passed to
// start(); gRPC's callback threads only post events onto it. The same server runs embedded
// in `launch` (sharing the agent's io_context) and on its own in `rdzvd`.
#pragma once

#include <boost/asio/io_context.hpp>
#include <functional>
#include <memory>
#include <vector>
#include <string>

#include "absl/status/statusor.h"
#include "muster/rendezvous/local_session.h"
#include "muster/rendezvous/credentials.h"
#include "muster/rendezvous/events.h"
#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/run_store.h"
#include "muster/rendezvous/state_machine.h"
#include "muster/rendezvous/store.h"
#include "muster/rendezvous/tls.h"

namespace muster::ops {
class Registry;
}

namespace muster::rendezvous {

struct ServerOptions {
  // host:port; port 0 picks a free port (see RendezvousServer::port()).
  std::string listen_address = "127.0.0.1:0";
  // gRPC starts with the first connection, not before (launch's embedded server: a job
  // whose workers never call the store, and whose agent is in-process (local()), starts none
  // of it). The server binds its listeners itself and hands each accepted connection to
  // gRPC. An IPv4 listen_address only, and not with TLS (then it starts at once).
  bool start_grpc_on_demand = false;
  // When non-empty, a Join must carry this token or its stream ends with PERMISSION_DENIED.
  std::string token;
  // Per-run tokens (rdzvd --token_file), when given: credentials.h says who may do what.
  // Store calls and status calls are checked the same way.
  std::optional<RunTokens> run_tokens;
  // Enabled: the TCP listener speaks TLS only (mutual TLS with a client CA), and there is no
  // local (Unix-domain) store listener, so that nothing bypasses the TLS checks: workers on
  // this machine reach the store over TCP and TLS too (docs/operations.md, "TLS").
  ServerTls tls;
  RendezvousTimeouts timeouts;
  // Cap on one message either way: a store value with its key (limits.h). Agents' messages
  // have the tighter limits::kMaxAgentMessageBytes, checked by the Session reactor.
  std::size_t max_message_bytes = limits::kMaxServerReceiveBytes;
  StoreLimits store_limits;
  // Each world of a run also gets a table in c10d's TCPStore protocol (tcpstore_server.h),
  // which the run's agents serve to their own workers on loopback and relay here over their
  // StoreRelay streams (store_relay.h; Assignment.store_relay), so that torch's own store
  // client uses the run's store (TORCHELASTIC_USE_AGENT_STORE) in every mode: TLS and tokens
  // guard it as they guard the rendezvous, and no listener of its own is opened.
  bool agent_store = true;
  // Called on the io thread with every event of every run (events.h), in order, after the
  // state machine decided it and before its messages are sent: metrics, the event log, the
  // live page. Must be quick and must not call into the server.
  std::vector<std::function<void(const RunEvent&)>> event_sinks;
  // When set, the server adds its series (docs/operations.md, "Metrics") to this registry,
  // which must outlive the server. A render of the registry then samples the runs on the io
  // thread (waiting for it at most a second): render it from another thread.
  ops::Registry* metrics = nullptr;
  // Where runs are kept durably (run_store.h; rdzvd --state_dir), or none: runs live in
  // memory only. With one, start() restores what it holds before it serves, every decision's
  // changed records are written before its messages are sent, and Assignments tell agents
  // to keep their workers through a server restart (docs/rendezvous.md, "Restarting the
  // server without restarting workers"). A write that fails is logged once per run and the
  // run's old record is erased (a restart then forgets the run rather than go back to a
  // stale state); the server goes on serving.
  std::shared_ptr<RunStore> run_store;
  // Replicated mode (rdzvd --etcd; docs/rendezvous.md, "Replicated rdzvd on etcd"): the
  // server starts as a standby. It listens, holds every session it gets (answering its
  // keep-alives, keeping its messages) for up to `standby_hold`, and decides nothing, until
  // lead() gives it the run store: it restores the runs and then decides what it held, in
  // order. A held session is ended (UNAVAILABLE, naming the leader) when its time is up or
  // when set_leader() says another replica leads, so its agent tries its next endpoint.
  bool standby = false;
  std::chrono::milliseconds standby_hold{0};
  // When set, a write to run_store that fails is not outlived: `on_store_lost` is called (on
  // the io thread) and no message of that decision, or of any later one, is sent. For a store
  // whose failed write means another server may lead (etcd): the caller ends the process.
  std::function<void(const absl::Status&)> on_store_lost;
};

// What start() restored from ServerOptions::run_store.
struct RestoreSummary {
  int runs = 0;
  int running = 0;  // of which running: their members' places are held for re-attach
  std::vector<std::string> skipped;  // records that could not be read or restored, one line each
};

class RendezvousServer {
 public:
  // Binds and starts serving. Fails (with the address in the message) when it cannot bind.
  static absl::StatusOr<std::unique_ptr<RendezvousServer>> start(boost::asio::io_context& io,
                                                                 ServerOptions options);
  ~RendezvousServer();
  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;

  int port() const;
  // Replaces the per-run tokens (a reload of the token file). Any thread. Sessions that
  // have joined stay; every later Join, store and status call is checked against the new
  // table.
  void set_run_tokens(RunTokens tokens);
  // What start() restored (empty without a run store).
  const RestoreSummary& restored() const;
  // Any thread, replicated mode: this replica leads from now on with `store` (see
  // ServerOptions::standby); `done` is called on the io thread with what was restored, once
  // the held sessions have been decided. A store that cannot be read is a lost store
  // (on_store_lost; `done` is not called). Nothing when the server is not a standby.
  void lead(std::shared_ptr<RunStore> store, std::function<void(const RestoreSummary&)> done);
  // Any thread, replicated mode: `name` leads (another replica).
  void set_leader(std::string name);
  // The store's gRPC target on an abstract Unix-domain socket ("unix-abstract:NAME"), for
  // clients with this process's ops::host_identity(); empty when there is none.
  const std::string& local_store_target() const;
  // Sessions of an agent in this process, without a socket (local_session.h; launch's
  // embedded server). The agent's io_context must be the server's.
  std::shared_ptr<LocalServer> local() const;

  // Any thread: what GetStatus would answer for `run_id` (every run when empty), taken on the
  // io thread, where `done` is then called with it (it must be quick). `done` is never
  // called when the io_context does not run the task (it stopped, or the server went), so a
  // caller on another thread waits for it with a timeout (the live page does).
  void post_status(const std::string& run_id, std::function<void(v1::StatusReply)> done);

  // Ends every stream and stops listening; waits at most `grace` for in-flight calls. With a
  // run store, nothing is decided from its start (the streams it ends are not losses), and
  // the store is not written after it returns. Parked
  // store waits and status calls end at once (UNAVAILABLE); sessions may finish within the
  // grace (members reading Done or Fail). Does not need the io_context to run. Safe to call
  // twice. Must not be called from a gRPC callback thread.
  void shutdown(std::chrono::milliseconds grace = std::chrono::milliseconds(0));

  class Impl;

 private:
  explicit RendezvousServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Routes gRPC's own log lines (e.g. a failed bind, which the hosting rule expects) to
// spdlog at debug level instead of stderr. Call once at the start of main().
void route_grpc_logs_to_spdlog();

}  // namespace muster::rendezvous
