#include "node_job.h"

#include <signal.h>
#include <spdlog/spdlog.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <boost/asio/post.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <cstdio>
#include <filesystem>
#include <future>
#include <memory>
#include <optional>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "muster/agent/agent.h"
#include "muster/agent/agent_metrics.h"
#include "muster/agent/failure.h"
#include "muster/agent/numa.h"
#include "muster/agent/worker_env.h"
#include "muster/launcher/cluster.h"
#include "muster/launcher/event_log.h"
#include "health_check.h"
#include "muster/launcher/python.h"
#include "muster/ops/exit_codes.h"
#include "muster/ops/http_server.h"
#include "muster/ops/json_lines.h"
#include "muster/ops/metrics.h"
#include "muster/status/status_format.h"
#include "muster/rendezvous/resolve.h"
#include "muster/rendezvous/server.h"

namespace muster::launcher {
namespace {

using ops::ExitError;

[[noreturn]] void leave(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  ::_exit(code);
}

[[noreturn]] void leave_with(const ExitError& e) { leave(ops::report("launch", e)); }

std::string random_uuid() {
  std::random_device rd;
  std::uint32_t w[4] = {rd(), rd(), rd(), rd()};
  w[1] = (w[1] & 0xffff0fffu) | 0x00004000u;  // version 4
  w[2] = (w[2] & 0x3fffffffu) | 0x80000000u;  // variant 1
  return absl::StrFormat("%08x-%04x-%04x-%04x-%04x%08x", w[0], w[1] >> 16, w[1] & 0xffff,
                         w[2] >> 16, w[2] & 0xffff, w[3]);
}

// Whether a worker wrote its error file (attempt_<k>/<local_rank>/error.json) under `dir`.
bool holds_error_file(const std::string& dir) {
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    if (it->path().filename() == "error.json") return true;
  }
  return false;
}

// --numa-binding: one plan for the whole job (nproc_per_node is fixed), from this host's
// topology; a plan that cannot be made (exclusive with more ranks than CPUs) is a usage error.
std::vector<agent::NumaBinding> numa_plan(const LaunchConfig& cfg) {
  if (!cfg.numa_mode) return {};
  auto plan = agent::plan_numa_binding(*cfg.numa_mode, agent::read_topology(), cfg.nproc_per_node);
  if (!plan.ok()) leave_with({ops::kExitUsage, plan.status()});
  for (std::size_t lr = 0; lr < plan->size(); ++lr) {
    spdlog::info("--numa_binding={}: local rank {} on CPUs {}, memory node {}", cfg.numa_binding,
                 lr, agent::cpu_list_text((*plan)[lr].cpus), (*plan)[lr].memory_node);
  }
  return std::move(*plan);
}

// --event_log and --metrics_port: this node's events and series and, when it hosts the
// rendezvous, the server's (made before the server, which adds to them).
struct Observers {
  std::unique_ptr<ops::JsonLinesFile> event_log;
  ops::Registry metrics;
  std::unique_ptr<ops::HttpServer> metrics_http;
};

void open_observers(const LaunchConfig& cfg, Observers& o) {
  if (!cfg.event_log.empty()) {
    auto opened = ops::JsonLinesFile::open(cfg.event_log, "--event_log");
    if (!opened.ok()) leave_with({ops::kExitUsage, opened.status()});
    o.event_log = std::move(*opened);
  }
  if (cfg.metrics_port >= 0) {
    ops::add_process_metrics(o.metrics);
    auto http = ops::HttpServer::start("0.0.0.0", cfg.metrics_port, ops::metrics_routes(o.metrics));
    if (!http.ok()) {
      leave_with({ops::kExitRuntime,
                  absl::Status(http.status().code(),
                               absl::StrCat("--metrics_port: ", http.status().message()))});
    }
    o.metrics_http = std::move(*http);
    spdlog::info("metrics on port {}", o.metrics_http->port());
  }
}

// The rendezvous server this node uses, and whether it hosts it.
struct Rendezvous {
  std::unique_ptr<rendezvous::RendezvousServer> server;  // hosted here; else null
  std::string name;    // the server as messages name it
  std::string target;  // and as gRPC reaches it: an address, never a name
  std::vector<agent::RdzvEndpoint> more;  // the rest of an --rdzv_endpoint list
};

rendezvous::ServerOptions server_options(const LaunchConfig& cfg, Observers& o) {
  rendezvous::ServerOptions opts;
  opts.token = cfg.rdzv_conf.token;
  opts.tls = cfg.server_tls;
  opts.timeouts = cfg.rdzv_conf.timeouts;
  if (o.event_log) {
    opts.event_sinks.push_back([log = o.event_log.get()](const rendezvous::RunEvent& e) {
      log->write_line(muster::status::event_json(e, muster::status::wall_time_of(e)));
    });
  }
  if (o.metrics_http) opts.metrics = &o.metrics;
  return opts;
}

// One name looked up through the system resolver (each lookup bounded): gRPC is given the
// address (docs/launch.md, "Names"). A name that does not exist yet (a pod's, published late)
// is looked up again every limits::kNameRetryInterval for up to read_timeout, signals served
// meanwhile (one ends launch at once, 128+N).
std::vector<std::string> resolve_endpoint(const std::string& host, const LaunchConfig& cfg,
                                          boost::asio::io_context& io,
                                          std::function<void(int)>& on_signal) {
  const auto start = std::chrono::steady_clock::now();
  const auto wait = cfg.rdzv_conf.read_timeout;
  bool waiting = false;
  for (;;) {
    auto addresses = rendezvous::resolve_host(host);
    const auto waited = std::chrono::steady_clock::now() - start;
    const double waited_s = std::chrono::duration<double>(waited).count();
    if (addresses.ok()) {
      if (waiting) spdlog::warn("'{}' resolves now, after {:.1f} s", host, waited_s);
      return std::move(*addresses);
    }
    if (addresses.status().code() != absl::StatusCode::kNotFound || waited >= wait) {
      leave_with({ops::kExitRuntime,
                  absl::Status(addresses.status().code(),
                               absl::StrCat("--rdzv_endpoint: ", addresses.status().message(),
                                            waiting ? absl::StrFormat(" (looked up for %.0f s)", waited_s)
                                                    : std::string()))});
    }
    if (!waiting) {
      spdlog::warn("{}; looking it up again every {} ms for up to {} s (read_timeout)",
                   std::string(addresses.status().message()), rendezvous::limits::kNameRetryInterval.count(),
                   std::chrono::duration_cast<std::chrono::seconds>(wait).count());
      waiting = true;
      on_signal = [](int sig) { leave(128 + sig); };
    }
    io.restart();
    io.run_for(rendezvous::limits::kNameRetryInterval);
  }
}

// torchrun's is_host rule: static node 0, or the agent on the endpoint's host that binds its
// port first. The others connect.
Rendezvous host_or_reach(const LaunchConfig& cfg, boost::asio::io_context& io,
                         std::function<void(int)>& on_signal, rendezvous::ServerOptions opts) {
  Rendezvous r;
  if (cfg.mode == RdzvMode::kEmbedded) {
    opts.listen_address = "127.0.0.1:0";
    // Its agent is in-process (AgentOptions::local_rdzv): gRPC waits for a worker's store
    // call or a status query.
    opts.start_grpc_on_demand = true;
    auto started = rendezvous::RendezvousServer::start(io, opts);
    if (!started.ok()) leave_with({ops::kExitRuntime, started.status()});
    r.server = std::move(*started);
    r.name = r.target = absl::StrCat("127.0.0.1:", r.server->port());
    return r;
  }
  const std::vector<std::string> addresses = resolve_endpoint(cfg.endpoint.host, cfg, io, on_signal);
  const bool try_host = cfg.rdzv_conf.is_host.value_or(
      cfg.mode == RdzvMode::kStatic ? cfg.node_rank == 0
                                    : is_local_host(addresses));
  r.name = cfg.endpoint.to_string();
  r.target = rendezvous::grpc_address_target(addresses.front(), cfg.endpoint.port);
  // The others of a list are looked up now too: an agent that loses its server moves on to
  // them without a lookup.
  for (const auto& e : cfg.more_endpoints) {
    r.more.push_back(
        {rendezvous::grpc_address_target(resolve_endpoint(e.host, cfg, io, on_signal).front(), e.port),
         e.to_string()});
  }
  if (!try_host) return r;
  opts.listen_address = rendezvous::is_ip_literal(cfg.endpoint.host)
                            ? r.name
                            : absl::StrCat("0.0.0.0:", cfg.endpoint.port);
  auto started = rendezvous::RendezvousServer::start(io, opts);
  if (started.ok()) {
    r.server = std::move(*started);
    spdlog::info("hosting the rendezvous server on {}", opts.listen_address);
  } else if (cfg.mode == RdzvMode::kStatic) {
    leave_with({ops::kExitRuntime, started.status()});  // node 0 must host
  } else {
    spdlog::info("{}; another agent hosts it, connecting", std::string(started.status().message()));
  }
  return r;
}

// The attempt_<k>/<local_rank>/ folders (error files, logs) live in a private temporary folder
// removed at exit; with --log_dir, or when --redirects/--tee/--duplicate_*_filters ask for log
// files, in a folder that is kept: <dir>/<run_id>_<random>, torchrun's layout.
struct LogFolder {
  std::string path;
  bool keep = false;
};

LogFolder make_log_folder(const LaunchConfig& cfg, const std::string& run_id,
                          const std::map<std::string, std::string>& env) {
  auto nonzero = [](const std::vector<int>& v) {
    return std::any_of(v.begin(), v.end(), [](int x) { return x != 0; });
  };
  const bool want_logs = nonzero(cfg.redirect_of) || nonzero(cfg.tee_of) ||
                         !cfg.duplicate_stdout_filters.empty() ||
                         !cfg.duplicate_stderr_filters.empty();
  auto tmp = env.find("TMPDIR");
  const std::string tmp_dir = tmp != env.end() && !tmp->second.empty() ? tmp->second : "/tmp";
  LogFolder f;
  f.keep = !cfg.log_dir.empty() || want_logs;
  const std::string base = cfg.log_dir.empty() ? tmp_dir : cfg.log_dir;
  std::error_code ec;
  std::filesystem::create_directories(base, ec);
  f.path = cfg.log_dir.empty() ? absl::StrCat(base, f.keep ? "/muster_logs_XXXXXX" : "/muster_XXXXXX")
                               : absl::StrCat(base, "/", run_id, "_XXXXXX");
  if (::mkdtemp(f.path.data()) == nullptr) {
    leave_with({ops::kExitRuntime, absl::InternalError(absl::StrCat("cannot create a folder under ", base))});
  }
  if (f.keep) spdlog::warn("worker logs: {}", f.path);
  return f;
}

// What the agent is told about its rendezvous and run.
void set_rendezvous(agent::AgentOptions& opts, const LaunchConfig& cfg, const Rendezvous& r) {
  opts.rdzv_target = r.target;
  opts.rdzv_name = r.name;
  opts.rdzv_more = r.more;
  // The embedded server (--standalone) is this process's: its agent needs no socket to it.
  if (cfg.mode == RdzvMode::kEmbedded && r.server) opts.local_rdzv = r.server->local();
  opts.wait_for_server = r.server == nullptr;
  opts.connect_timeout = cfg.rdzv_conf.read_timeout;
  opts.token = cfg.rdzv_conf.token;
  opts.tls = cfg.client_tls;
  opts.rdzv_timeouts = cfg.rdzv_conf.timeouts;
  opts.use_agent_store = cfg.rdzv_conf.use_agent_store;
  opts.store_cache = cfg.rdzv_conf.store_cache;
  opts.store_addr = r.target;
  if (!cfg.standalone && cfg.rdzv_backend == "static") {
    opts.master_addr = cfg.master_addr;
    opts.master_port = cfg.master_port;
    opts.requested_rank = cfg.node_rank;
  }
  opts.min_nodes = cfg.min_nodes;
  opts.max_nodes = cfg.max_nodes;
  opts.max_restarts = cfg.max_restarts;
  opts.max_restarts_without_progress = cfg.max_restarts_without_progress;
  opts.restart_budget_reset_after_steps = cfg.restart_budget_reset_after_steps;
  opts.hang_timeout = cfg.hang_timeout;
  opts.watch_stragglers = cfg.watch_stragglers || cfg.exclude_stragglers;
  opts.exclude_stragglers = cfg.exclude_stragglers;
  opts.preflight = cfg.preflight;
  opts.straggler_cooldown = cfg.straggler_cooldown;
  opts.in_place = cfg.in_place || cfg.rdzv_conf.in_place;
  opts.in_place_timeout = cfg.rdzv_conf.in_place_timeout;
  opts.spares = opts.in_place ? cfg.spares : 0;
  opts.shutdown_timeout = cfg.shutdown_timeout;
}

// What the agent is told about its workers and their output.
void set_workers(agent::AgentOptions& opts, const LaunchConfig& cfg, const Entrypoint& entry,
                 std::map<std::string, std::string>& env) {
  opts.nproc_per_node = cfg.nproc_per_node;
  opts.role = cfg.role;
  opts.program_path = entry.path;
  opts.argv = entry.argv;
  opts.entrypoint_name = entry.name;
  if (!entry.python_reason.empty()) {
    std::error_code ec;
    opts.python_interpreter = absl::StrCat(entry.path, " (", entry.python_reason, ")");
    const std::string exe = std::filesystem::read_symlink("/proc/self/exe", ec).string();
    opts.python_progress_hook = progress_hook_pythonpath(exe);
    opts.python_dir = muster_python_dir(exe);
  }
  if (auto path = env.find("PATH"); path != env.end()) {
    opts.gdb_path = find_executable("gdb", path->second).value_or("");
  }
  opts.signals_to_handle = cfg.signals_to_handle;
  opts.virtual_local_rank = cfg.virtual_local_rank;
  opts.redirect_of = cfg.redirect_of;
  opts.tee_of = cfg.tee_of;
  opts.console_of = cfg.console_of;
  opts.duplicate_stdout_filters = cfg.duplicate_stdout_filters;
  opts.duplicate_stderr_filters = cfg.duplicate_stderr_filters;
  opts.prefix_template = cfg.log_line_prefix_template;
  if (auto it = env.find("TORCHELASTIC_ERROR_FILE"); it != env.end()) {
    opts.own_error_file = it->second;
  }
  // torchrun's file-timer watchdog (docs/launch.md, "File timer"): the FIFO is the one named
  // by TORCHELASTIC_TIMER_FILE, else one in launch's own folder; workers are told where.
  if (auto it = env.find("TORCHELASTIC_ENABLE_FILE_TIMER"); it != env.end() && it->second == "1") {
    auto named = env.find("TORCHELASTIC_TIMER_FILE");
    opts.file_timer_path = named != env.end() && !named->second.empty()
                               ? named->second
                               : opts.error_dir + "/watchdog_timer";
    env["TORCHELASTIC_TIMER_FILE"] = opts.file_timer_path;
  }
  if (cfg.nproc_per_node > 1 && env.count("OMP_NUM_THREADS") == 0) {
    spdlog::info("setting OMP_NUM_THREADS=1 for each worker (it was unset)");
  }
}

void add_sinks(agent::AgentOptions& opts, Observers& o) {
  if (o.event_log) {
    opts.event_sinks.push_back(
        [log = o.event_log.get(), source = EventLogSource{opts.run_id, opts.node_id, opts.host}](
            const agent::AgentEvent& e) { log->write_line(event_log_line(e, source)); });
  }
  if (o.metrics_http) opts.event_sinks.push_back(agent::agent_metrics_sink(o.metrics));
}

// An agent started by launch --hosts: its stdin is the driver's (through ssh); when it ends,
// the driver or its session is gone, and this host stops (docs/cluster.md).
class StdinWatch {
 public:
  StdinWatch(boost::asio::io_context& io, std::function<void(int)>& on_signal)
      : sd_(io, ::dup(STDIN_FILENO)), on_signal_(on_signal) {
    read();
  }

 private:
  void read() {
    sd_.async_read_some(boost::asio::buffer(buf_), [this](const boost::system::error_code& ec,
                                                          std::size_t) {
      if (ec == boost::asio::error::operation_aborted) return;
      if (!ec) {  // nothing is ever sent; whatever comes is skipped
        read();
        return;
      }
      spdlog::warn("the launching command is gone (its session ended); stopping");
      on_signal_(SIGHUP);
    });
  }
  boost::asio::posix::stream_descriptor sd_;
  std::function<void(int)>& on_signal_;
  std::array<char, 256> buf_{};
};

// A hosting agent stays until every member has been told the run's end (their streams close
// once they have read it); after a signal or a rendezvous error it leaves at once. The close
// runs on its own thread while this one keeps serving signals: a signal now ends the close at
// once (the other members see the stream end), cleans up and exits 128+N.
void close_hosted(rendezvous::RendezvousServer& server, std::chrono::milliseconds grace,
                  boost::asio::io_context& io, std::function<void(int)>& on_signal,
                  const std::string& own_error_file, const std::function<void()>& cleanup) {
  on_signal = [&](int sig) {
    spdlog::warn("received {} while closing the rendezvous; leaving now", agent::signal_name(sig));
    if (!own_error_file.empty()) {  // torchrun's record of the SignalException
      agent::write_signal_exception(own_error_file, sig);
    }
    cleanup();
    leave(128 + sig);  // the close thread is still inside gRPC: no destructors
  };
  std::thread closer([&] {
    server.shutdown(grace);
    boost::asio::post(io, [&io] { io.stop(); });
  });
  io.restart();
  io.run();
  closer.join();
}

}  // namespace

void run_node_job(const LaunchConfig& cfg, boost::asio::io_context& io,
                  std::function<void(int)>& on_signal, agent::JobSupervisor* supervisor) {
  // This host's name is looked up (bounded, through the system resolver) while the rest is
  // made: it is needed only for the agent's Join.
  std::future<std::string> fqdn;
  if (cfg.local_addr.empty()) {
    fqdn = std::async(std::launch::async, [] { return rendezvous::fully_qualified_hostname(); });
  }
  std::map<std::string, std::string> env = agent::current_environment();
  bool watch_stdin = false;
  if (auto w = env.find(kStdinWatchVar); w != env.end()) {
    watch_stdin = w->second == "1";
    env.erase(w);  // not the workers'
  }
  auto entry = resolve_entrypoint(cfg, env);
  if (!entry.ok()) leave_with({ops::kExitUsage, entry.status()});
  agent::AgentOptions opts;
  opts.numa_of = numa_plan(cfg);
  if (!entry->python_reason.empty()) {
    spdlog::info("python: {} runs under {} ({})", entry->name, entry->path, entry->python_reason);
  }
  // The pre-flight check, before this node hosts or reaches anything: a node that fails it
  // is not admitted (the others go on within --nnodes).
  if (!cfg.health_check.empty()) {
    const std::string host = cfg.local_addr.empty() ? fqdn.get() : cfg.local_addr;
    HealthCheck check{cfg.health_check, cfg.health_check_timeout, host};
    if (absl::Status s = run_health_check(check, env); !s.ok()) {
      leave_with({ops::kExitRuntime, s});
    }
    fqdn = std::async(std::launch::deferred, [host] { return host; });
  }
  Observers observers;
  open_observers(cfg, observers);
  Rendezvous rdzv = host_or_reach(cfg, io, on_signal, server_options(cfg, observers));

  opts.run_id = cfg.standalone ? random_uuid() : cfg.rdzv_id;
  opts.host = cfg.local_addr.empty() ? fqdn.get() : cfg.local_addr;
  opts.node_id = absl::StrCat(opts.host, ":", ::getpid());
  const LogFolder folder = make_log_folder(cfg, opts.run_id, env);
  opts.error_dir = folder.path;
  set_rendezvous(opts, cfg, rdzv);
  set_workers(opts, cfg, *entry, env);
  add_sinks(opts, observers);
  opts.supervisor = supervisor;
  opts.workers_stdin_null = watch_stdin;
  opts.base_env = std::move(env);
  const std::string own_error_file = opts.own_error_file;

  // A kill -9 leaves no temporary folder either: the supervisor removes it.
  if (!folder.keep && supervisor) supervisor->track_folder(folder.path);
  bool keep_failed = false;  // a failed job keeps the error files its summary names
  // Once the workers are done, the private folder is removed beside the rendezvous' close
  // (a directory's removal costs a fraction of a millisecond each on ext4).
  std::thread remover;
  const auto remove_folder = [&folder] {
    std::error_code ec;
    std::filesystem::remove_all(folder.path, ec);
  };
  const std::function<void()> cleanup = [&] {
    // The supervisor is not told to forget the folder: a kill -9 while it is being removed
    // would leave the rest. Removing what is already gone costs it nothing.
    if (remover.joinable()) {
      remover.join();
    } else if (!folder.keep && !keep_failed) {
      remove_folder();
    }
    // The supervisor kills what is left (nothing, normally) and removes the job cgroup.
    if (supervisor) supervisor->finish(std::chrono::seconds(2));
  };

  std::optional<agent::Agent> agent;
  agent.emplace(io, std::move(opts));
  on_signal = [&agent](int sig) { agent->on_signal(sig); };
  std::optional<StdinWatch> stdin_watch;
  if (watch_stdin) stdin_watch.emplace(io, on_signal);
  const int code = agent->run();
  if (agent->failed() && !folder.keep && holds_error_file(folder.path)) {
    // The summary names the error files workers wrote in the private folder: they must
    // outlive launch, so the supervisor is told to leave it too.
    keep_failed = true;
    if (supervisor) supervisor->forget_folder();
    spdlog::warn("the failed job's error files are kept in {} (remove it when done)", folder.path);
  }
  if (!folder.keep && !keep_failed) remover = std::thread(remove_folder);
  if (rdzv.server) {
    // The agent stays alive (finished, ignoring signals) so that nothing of it is left
    // pending on the loop.
    const auto grace =
        code == 0 || code == 1 ? cfg.rdzv_conf.close_timeout : std::chrono::milliseconds(0);
    close_hosted(*rdzv.server, grace, io, on_signal, own_error_file, cleanup);
  }
  // Exiting anyway: the code already says why. Signals stay handled (and ignored) to the end:
  // the agent is ended here while the signal set still stands, and launch leaves with _exit,
  // so no signal finds the default action on the way out (the signal set's destructor would
  // restore it, and gRPC's global teardown after main takes a while).
  on_signal = [](int) {};
  agent.reset();
  cleanup();
  leave(code);
}

}  // namespace muster::launcher
