// The agent's wiring: the session machine's actions carried out with a rendezvous stream,
// three timers and the worker group; their events fed back to it. Every rule is the
// machine's (session_machine.h); nothing here decides.
#include "muster/agent/agent.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <fstream>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "muster/agent/failure.h"
#include "muster/agent/file_timer.h"
#include "muster/agent/line_splitter.h"
#include "muster/agent/link_watch.h"
#include "muster/agent/preflight.h"
#include "muster/agent/worker_group.h"
#include "muster/rendezvous/client.h"
#include "muster/ops/host_id.h"
#include "muster/rendezvous/resolve.h"
#include "muster/rendezvous/store_relay.h"

namespace muster::agent {
namespace {

namespace asio = boost::asio;
using session::Action;
using session::Actions;
using session::Timer;

// A free TCP port on this host, for MASTER_PORT (as torchrun: bind port 0, then release).
int pick_free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof addr;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

// Every Join this node sends (the machine adds the re-attach fields, the sender the port).
v1::Join join_template(const AgentOptions& o) {
  v1::Join j;
  j.set_run_id(o.run_id);
  j.set_node_id(o.node_id);
  j.set_host(o.host);
  j.set_local_world_size(o.nproc_per_node);
  j.set_min_nodes(o.min_nodes);
  j.set_max_nodes(o.max_nodes);
  j.set_token(o.token);
  j.set_requested_rank(o.requested_rank);
  j.set_max_restarts(o.max_restarts);
  const auto& t = o.rdzv_timeouts;
  j.set_join_timeout_ms(t.join_timeout.count());
  j.set_last_call_timeout_ms(t.last_call_timeout.count());
  j.set_keep_alive_interval_ms(t.keep_alive_interval.count());
  j.set_keep_alive_max_attempt(t.keep_alive_max_attempt);
  // How long this node may take to stop its workers after a Restart: the server waits that
  // long for it before a round closes without it.
  j.set_shutdown_timeout_ms(o.shutdown_timeout.count());
  j.set_hang_timeout_ms(o.hang_timeout.count());
  j.set_watch_stragglers(o.watch_stragglers);
  j.set_exclude_stragglers(o.exclude_stragglers);
  j.set_straggler_cooldown_ms(o.straggler_cooldown.count());
  j.set_max_restarts_without_progress(o.max_restarts_without_progress);
  j.set_restart_budget_reset_after_steps(o.restart_budget_reset_after_steps);
  j.set_reattach_timeout_ms(t.reattach_timeout.count());
  return j;
}

session::Config session_config(const AgentOptions& o) {
  session::Config c;
  c.run_id = o.run_id;
  c.endpoints.push_back({o.rdzv_target, o.rdzv_name.empty() ? o.rdzv_target : o.rdzv_name});
  c.endpoints.insert(c.endpoints.end(), o.rdzv_more.begin(), o.rdzv_more.end());
  c.wait_for_server = o.wait_for_server;
  c.connect_timeout = o.connect_timeout;
  c.keep_alive_interval = o.rdzv_timeouts.keep_alive_interval;
  c.keep_alive_max_attempt = o.rdzv_timeouts.keep_alive_max_attempt;
  c.nproc_per_node = o.nproc_per_node;
  c.in_place = o.in_place;
  c.in_place_timeout = o.in_place_timeout;
  c.preflight = o.preflight;
  c.preflight_wait = preflight::kStoreWait;
  c.join = join_template(o);
  return c;
}

v1::AgentMsg progress_message(const std::vector<rendezvous::RankProgress>& ranks,
                              rendezvous::StallClock::time_point now) {
  v1::AgentMsg msg;
  v1::Progress* p = msg.mutable_progress();
  for (const rendezvous::RankProgress& r : ranks) {
    v1::RankProgress* x = p->add_ranks();
    x->set_rank(r.rank);
    x->set_local_rank(r.local_rank);
    x->set_pid(r.pid);
    x->set_step(r.step);
    x->set_reports(r.reports);
    x->set_phase(r.phase);
    for (std::uint64_t ns : r.kind_ns) x->add_kind_ns(ns);
    x->set_still_ms(std::chrono::duration_cast<std::chrono::milliseconds>(now - r.changed).count());
  }
  return msg;
}

spdlog::level::level_enum spdlog_level(session::Level l) {
  switch (l) {
    case session::Level::kDebug:
      return spdlog::level::debug;
    case session::Level::kInfo:
      return spdlog::level::info;
    case session::Level::kWarn:
      return spdlog::level::warn;
    case session::Level::kError:
      break;
  }
  return spdlog::level::err;
}

}  // namespace

class Agent::Impl {
 public:
  Impl(asio::io_context& io, AgentOptions opts)
      : io_(io),
        opts_(std::move(opts)),
        machine_(session_config(opts_)),
        group_(io, opts_,
               {[this](const v1::WorkerFailure& f) { apply(machine_.on_worker_failed(f, now())); },
                [this](const v1::WorkerFailure& f) { apply(machine_.on_hang_dumped(f, now())); },
                [this] { apply(machine_.on_group_gone(group_.size(), now())); },
                [this](const std::vector<rendezvous::RankProgress>& ranks,
                       rendezvous::StallClock::time_point at) {
                  v1::AgentMsg msg = progress_message(ranks, at);
                  if (machine_.assignment().watch_stragglers()) add_links(msg, ranks);
                  apply(machine_.on_progress(std::move(msg), now()));
                },
                [this](int lr) { apply(machine_.on_worker_declared(lr, now())); },
                [this](int lr, int round) {
                  apply(machine_.on_worker_resumed(lr, round, now()));
                }}),
        timers_{asio::steady_timer(io), asio::steady_timer(io), asio::steady_timer(io),
                asio::steady_timer(io), asio::steady_timer(io), asio::steady_timer(io),
                asio::steady_timer(io)} {}

  int run() {
    if (!opts_.file_timer_path.empty()) {
      auto timers = FileTimerServer::start(
          io_, opts_.file_timer_path,
          [this](const FileTimerTable::Expired& e) { group_.on_file_timer(e); });
      if (!timers.ok()) {
        spdlog::error("{}", std::string(timers.status().message()));
        return 1;
      }
      file_timers_ = std::move(*timers);
      group_.set_file_timers(file_timers_.get());
    }
    if (opts_.in_place && opts_.spares > 0) {
      // --spares: this node's workers start warm, before it joins (a newcomer's included),
      // so that the survivors of a run it joins wait for no interpreter (worker_group.h).
      v1::Assignment first;
      first.set_world_size(opts_.nproc_per_node);
      first.set_group_world_size(1);
      group_.warm_up(first, round_spec(first, open_store_relay(first)), [this] {
        if (!exiting_) apply(machine_.start(now()));
      });
    } else {
      apply(machine_.start(now()));
    }
    io_.run();
    if (client_) client_->close();
    if (probe_) probe_->close();
    return machine_.exit_code();
  }

  // A signal while the workers warm up (--spares) stops the spares and exits: the machine
  // has nothing joined yet, and its Exit ends the warm-up (exiting_).
  void on_signal(int sig) { apply(machine_.on_signal(sig, now())); }
  bool failed() const { return machine_.failed(); }

 private:
  static session::Time now() { return session::Clock::now(); }

  void apply(Actions actions) {
    for (Action& a : actions) std::visit([this](auto& x) { carry_out(x); }, a);
  }

  // A stream to `endpoint`; its messages and end go to the machine as the current stream's,
  // or as the probe's while *probe holds (AdoptProbe turns it off).
  std::unique_ptr<rendezvous::SessionClient> open_client(const RdzvEndpoint& endpoint,
                                                         bool wait_for_ready,
                                                         std::chrono::milliseconds connect_timeout,
                                                         std::shared_ptr<bool> probe) {
    auto client = std::make_unique<rendezvous::SessionClient>(
        io_,
        [this, probe](const v1::ServerMsg& m) {
          apply(*probe ? machine_.on_probe_message(m, now()) : machine_.on_message(m, now()));
        },
        [this, probe](const absl::Status& s) {
          apply(*probe ? machine_.on_probe_closed(s, now()) : machine_.on_stream_closed(s, now()));
        });
    rendezvous::SessionClient::OpenOptions opts;
    opts.target = endpoint.target;
    opts.name = endpoint.name;
    opts.wait_for_ready = wait_for_ready;
    opts.connect_timeout = connect_timeout;
    opts.liveness_window = std::chrono::duration_cast<std::chrono::milliseconds>(
        opts_.rdzv_timeouts.keep_alive_interval * opts_.rdzv_timeouts.keep_alive_max_attempt);
    opts.on_ready = [this, probe] {
      if (!*probe) apply(machine_.on_stream_ready(now()));
    };
    opts.tls = opts_.tls;
    if (opts_.local_rdzv && endpoint.target == opts_.rdzv_target) opts.local = opts_.local_rdzv;
    opts.explain_timeout = !*probe;  // a probe's many short attempts must end on time
    client->open(std::move(opts));
    return client;
  }
  void send_on(rendezvous::SessionClient* client, v1::AgentMsg& msg) {
    if (msg.has_join()) msg.mutable_join()->set_master_port_candidate(pick_free_port());
    if (client != nullptr) client->send(msg);
  }

  void carry_out(session::OpenStream& o) {
    if (client_) client_->close();
    client_ = open_client(o.endpoint, o.wait_for_ready, o.connect_timeout,
                          std::make_shared<bool>(false));
  }
  void carry_out(session::CloseStream&) {
    if (client_) client_->close();
  }
  void carry_out(session::OpenProbe& o) {
    if (probe_) probe_->close();
    probe_role_ = std::make_shared<bool>(true);
    probe_ = open_client(o.endpoint, true, o.connect_timeout, probe_role_);
    for (v1::AgentMsg& m : o.msgs) send_on(probe_.get(), m);
  }
  void carry_out(session::CloseProbe&) {
    if (probe_) probe_->close();
    probe_.reset();
  }
  void carry_out(session::AdoptProbe&) {
    if (client_) client_->close();
    client_ = std::move(probe_);
    if (probe_role_) *probe_role_ = false;
    probe_role_.reset();
  }
  void carry_out(session::Send& s) { send_on(client_.get(), s.msg); }
  void carry_out(session::StartWorkers& s) { start_workers(s.assignment); }
  void carry_out(session::RunPreflight& p) { start_preflight(p.assignment); }
  void start_workers(const v1::Assignment& a) {
    WorkerGroup::Started started = group_.start(a, round_spec(a, open_store_relay(a)));
    if (started.failure) {
      apply(machine_.on_spawn_failed(*started.failure, now()));
    } else {
      apply(machine_.on_workers_started(started.workers, now()));
    }
  }
  void carry_out(session::StopWorkers& s) {
    group_.stop(s.signal);
    if (group_.gone()) apply(machine_.on_group_gone(group_.size(), now()));
  }
  void carry_out(session::AbortWorkers& a) { group_.abort_all(a.round); }
  void carry_out(session::ReformWorkers& r) {
    WorkerGroup::Started started =
        group_.reform(r.assignment, round_spec(r.assignment, open_store_relay(r.assignment)),
                      r.lost_ranks, r.replace);
    if (started.failure) {
      apply(machine_.on_spawn_failed(*started.failure, now()));
    } else {
      apply(machine_.on_workers_reformed(started.workers, now()));
    }
  }
  void carry_out(session::KillWorkers&) { group_.kill_now(); }
  void carry_out(session::ReleaseWorkers&) { group_.release(); }
  void carry_out(session::DumpStalled& d) { group_.dump_stalled(d.rank, d.description); }
  void carry_out(session::ArmTimer& t) {
    asio::steady_timer& timer = timers_[static_cast<int>(t.timer)];
    timer.expires_at(t.at);
    timer.async_wait([this, which = t.timer](const boost::system::error_code& ec) {
      if (!ec) apply(machine_.on_timer(which, now()));
    });
  }
  void carry_out(session::CancelTimer& t) { timers_[static_cast<int>(t.timer)].cancel(); }
  void carry_out(session::Emit& e) {
    e.event.wall = std::chrono::system_clock::now();
    for (const auto& sink : opts_.event_sinks) sink(e.event);
  }
  void carry_out(session::Log& l) { spdlog::log(spdlog_level(l.level), "{}", l.text); }
  void carry_out(session::PrintFailure& p) {
    const v1::Fail& fail = p.fail;
    std::vector<v1::WorkerFailure> others(fail.others().begin(), fail.others().end());
    write_all(opts_.stderr_fd,
              format_failure_summary(opts_.entrypoint_name, fail.root_cause(), others));
    if (!opts_.python_interpreter.empty()) {
      write_all(opts_.stderr_fd,
                group_.python_hint(fail.root_cause(), machine_.assignment().group_rank()));
    }
    if (!opts_.own_error_file.empty()) {
      // As torchrun: launch's own error file names the root cause, for whoever runs it.
      std::ofstream(opts_.own_error_file) << error_file_json(fail.root_cause());
    }
  }
  void carry_out(session::Exit& x) {
    if (x.signal != 0 && !opts_.own_error_file.empty()) {
      // As torchrun's @record main: the SignalException that stopped it.
      write_signal_exception(opts_.own_error_file, x.signal);
    }
    exiting_ = true;
    group_.end();
    relay_.reset();  // before a server this process hosts closes
    for (auto& t : timers_) t.cancel();
    io_.stop();
  }

  // What every worker of the round shares in its environment (the group adds each one's
  // local rank and error file); `relay_port`: the round's store relay (open_store_relay), 0:
  // none.
  WorkerEnvSpec round_spec(const v1::Assignment& a, int relay_port) const {
    const Endpoints& endpoints = machine_.endpoints();
    WorkerEnvSpec spec;
    spec.local_world_size = opts_.nproc_per_node;
    spec.rank_offset = a.rank_offset();
    spec.world_size = a.world_size();
    spec.group_rank = a.group_rank();
    spec.group_world_size = a.group_world_size();
    spec.role = opts_.role;
    spec.master_addr = opts_.master_addr.empty() ? a.master_addr() : opts_.master_addr;
    spec.master_port = opts_.master_addr.empty() ? a.master_port() : opts_.master_port;
    if (relay_port > 0) {
      spec.master_addr = "127.0.0.1";
      spec.master_port = relay_port;
      spec.use_agent_store = true;
    }
    spec.restart_count = a.restart_count();
    spec.max_restarts = opts_.max_restarts;
    spec.run_id = opts_.run_id;
    // The store's Unix-domain socket when the server runs on this machine and network
    // namespace (faster than TCP loopback), else the address the agent was given.
    const bool store_is_rdzv = opts_.store_addr == opts_.rdzv_target;
    spec.store_addr =
        store_target_for_workers(a.store_local_target(), a.server_host_identity(), host_identity_,
                                 store_is_rdzv ? endpoints.current().target : opts_.store_addr);
    // Several endpoints (replicas): the others too, in the order this agent would try them,
    // so a worker's store calls follow a failover (GrpcStoreOptions::target).
    if (store_is_rdzv) {
      for (std::size_t k = 1; k < endpoints.size(); ++k) {
        absl::StrAppend(&spec.store_addr, ";", endpoints.after(k).target);
      }
    }
    spec.round = a.round();
    spec.node_addr = opts_.host;
    spec.token = opts_.token;
    spec.tls = opts_.tls.files;
    spec.signals_to_handle = opts_.signals_to_handle;
    spec.virtual_local_rank = opts_.virtual_local_rank;
    return spec;
  }

  // docs/stragglers.md, "Slow links": how fast the workers' connections to other hosts took
  // data since the last report, with the report.
  void add_links(v1::AgentMsg& msg, const std::vector<rendezvous::RankProgress>& ranks) {
    std::vector<pid_t> pids;
    for (const rendezvous::RankProgress& r : ranks) {
      if (r.pid > 0) pids.push_back(r.pid);
    }
    for (v1::LinkRate& l : links_.sample(pids)) {
      if (msg.progress().links_size() >= rendezvous::limits::kMaxLinkReports) break;
      *msg.mutable_progress()->add_links() = std::move(l);
    }
  }

  // docs/stragglers.md, "Pre-flight": on a thread of its own, through the run's store; the
  // verdict goes back to the machine (session_preflight.cc), which decides what follows.
  void start_preflight(const v1::Assignment& a) {
    const WorkerEnvSpec spec = round_spec(a, open_store_relay(a));
    rendezvous::GrpcStoreOptions store;
    store.target = spec.store_addr;
    store.run_id = opts_.run_id;
    store.token = opts_.token;
    store.tls = opts_.tls;
    preflight::Options o;
    o.node = a.group_rank();
    o.nodes = a.group_world_size();
    o.host = opts_.host;
    spdlog::info("pre-flight: node {} of {}: measuring compute and the links to the others",
                 o.node, o.nodes);
    preflight_ = std::make_unique<preflight::Background>(
        std::move(store), a.store_prefix(), o,
        [this, a](absl::StatusOr<preflight::Verdict> v) {
          asio::post(io_, [this, a, v = std::move(v)] { after_preflight(a, v); });
        });
  }
  void after_preflight(const v1::Assignment& a, const absl::StatusOr<preflight::Verdict>& v) {
    if (exiting_) return;
    session::PreflightVerdict verdict;
    if (!v.ok()) {
      verdict.ran = false;
      verdict.error = std::string(v.status().message());
    } else {
      const int me = a.group_rank();
      spdlog::info("pre-flight: this node's link {:.1f} MB/s (median {:.1f}), compute {:.0f} "
                   "(median {:.0f})",
                   v->link[me], v->link_median, v->compute[me], v->compute_median);
      for (int i = 0; i < a.group_world_size(); ++i) {
        if (!v->named(i)) continue;
        if (i == me) {
          verdict.named_me = absl::StrCat("pre-flight failed on ", opts_.host, ": ", v->why(me),
                                          "; this node leaves the run");
        } else {
          verdict.named_others.push_back(absl::StrCat("node ", i, " (", v->why(i), ")"));
        }
      }
    }
    apply(machine_.on_preflight_done(a.round(), verdict, now()));
  }

  // The loopback port of the round's TCPStore-protocol listener (store_relay.h), opened here
  // (the relay itself started with the first round that has one); 0: none, the workers host
  // their own store (a MASTER_ADDR of the user's, use_agent_store off, or a server without
  // relays).
  int open_store_relay(const v1::Assignment& a) {
    if (!opts_.master_addr.empty() || !opts_.use_agent_store || !a.store_relay()) return 0;
    if (!relay_) {
      rendezvous::StoreRelayOptions o;
      const Endpoints& endpoints = machine_.endpoints();
      // The server's own Unix-domain socket when it runs here (as the workers' gRPC store).
      if (!a.store_local_target().empty() && a.server_host_identity() == host_identity_) {
        o.targets.push_back(a.store_local_target());
      }
      for (std::size_t k = 0; k < endpoints.size(); ++k) o.targets.push_back(endpoints.after(k).target);
      o.run_id = opts_.run_id;
      o.token = opts_.token;
      o.tls = opts_.tls;
      o.connect_early = !opts_.local_rdzv;  // a server elsewhere: connect while workers start
      o.cache = opts_.store_cache;
      if (!o.cache) {
        spdlog::info("store relay: every read of the workers goes to the server "
                     "(--rdzv_conf store_cache=false)");
      }
      auto relay = rendezvous::StoreRelay::start(std::move(o));
      if (!relay.ok()) {
        spdlog::error("{}", std::string(relay.status().message()));
        return 0;
      }
      relay_ = std::move(*relay);
    }
    absl::StatusOr<int> port = relay_->world(a.round());
    if (!port.ok()) {
      spdlog::error("{}; the workers host their own store", std::string(port.status().message()));
      return 0;
    }
    return *port;
  }

  asio::io_context& io_;
  const AgentOptions opts_;
  session::SessionMachine machine_;
  WorkerGroup group_;
  bool exiting_ = false;  // Exit carried out: a warm-up that ends now joins nothing
  asio::steady_timer timers_[session::kTimers];  // by session::Timer
  static_assert(session::kTimers == 7, "one timer per session::Timer in the constructor");
  std::unique_ptr<rendezvous::SessionClient> client_;
  // The probe (session_machine.h), and whether its callbacks still go to the machine as the
  // probe's.
  std::unique_ptr<rendezvous::SessionClient> probe_;
  std::shared_ptr<bool> probe_role_;
  std::unique_ptr<FileTimerServer> file_timers_;
  const std::string host_identity_ = ops::host_identity();
  std::unique_ptr<rendezvous::StoreRelay> relay_;  // the workers' TCPStore, relayed
  LinkWatch links_;  // the straggler watch's link rates
  // --preflight: the measure under way (session_preflight.cc decides what follows).
  std::unique_ptr<preflight::Background> preflight_;
};

Agent::Agent(asio::io_context& io, AgentOptions options)
    : impl_(std::make_unique<Impl>(io, std::move(options))) {}

Agent::~Agent() = default;

int Agent::run() { return impl_->run(); }

void Agent::on_signal(int sig) { impl_->on_signal(sig); }

bool Agent::failed() const { return impl_->failed(); }

}  // namespace muster::agent
