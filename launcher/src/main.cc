// launch: parse flags, host or reach the rendezvous server, run the agent.
#include <signal.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>
#include <stdlib.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/signal_set.hpp>
#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string_view>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/strings/str_format.h"
#include "muster/agent/agent.h"
#include "muster/agent/agent_metrics.h"
#include "muster/agent/failure.h"
#include "muster/agent/numa.h"
#include "muster/agent/supervisor.h"
#include "muster/agent/worker_env.h"
#include "muster/launcher/cluster.h"
#include "muster/launcher/config.h"
#include "muster/launcher/event_log.h"
#include "muster/launcher/python.h"
#include "muster/ops/json_lines.h"
#include "muster/ops/status_format.h"
#include "muster/ops/http_server.h"
#include "muster/ops/metrics.h"
#include "cluster_driver.h"
#include "status_command.h"
#include "muster/rendezvous/resolve.h"
#include "muster/rendezvous/server.h"

namespace {

using muster::launcher::LaunchConfig;
using muster::launcher::RdzvMode;

int usage_error(const absl::Status& status) {
  std::fprintf(stderr, "launch: error: %s\n", std::string(status.message()).c_str());
  return 2;
}

int fatal(const absl::Status& status) {
  std::fprintf(stderr, "launch: error: %s\n", std::string(status.message()).c_str());
  return 1;
}

std::string random_uuid() {
  std::random_device rd;
  std::uint32_t w[4] = {rd(), rd(), rd(), rd()};
  w[1] = (w[1] & 0xffff0fffu) | 0x00004000u;  // version 4
  w[2] = (w[2] & 0x3fffffffu) | 0x80000000u;  // variant 1
  return absl::StrFormat("%08x-%04x-%04x-%04x-%04x%08x", w[0], w[1] >> 16, w[1] & 0xffff,
                         w[2] >> 16, w[2] & 0xffff, w[3]);
}

// MUSTER_LOG_LEVEL, else torchrun's LOGLEVEL, else warnings and errors only.
absl::Status setup_logging() {
  auto logger = spdlog::stderr_logger_st("launch");
  logger->set_pattern("[launch] %l: %v");
  logger->set_level(spdlog::level::warn);
  spdlog::set_default_logger(logger);
  auto level = muster::launcher::resolve_log_level(std::getenv("MUSTER_LOG_LEVEL"),
                                                   std::getenv("LOGLEVEL"));
  if (!level.ok()) return level.status();
  logger->set_level(spdlog::level::from_str(*level));
  return absl::OkStatus();
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

}  // namespace

int main(int argc, char** argv) {
  // `launch status ...` asks a rendezvous server and exits; it starts no job.
  if (argc >= 2 && std::string_view(argv[1]) == "status") {
    return muster::launcher::status_command(argc - 1, argv + 1);
  }
  ::signal(SIGPIPE, SIG_IGN);
  // First, while launch has one thread: the process that kills whatever the job leaves
  // when launch ends, however it ends (docs/launch.md, "Orphans").
  const char* cgroup_env = std::getenv("MUSTER_CGROUP");
  std::unique_ptr<muster::agent::JobSupervisor> supervisor = muster::agent::JobSupervisor::start(
      cgroup_env == nullptr || std::string_view(cgroup_env) != "0");
  // Debian's abseil checks every absl::Mutex (gRPC's too) for lock-order cycles; not needed
  // on the embedded server's hot path.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  const absl::Status logging = setup_logging();
  muster::rendezvous::route_grpc_logs_to_spdlog();
  if (supervisor) {
    spdlog::info("job supervisor pid {}; containment: {}", supervisor->pid(),
                 supervisor->mechanism());
  } else {
    spdlog::warn("cannot start the job supervisor: what workers start may outlive launch");
  }

  muster::launcher::HostInfo host;
  host.cpu_count = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  host.gpu_count = muster::launcher::detect_gpu_count;
  host.xpu_count = muster::launcher::detect_xpu_count;
  muster::launcher::ParseResult parsed =
      muster::launcher::parse_launch_args(std::vector<std::string>(argv + 1, argv + argc), host);
  if (!parsed.help.empty()) {
    std::fputs(parsed.help.c_str(), stdout);
    return 0;
  }
  if (!logging.ok()) return usage_error(logging);
  if (!parsed.error.ok()) return usage_error(parsed.error);
  const LaunchConfig& cfg = *parsed.config;
  if (!cfg.scheduler_summary.empty()) spdlog::info("{}", cfg.scheduler_summary);
  if (!cfg.rdzv_conf.ignored_keys.empty()) {
    spdlog::warn("--rdzv_conf: {} {} nothing in launch; ignored",
                 absl::StrJoin(cfg.rdzv_conf.ignored_keys, ", "),
                 cfg.rdzv_conf.ignored_keys.size() == 1 ? "does" : "do");
  }

  boost::asio::io_context io(1);
  // Signals are handled from here until launch exits: by the agent while it runs, and by
  // main during the close that follows (see below). One set for the whole life: were it
  // replaced, a signal in between would find the default action and kill launch, leaving
  // its temporary folder. (A signal before this point kills launch before it made anything
  // but the supervisor, which then cleans up.)
  boost::asio::signal_set signals(io);
  for (int sig : cfg.signals) signals.add(sig);
  std::function<void(int)> on_signal = [](int) {};
  std::function<void()> wait_signal = [&] {
    signals.async_wait([&](const boost::system::error_code& ec, int sig) {
      if (ec) return;
      on_signal(sig);
      wait_signal();
    });
  };
  wait_signal();
  // launch --hosts / --hostfile: this command drives one agent per host (docs/cluster.md).
  if (cfg.cluster.enabled()) {
    const int code = muster::launcher::run_cluster(cfg, io, on_signal, supervisor.get());
    on_signal = [](int) {};
    if (supervisor) supervisor->finish(std::chrono::seconds(2));
    std::fflush(stdout);
    std::fflush(stderr);
    ::_exit(code);
  }

  std::map<std::string, std::string> env = muster::agent::current_environment();
  // An agent started by launch --hosts: its stdin is the driver's (through ssh); when it ends,
  // the driver or its session is gone, and this host stops (docs/cluster.md).
  bool watch_stdin = false;
  if (auto w = env.find(muster::launcher::kStdinWatchVar); w != env.end()) {
    watch_stdin = w->second == "1";
    env.erase(w);  // not the workers'
  }
  auto entry = muster::launcher::resolve_entrypoint(cfg, env);
  if (!entry.ok()) return usage_error(entry.status());
  // --numa-binding: one plan for the whole job (nproc_per_node is fixed), from this host's
  // topology; a plan that cannot be made (exclusive with more ranks than CPUs) is a usage error.
  std::vector<muster::agent::NumaBinding> numa_plan;
  if (cfg.numa_mode) {
    auto plan = muster::agent::plan_numa_binding(*cfg.numa_mode, muster::agent::read_topology(),
                                                 cfg.nproc_per_node);
    if (!plan.ok()) return usage_error(plan.status());
    numa_plan = std::move(*plan);
    for (std::size_t lr = 0; lr < numa_plan.size(); ++lr) {
      spdlog::info("--numa_binding={}: local rank {} on CPUs {}, memory node {}", cfg.numa_binding,
                   lr, muster::agent::cpu_list_text(numa_plan[lr].cpus), numa_plan[lr].memory_node);
    }
  }
  if (!entry->python_reason.empty()) {
    spdlog::info("python: {} runs under {} ({})", entry->name, entry->path, entry->python_reason);
  }

  // --event_log: this node's events and, when it hosts the rendezvous, the server's (before
  // the server starts, so that its first event is logged).
  std::unique_ptr<muster::ops::JsonLinesFile> event_log;
  if (!cfg.event_log.empty()) {
    auto opened = muster::ops::JsonLinesFile::open(cfg.event_log, "--event_log");
    if (!opened.ok()) {
      std::fprintf(stderr, "launch: error: %s\n", std::string(opened.status().message()).c_str());
      return 2;
    }
    event_log = std::move(*opened);
  }
  // --metrics_port: one registry for this node's series and, when it hosts the rendezvous,
  // the server's (docs/operations.md, "Metrics"). Made before the server, which adds to it.
  muster::ops::Registry metrics;
  std::unique_ptr<muster::ops::HttpServer> metrics_http;
  if (cfg.metrics_port >= 0) {
    muster::ops::add_process_metrics(metrics);
    auto http = muster::ops::HttpServer::start("0.0.0.0", cfg.metrics_port,
                                               muster::ops::metrics_routes(metrics));
    if (!http.ok()) {
      return fatal(absl::Status(http.status().code(),
                                absl::StrCat("--metrics_port: ", http.status().message())));
    }
    metrics_http = std::move(*http);
    spdlog::info("metrics on port {}", metrics_http->port());
  }
  std::unique_ptr<muster::rendezvous::RendezvousServer> server;
  std::string rdzv_addr;    // the server as messages name it
  std::string rdzv_target;  // and as gRPC reaches it: an address, never a name
  bool hosting = false;
  std::vector<muster::agent::RdzvEndpoint> more_endpoints;  // the rest of an --rdzv_endpoint list
  muster::rendezvous::ServerOptions server_opts;
  server_opts.token = cfg.rdzv_conf.token;
  server_opts.tls = cfg.server_tls;
  server_opts.timeouts = cfg.rdzv_conf.timeouts;
  if (event_log) {
    server_opts.event_sinks.push_back(
        [log = event_log.get()](const muster::rendezvous::RunEvent& e) {
          log->write_line(muster::ops::event_json(e, muster::ops::wall_time_of(e)));
        });
  }
  if (metrics_http) server_opts.metrics = &metrics;
  if (cfg.mode == RdzvMode::kEmbedded) {
    server_opts.listen_address = "127.0.0.1:0";
    auto started = muster::rendezvous::RendezvousServer::start(io, server_opts);
    if (!started.ok()) return fatal(started.status());
    server = std::move(*started);
    rdzv_addr = absl::StrCat("127.0.0.1:", server->port());
    rdzv_target = rdzv_addr;
    hosting = true;
  } else {
    // torchrun's is_host rule: static node 0, or the agent on the endpoint's host that binds
    // its port first. The others connect.
    // The endpoint's name is looked up once, through the system resolver and bounded; gRPC
    // is given the address (docs/launch.md, "Names").
    auto addresses = muster::rendezvous::resolve_host(cfg.endpoint.host);
    if (!addresses.ok()) {
      return fatal(absl::Status(addresses.status().code(),
                                absl::StrCat("--rdzv_endpoint: ", addresses.status().message())));
    }
    bool try_host = cfg.rdzv_conf.is_host.value_or(
        cfg.mode == RdzvMode::kStatic
            ? cfg.node_rank == 0
            : muster::launcher::is_local_host(cfg.endpoint.host, *addresses));
    rdzv_addr = cfg.endpoint.to_string();
    rdzv_target = muster::rendezvous::grpc_address_target(addresses->front(), cfg.endpoint.port);
    // The others of a list are looked up now too (once, bounded): an agent that loses its
    // server moves on to them without a lookup.
    for (const auto& e : cfg.more_endpoints) {
      auto more = muster::rendezvous::resolve_host(e.host);
      if (!more.ok()) {
        return fatal(absl::Status(more.status().code(),
                                  absl::StrCat("--rdzv_endpoint: ", more.status().message())));
      }
      more_endpoints.push_back(
          {muster::rendezvous::grpc_address_target(more->front(), e.port), e.to_string()});
    }
    if (try_host) {
      server_opts.listen_address = muster::rendezvous::is_ip_literal(cfg.endpoint.host)
                                       ? rdzv_addr
                                       : absl::StrCat("0.0.0.0:", cfg.endpoint.port);
      auto started = muster::rendezvous::RendezvousServer::start(io, server_opts);
      if (started.ok()) {
        server = std::move(*started);
        hosting = true;
        spdlog::info("hosting the rendezvous server on {}", server_opts.listen_address);
      } else if (cfg.mode == RdzvMode::kStatic) {
        return fatal(started.status());  // node 0 must host
      } else {
        spdlog::info("{}; another agent hosts it, connecting",
                     std::string(started.status().message()));
      }
    }
  }

  // The attempt_<k>/<local_rank>/ folders (error files, logs) live in a private temporary
  // folder removed at exit; with --log_dir, or when --redirects/--tee/--duplicate_*_filters ask
  // for log files, in a
  // folder that is kept: <dir>/<run_id>_<random>, torchrun's layout.
  const std::string run_id = cfg.standalone ? random_uuid() : cfg.rdzv_id;
  const std::string node_host =
      cfg.local_addr.empty() ? muster::rendezvous::fully_qualified_hostname() : cfg.local_addr;
  const std::string node_id = absl::StrCat(node_host, ":", ::getpid());
  const bool want_logs = std::any_of(cfg.redirect_of.begin(), cfg.redirect_of.end(),
                                     [](int v) { return v != 0; }) ||
                         std::any_of(cfg.tee_of.begin(), cfg.tee_of.end(), [](int v) { return v != 0; }) ||
                         !cfg.duplicate_stdout_filters.empty() || !cfg.duplicate_stderr_filters.empty();
  const char* tmp = std::getenv("TMPDIR");
  const std::string tmp_dir = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
  const bool keep = !cfg.log_dir.empty() || want_logs;
  std::string base = cfg.log_dir.empty() ? tmp_dir : cfg.log_dir;
  std::error_code ec;
  std::filesystem::create_directories(base, ec);
  std::string tmpl = cfg.log_dir.empty()
                         ? absl::StrCat(base, keep ? "/muster_logs_XXXXXX" : "/muster_XXXXXX")
                         : absl::StrCat(base, "/", run_id, "_XXXXXX");
  if (::mkdtemp(tmpl.data()) == nullptr) {
    std::fprintf(stderr, "launch: error: cannot create a folder under %s\n", base.c_str());
    return 1;
  }
  if (keep) spdlog::warn("worker logs: {}", tmpl);

  muster::agent::AgentOptions opts;
  opts.rdzv_target = rdzv_target;
  opts.rdzv_name = rdzv_addr;
  opts.rdzv_more = more_endpoints;
  opts.wait_for_server = !hosting;
  opts.connect_timeout = cfg.rdzv_conf.read_timeout;
  opts.token = cfg.rdzv_conf.token;
  opts.tls = cfg.client_tls;
  opts.rdzv_timeouts = cfg.rdzv_conf.timeouts;
  opts.use_agent_store = cfg.rdzv_conf.use_agent_store;
  opts.store_addr = rdzv_target;
  opts.run_id = run_id;
  opts.host = node_host;
  if (!cfg.standalone && cfg.rdzv_backend == "static") {
    opts.master_addr = cfg.master_addr;
    opts.master_port = cfg.master_port;
    opts.requested_rank = cfg.node_rank;
  }
  opts.node_id = node_id;
  if (event_log) {
    opts.event_sinks.push_back(
        [log = event_log.get(), source = muster::launcher::EventLogSource{run_id, node_id,
                                                                           node_host}](
            const muster::agent::AgentEvent& e) {
          log->write_line(muster::launcher::event_log_line(e, source));
        });
  }
  if (metrics_http) opts.event_sinks.push_back(muster::agent::agent_metrics_sink(metrics));
  opts.min_nodes = cfg.min_nodes;
  opts.max_nodes = cfg.max_nodes;
  opts.max_restarts = cfg.max_restarts;
  opts.nproc_per_node = cfg.nproc_per_node;
  opts.role = cfg.role;
  opts.program_path = entry->path;
  opts.argv = entry->argv;
  opts.entrypoint_name = entry->name;
  if (!entry->python_reason.empty()) {
    opts.python_interpreter = absl::StrCat(entry->path, " (", entry->python_reason, ")");
    opts.python_progress_hook = muster::launcher::progress_hook_pythonpath(
        std::filesystem::read_symlink("/proc/self/exe", ec).string());
  }
  opts.shutdown_timeout = cfg.shutdown_timeout;
  opts.hang_timeout = cfg.hang_timeout;
  if (auto path = env.find("PATH"); path != env.end()) {
    opts.gdb_path = muster::launcher::find_executable("gdb", path->second).value_or("");
  }
  opts.max_restarts_without_progress = cfg.max_restarts_without_progress;
  opts.restart_budget_reset_after_steps = cfg.restart_budget_reset_after_steps;
  opts.signals_to_handle = cfg.signals_to_handle;
  opts.virtual_local_rank = cfg.virtual_local_rank;
  opts.numa_of = numa_plan;
  opts.error_dir = tmpl;
  opts.redirect_of = cfg.redirect_of;
  opts.tee_of = cfg.tee_of;
  opts.console_of = cfg.console_of;
  opts.duplicate_stdout_filters = cfg.duplicate_stdout_filters;
  opts.duplicate_stderr_filters = cfg.duplicate_stderr_filters;
  opts.supervisor = supervisor.get();
  opts.workers_stdin_null = watch_stdin;
  if (auto it = env.find("TORCHELASTIC_ERROR_FILE"); it != env.end()) {
    opts.own_error_file = it->second;
  }
  const std::string own_error_file = opts.own_error_file;
  // torchrun's file-timer watchdog (docs/launch.md, "File timer"): the FIFO is the one named by
  // TORCHELASTIC_TIMER_FILE, else one in launch's own folder; workers are told where.
  if (auto it = env.find("TORCHELASTIC_ENABLE_FILE_TIMER"); it != env.end() && it->second == "1") {
    auto named = env.find("TORCHELASTIC_TIMER_FILE");
    opts.file_timer_path =
        named != env.end() && !named->second.empty() ? named->second : tmpl + "/watchdog_timer";
    env["TORCHELASTIC_TIMER_FILE"] = opts.file_timer_path;
  }
  opts.prefix_template = cfg.log_line_prefix_template;
  if (cfg.nproc_per_node > 1 && env.count("OMP_NUM_THREADS") == 0) {
    spdlog::info("setting OMP_NUM_THREADS=1 for each worker (it was unset)");
  }
  opts.base_env = std::move(env);

  // A kill -9 leaves no temporary folder either: the supervisor removes it.
  if (!keep && supervisor) supervisor->track_folder(tmpl);
  bool keep_failed = false;  // a failed job keeps the error files its summary names
  auto cleanup = [&] {
    // The supervisor is not told to forget the folder: a kill -9 while it is being removed
    // would leave the rest. Removing what is already gone costs it nothing.
    if (!keep && !keep_failed) std::filesystem::remove_all(tmpl, ec);
    // The supervisor kills what is left (nothing, normally) and removes the job cgroup.
    if (supervisor) supervisor->finish(std::chrono::seconds(2));
  };

  std::optional<muster::agent::Agent> agent;
  agent.emplace(io, std::move(opts));
  on_signal = [&agent](int sig) { agent->on_signal(sig); };
  std::optional<boost::asio::posix::stream_descriptor> stdin_watch;
  std::array<char, 256> stdin_buf{};
  std::function<void()> read_stdin = [&] {
    stdin_watch->async_read_some(
        boost::asio::buffer(stdin_buf), [&](const boost::system::error_code& ec, std::size_t) {
          if (ec == boost::asio::error::operation_aborted) return;
          if (!ec) {  // nothing is ever sent; whatever comes is skipped
            read_stdin();
            return;
          }
          spdlog::warn("the launching command is gone (its session ended); stopping");
          on_signal(SIGHUP);
        });
  };
  if (watch_stdin) {
    stdin_watch.emplace(io, ::dup(STDIN_FILENO));
    read_stdin();
  }
  const int code = agent->run();
  if (agent->failed() && !keep && holds_error_file(tmpl)) {
    // The summary names the error files workers wrote in the private folder: they must
    // outlive launch, so the supervisor is told to leave it too.
    keep_failed = true;
    if (supervisor) supervisor->forget_folder();
    spdlog::warn("the failed job's error files are kept in {} (remove it when done)", tmpl);
  }
  if (server) {
    // A hosting agent stays until every member has been told the run's end (their streams
    // close once they have read it); after a signal or a rendezvous error it leaves at once.
    // The close runs on its own thread while this one keeps serving signals: a signal now
    // ends the close at once (the other members see the stream end), removes the temporary
    // folder and exits 128+N. The agent stays alive (finished, ignoring signals) so that
    // nothing of it is left pending on the loop.
    const auto grace =
        code == 0 || code == 1 ? cfg.rdzv_conf.close_timeout : std::chrono::milliseconds(0);
    on_signal = [&](int sig) {
      spdlog::warn("received {} while closing the rendezvous; leaving now",
                   muster::agent::signal_name(sig));
      if (!own_error_file.empty()) {  // torchrun's record of the SignalException
        muster::agent::write_signal_exception(own_error_file, sig);
      }
      cleanup();
      std::fflush(stdout);
      std::fflush(stderr);
      ::_exit(128 + sig);  // the close thread is still inside gRPC: no destructors
    };
    std::thread closer([&] {
      server->shutdown(grace);
      boost::asio::post(io, [&io] { io.stop(); });
    });
    io.restart();
    io.run();
    closer.join();
  }
  // Exiting anyway: the code already says why. Signals stay handled (and ignored) to the end:
  // the agent is ended here while the signal set still stands, and launch leaves with _exit,
  // so no signal finds the default action on the way out (the signal set's destructor would
  // restore it, and gRPC's global teardown after main takes a while).
  on_signal = [](int) {};
  agent.reset();
  cleanup();
  std::fflush(stdout);
  std::fflush(stderr);
  ::_exit(code);
}
