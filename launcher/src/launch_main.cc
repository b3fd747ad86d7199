// launch: parse flags, then run this node's job (node_job.h) or drive one agent per host
// (cluster_driver.h).
#include <signal.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>
#include <cstdio>
#include <functional>
#include <memory>
#include <string_view>
#include <thread>

#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "cluster_driver.h"
#include "muster/agent/supervisor.h"
#include "muster/launcher/cluster.h"
#include "muster/launcher/config.h"
#include "muster/launcher/python.h"
#include "muster/ops/build_info.h"
#include "muster/ops/exit_codes.h"
#include "muster/rendezvous/server.h"
#include "node_job.h"
#include "status_command.h"

namespace {

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

// First, while launch has one thread: the process that kills whatever the job leaves when
// launch ends, however it ends (docs/launch.md, "Orphans").
std::unique_ptr<muster::agent::JobSupervisor> start_supervisor() {
  const char* cgroup_env = std::getenv("MUSTER_CGROUP");
  return muster::agent::JobSupervisor::start(cgroup_env == nullptr ||
                                             std::string_view(cgroup_env) != "0");
}

void log_config_notes(const muster::launcher::LaunchConfig& cfg) {
  if (!cfg.scheduler_summary.empty()) spdlog::info("{}", cfg.scheduler_summary);
  if (!cfg.rdzv_conf.ignored_keys.empty()) {
    spdlog::warn("--rdzv_conf: {} {} nothing in launch; ignored",
                 absl::StrJoin(cfg.rdzv_conf.ignored_keys, ", "),
                 cfg.rdzv_conf.ignored_keys.size() == 1 ? "does" : "do");
  }
}

}  // namespace

int main(int argc, char** argv) {
  // `launch --version` alone prints before anything is made (the flag table included).
  if (argc == 2 && std::string_view(argv[1]) == "--version") {
    std::fputs((muster::ops::version_line("launch") + "\n").c_str(), stdout);
    return 0;
  }
  // `launch status ...` asks a rendezvous server and exits; it starts no job.
  if (argc >= 2 && std::string_view(argv[1]) == "status") {
    return muster::launcher::status_command(argc - 1, argv + 1);
  }
  ::signal(SIGPIPE, SIG_IGN);
  // The flags first: --help and --version print and exit, an error line exits, and neither
  // starts anything. The supervisor is forked after them but still before the first thread:
  // the flags start none, except GPU detection (nproc_per_node=gpu/auto loads the driver,
  // which starts its own), so that forks it first.
  std::unique_ptr<muster::agent::JobSupervisor> supervisor;
  bool supervisor_started = false;
  auto ensure_supervisor = [&] {
    if (supervisor_started) return;
    supervisor_started = true;
    supervisor = start_supervisor();
  };
  muster::launcher::HostInfo host;
  host.cpu_count = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  host.gpu_count = [&] {
    ensure_supervisor();
    return muster::launcher::detect_gpu_count();
  };
  host.xpu_count = [&] {
    ensure_supervisor();
    return muster::launcher::detect_xpu_count();
  };
  muster::launcher::ParseResult parsed =
      muster::launcher::parse_launch_args(std::vector<std::string>(argv + 1, argv + argc), host);
  if (!parsed.help.empty()) {
    std::fputs(parsed.help.c_str(), stdout);
    return 0;
  }
  const absl::Status logging = setup_logging();
  if (!logging.ok()) return muster::ops::usage_error("launch", logging);
  if (!parsed.error.ok()) return muster::ops::usage_error("launch", parsed.error);
  ensure_supervisor();
  // Debian's abseil checks every absl::Mutex (gRPC's too) for lock-order cycles; not needed
  // on the embedded server's hot path.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  muster::rendezvous::route_grpc_logs_to_spdlog();
  if (supervisor) {
    spdlog::info("job supervisor pid {}; containment: {}", supervisor->pid(),
                 supervisor->mechanism());
  } else {
    spdlog::warn("cannot start the job supervisor: what workers start may outlive launch");
  }
  const muster::launcher::LaunchConfig& cfg = *parsed.config;
  log_config_notes(cfg);

  boost::asio::io_context io(1);
  // Signals are handled from here until launch exits: by the agent while it runs, and by
  // main during the close that follows (node_job.cc). One set for the whole life: were it
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
  if (!cfg.cluster.enabled()) muster::launcher::run_node_job(cfg, io, on_signal, supervisor.get());
  // launch --hosts / --hostfile: this command drives one agent per host (docs/cluster.md).
  const int code = muster::launcher::run_cluster(cfg, io, on_signal, supervisor.get());
  on_signal = [](int) {};
  if (supervisor) supervisor->finish(std::chrono::seconds(2));
  std::fflush(stdout);
  std::fflush(stderr);
  ::_exit(code);
}
