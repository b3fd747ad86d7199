#include "muster/rendezvous/server.h"

#include <unistd.h>

#include <random>

#include <grpc/support/log.h>
#include <grpcpp/grpcpp.h>
#include <spdlog/spdlog.h>

#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <atomic>
#include <deque>
#include <map>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "muster/ops/build_info.h"
#include "muster/ops/host_id.h"
#include "muster/rendezvous/limits.h"
#include "server/health.h"
#include "server/memory_trim.h"
#include "server/server_metrics.h"
#include "client/status_convert.h"
#include "store/tcpstore/agent_stores.h"
#include "store/tcpstore/relay_service.h"
#include "store/store_server.h"
#include "muster/ops/text.h"
#include "muster/v1/rendezvous.grpc.pb.h"
#include "server/rendezvous_service.h"
#include "server/server_core.h"
#include "server/session_reactor.h"
#include "server/local_sessions.h"
#include "server/on_demand.h"

namespace muster::rendezvous {

using namespace server_internal;

class RendezvousServer::Impl {
 public:
  std::shared_ptr<Core> core;
  std::unique_ptr<Service> service;
  std::shared_ptr<LocalSessions> local;
  std::unique_ptr<StoreServer> store;
  std::unique_ptr<RelayService> relay;  // null: ServerOptions::agent_store off
  std::unique_ptr<grpc::Server> server;  // null with on_demand
  std::unique_ptr<OnDemandListener> on_demand;  // ServerOptions::start_grpc_on_demand
  std::shared_ptr<Credentials> credentials;
  int port = 0;
  RestoreSummary restored;
  std::string local_target;
  bool stopped = false;
  ops::Registry* metrics_registry = nullptr;
  int metrics_collector = 0;  // the registry's id of our collector; 0: none
};

namespace {

// The services and channel arguments of the server's gRPC side; the listeners are the caller's.
void configure(grpc::ServerBuilder& builder, grpc::Service* service, StoreServer* store,
               RelayService* relay, int max_bytes) {
  builder.RegisterService(service);
  store->register_with(builder);
  if (relay != nullptr) relay->register_with(builder);
  builder.SetMaxReceiveMessageSize(max_bytes);
  builder.SetMaxSendMessageSize(max_bytes);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                             limits::kMaxConcurrentStreamsPerConnection);
  // Exactly one server per port: a second agent on this host must fail to bind and connect.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_OPTIMIZATION_TARGET, std::string("latency"));
  builder.AddChannelArgument(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  // Silent nodes are the state machine's to drop, by their run's liveness window. The
  // transport keep-alive only reclaims connections silent for longer than any window may be
  // (limits.h), so it never decides first.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS,
                             static_cast<int>(limits::kMaxLivenessWindow.count()));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                             static_cast<int>(limits::kTransportKeepAliveTimeout.count()));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Clients that do ping (the workers' store channels) are never refused for it.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
}

}  // namespace

absl::StatusOr<std::unique_ptr<RendezvousServer>> RendezvousServer::start(
    boost::asio::io_context& io, ServerOptions options) {
  auto impl = std::make_unique<Impl>();
  std::string address = options.listen_address;
  const int max_bytes = static_cast<int>(options.max_message_bytes);
  std::shared_ptr<ServerMetrics> metrics;
  if (options.metrics != nullptr) {
    impl->metrics_registry = options.metrics;
    metrics = std::make_shared<ServerMetrics>();
    options.event_sinks.push_back([metrics](const RunEvent& e) { metrics->on_event(e); });
  }
  const bool tls = options.tls.enabled();
  const bool options_on_demand = options.start_grpc_on_demand;
  const ServerTls options_tls = options.tls;  // options moves into the core below
  impl->credentials = std::make_shared<Credentials>(options.token, std::move(options.run_tokens));
  impl->store = std::make_unique<StoreServer>(options.store_limits, impl->credentials);
  impl->core = std::make_shared<Core>(io, std::move(options), impl->credentials);
  impl->service = std::make_unique<Service>(impl->core);
  impl->local = std::make_shared<LocalSessions>(impl->core);
  impl->core->set_store(impl->store.get());
  if (impl->core->agent_stores()) {
    impl->relay = std::make_unique<RelayService>(impl->core->agent_stores(), impl->credentials);
  }
  enable_health_service();
  if (!impl->core->standby()) {  // a standby restores when it comes to lead
    absl::StatusOr<RestoreSummary> restored = impl->core->restore();
    if (!restored.ok()) return restored.status();
    impl->restored = std::move(*restored);
  }
  // Also on an abstract Unix-domain socket: workers on this machine (and network namespace)
  // reach the store there, faster than over TCP loopback (docs/worker_runtime.md). Not with
  // TLS: a plaintext socket beside the TLS port would let a local client past the
  // client-certificate check.
  const std::string host = tls ? std::string() : ops::host_identity();
  std::string abstract_name;
  if (!host.empty()) {
    abstract_name = absl::StrCat("muster-rdzv-", ::getpid(), "-", std::random_device{}());
    impl->local_target = absl::StrCat("unix-abstract:", abstract_name);
    impl->core->set_local_store(impl->local_target, host);
  }
  const bool standby = impl->core->standby();
  grpc::Service* service = impl->service.get();
  StoreServer* store = impl->store.get();
  RelayService* relay = impl->relay.get();
  if (options_on_demand && !tls) {
    auto listener = OnDemandListener::open(address, abstract_name, [service, store, relay,
                                                                      max_bytes, standby] {
      grpc::ServerBuilder builder;
      configure(builder, service, store, relay, max_bytes);
      std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
      if (server) {
        set_serving(*server, true);
        if (standby) set_leading(*server, false);
      }
      return server;
    });
    if (!listener.ok()) return listener.status();
    impl->on_demand = std::move(*listener);
    impl->port = impl->on_demand->port();
  } else {
    grpc::ServerBuilder builder;
    builder.AddListeningPort(address, server_credentials(options_tls), &impl->port);
    if (!abstract_name.empty()) {
      builder.AddListeningPort(impl->local_target, grpc::InsecureServerCredentials());
    }
    configure(builder, service, store, relay, max_bytes);
    impl->server = builder.BuildAndStart();
    if (!impl->server || impl->port == 0) {
      return absl::UnavailableError(absl::StrCat("rendezvous server cannot listen on ", address));
    }
    set_serving(*impl->server, true);
    if (standby) set_leading(*impl->server, false);
  }
  boost::asio::post(io, [core = std::weak_ptr<Core>(impl->core)] {
    if (auto c = core.lock()) {
      c->start_housekeeping();
      c->apply({});  // the restored runs' events to the sinks, and their timers
    }
  });
  if (metrics) {
    metrics->attach(*impl->metrics_registry);
    // Removed by shutdown(), before the store goes: the collector reads it.
    impl->metrics_collector = impl->metrics_registry->add_collector(
        [&io, metrics, core = std::weak_ptr<Core>(impl->core), store = impl->store.get()] {
          metrics->collect(
              io, [core] { auto c = core.lock(); return c ? c->sample() : ServerSample{}; },
              *store);
        });
  }
  return std::unique_ptr<RendezvousServer>(new RendezvousServer(std::move(impl)));
}

RendezvousServer::RendezvousServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RendezvousServer::~RendezvousServer() { shutdown(); }

int RendezvousServer::port() const { return impl_->port; }

void RendezvousServer::set_run_tokens(RunTokens tokens) {
  impl_->credentials->set_run_tokens(std::move(tokens));
}
const RestoreSummary& RendezvousServer::restored() const { return impl_->restored; }

void RendezvousServer::lead(std::shared_ptr<RunStore> store,
                            std::function<void(const RestoreSummary&)> done) {
  if (!impl_->stopped && impl_->server) set_leading(*impl_->server, true);
  boost::asio::post(impl_->core->io(), [core = std::weak_ptr<Core>(impl_->core),
                                        store = std::move(store), done = std::move(done)] {
    auto c = core.lock();
    if (!c || !c->standby()) return;
    RestoreSummary summary = c->lead(store);
    if (done && !c->standby()) done(summary);
  });
}

void RendezvousServer::set_leader(std::string name) {
  boost::asio::post(impl_->core->io(), [core = std::weak_ptr<Core>(impl_->core),
                                        name = std::move(name)] {
    if (auto c = core.lock()) c->set_leader(name);
  });
}

const std::string& RendezvousServer::local_store_target() const { return impl_->local_target; }

std::shared_ptr<LocalServer> RendezvousServer::local() const { return impl_->local; }

void RendezvousServer::post_status(const std::string& run_id,
                                   std::function<void(v1::StatusReply)> done) {
  boost::asio::post(impl_->core->io(), [core = std::weak_ptr<Core>(impl_->core), run_id,
                                        done = std::move(done)] {
    auto c = core.lock();
    if (!c) return;
    v1::StatusReply reply;
    c->fill_status(run_id, reply);
    done(std::move(reply));
  });
}

void RendezvousServer::shutdown(std::chrono::milliseconds grace) {
  if (impl_->stopped) return;
  impl_->stopped = true;
  impl_->core->freeze();
  // On demand: no connection is taken from here on; what gRPC was handed is served on.
  if (impl_->on_demand) impl_->on_demand->stop();
  grpc::Server* server = impl_->on_demand ? impl_->on_demand->server() : impl_->server.get();
  if (server != nullptr) set_serving(*server, false);  // probes see it go first
  if (impl_->metrics_collector != 0) {
    impl_->metrics_registry->remove_collector(impl_->metrics_collector);
  }
  // Calls that would otherwise wait past the deadline end first: status calls waiting for the
  // io thread (which may have stopped) and parked store waits (up to their own timeouts).
  impl_->core->stop_pending();
  impl_->local->shutdown();
  impl_->store->shutdown();
  if (impl_->relay) impl_->relay->shutdown();
  if (server == nullptr) return;  // gRPC never started
  server->Shutdown(std::chrono::system_clock::now() + grace);
  server->Wait();
}

void route_grpc_logs_to_spdlog() {
  gpr_set_log_function([](gpr_log_func_args* args) { spdlog::debug("grpc: {}", args->message); });
}

}  // namespace muster::rendezvous

