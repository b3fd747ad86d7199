// launch's flags: the table of every flag (torchrun's and launch's own), then each value
// resolved in torchrun's order, read only from the injected environment (parse_launch_args).
#include <CLI/CLI.hpp>
#include <cctype>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "cluster_config.h"
#include "config_internal.h"
#include "muster/agent/numa.h"
#include "muster/agent/worker_env.h"
#include "muster/launcher/config.h"
#include "muster/launcher/scheduler_env.h"
#include "muster/ops/build_info.h"
#include "muster/rendezvous/limits.h"
#include "tls_config.h"

namespace muster::launcher {

using namespace internal;
namespace limits = muster::rendezvous::limits;

namespace {

// launch's own groups of flags (docs/operations.md, docs/hangs.md, docs/cluster.md): they take
// no prefix away from torchrun's flags (expand_long_flags).
constexpr const char* kOps = "Operations (docs/operations.md)";
constexpr const char* kHangs = "Hangs (docs/hangs.md)";
constexpr const char* kCluster = "Many hosts from one command (docs/cluster.md)";

// What the flag table binds besides the LaunchConfig: values that are resolved after the
// parse, and the options that are asked whether they were given.
struct RawFlags {
  std::string nnodes = "1";
  double shutdown_s = 30.0;
  double hang_s = 0;
  double health_check_s = 0;  // set from limits::kDefaultHealthCheckTimeout in add_hang_flags
  double cooldown_s = 0;      // set from limits::kDefaultStragglerCooldown in add_hang_flags
  std::string prefix_flag;
  std::string logs_specs;
  SchedulerFlags given;
  CLI::Option* shutdown_opt = nullptr;
  CLI::Option* hang_opt = nullptr;
  CLI::Option* numa_opt = nullptr;
};

// Every flag also reads PET_<NAME> (torchrun's env defaults, as Kubeflow's PyTorchJob sets
// them); a flag on the command line wins.
CLI::Option* pet(CLI::Option* o, const char* group) {
  std::string name = o->get_lnames().front();
  for (char& ch : name) ch = ch == '-' ? '_' : static_cast<char>(std::toupper(ch));
  return o->envname("PET_" + name)->group(group);
}

// launch's own: hangs, stragglers, health checks, in-place recovery, the progress budget
// (docs/hangs.md, docs/stragglers.md, docs/in_place.md).
void add_hang_flags(CLI::App& app, LaunchConfig& c, RawFlags& raw) {
  raw.hang_opt =
      pet(app.add_option("--hang_timeout,--hang-timeout", raw.hang_s,
                         "Seconds a rank's progress (its progress page) may stay still while "
                         "another rank got further; then its stacks are dumped and the group "
                         "fails (0: off, the default)"),
          kHangs)
          ->check(not_empty());
  raw.health_check_s = std::chrono::duration<double>(limits::kDefaultHealthCheckTimeout).count();
  pet(app.add_option("--health_check,--health-check", c.health_check,
                     "A command (/bin/sh -c) run on this node before it first joins: exit 0 "
                     "and it joins; otherwise it is not admitted (one line, exit 1) and the "
                     "job goes on with the others within --nnodes (docs/launch.md)"),
      kHangs)
      ->check(not_empty());
  pet(app.add_option("--health_check_timeout,--health-check-timeout", raw.health_check_s,
                     "Seconds the health check may take (default 60, at most 3600)"),
      kHangs)
      ->check(not_empty());
  pet(app.add_flag("--preflight", c.preflight,
                   "Before the first round's workers start, measure every node's compute and "
                   "its links to the others (pairwise probes around the ring); a node far "
                   "slower than the others leaves with one line (docs/stragglers.md)"),
      kHangs);
  pet(app.add_flag("--watch_stragglers,--watch-stragglers", c.watch_stragglers,
                   "Name a rank whose own work per step (data, compute: all but its wait in "
                   "collectives) is slower than the others' (docs/stragglers.md): status, "
                   "events, metrics. Gives workers progress pages (a Python worker the "
                   "automatic reports)"),
      kHangs);
  raw.cooldown_s = std::chrono::duration<double>(limits::kDefaultStragglerCooldown).count();
  pet(app.add_flag("--exclude_stragglers,--exclude-stragglers", c.exclude_stragglers,
                   "With --in_place: a node named as a straggler leaves the world when that "
                   "costs less than keeping it, never below the --nnodes minimum; a node "
                   "waiting beyond the maximum takes its place (docs/stragglers.md). Implies "
                   "--watch_stragglers; changes the global batch"),
      kHangs);
  pet(app.add_option("--straggler_cooldown,--straggler-cooldown", raw.cooldown_s,
                     "Seconds an excluded node stays out before it may join again, doubled "
                     "each time it is excluded again (default 300, at most 86400)"),
      kHangs)
      ->check(not_empty());
  pet(app.add_flag("--in_place,--in-place", c.in_place,
                   "In-place recovery (docs/in_place.md): on a failure, workers that declared "
                   "support keep running and re-form in the next round; only the dead are "
                   "replaced (others: the full restart)"),
      kHangs);
  pet(app.add_option("--spares", c.spares,
                     "With --in_place: warm spare processes per node, started once the program "
                     "says it can wait as one (muster_inplace.await_rank); a dead worker's place "
                     "is taken by a spare at once instead of a new process (default 0)"),
      kHangs)
      ->check(not_empty() & CLI::Range(0, limits::kMaxSpares));
  pet(app.add_option("--max_restarts_without_progress,--max-restarts-without-progress",
                     c.max_restarts_without_progress,
                     "At most N restarts in a row after rounds in which no rank made a step; "
                     "then the job stops with exit code 3, do not requeue (0: off)"),
      kHangs)
      ->check(not_empty() & CLI::Range(0, limits::kMaxRestartsWithoutProgress));
  pet(app.add_option("--restart_budget_reset_after_steps,--restart-budget-reset-after-steps",
                     c.restart_budget_reset_after_steps,
                     "A failure after a round in which a rank made this many steps gets the "
                     "whole --max_restarts budget back (0: off)"),
      kHangs)
      ->check(not_empty() & CLI::NonNegativeNumber);
}

// launch --hosts (docs/cluster.md).
void add_cluster_flags(CLI::App& app, LaunchConfig& c) {
  pet(app.add_option("--hosts", c.cluster.hosts_text,
                     "Start one agent per host over ssh: HOST[:SLOTS],... (horovodrun's -H); "
                     "SLOTS workers there, else --nproc_per_node"),
      kCluster);
  pet(app.add_option("--hostfile", c.cluster.hostfile,
                     "The hosts from a file: 'HOST slots=N' (DeepSpeed's), 'HOST:N' or 'HOST' "
                     "lines, # comments"),
      kCluster);
  pet(app.add_option("--include", c.cluster.include,
                     "Only these of the hosts (comma or @ separated)"),
      kCluster);
  pet(app.add_option("--exclude", c.cluster.exclude, "All of the hosts but these"), kCluster);
  pet(app.add_option("--ssh_args,--ssh-args", c.cluster.ssh_args_text,
                     "More ssh options, e.g. '-p 2222 -F cfg' (ssh runs in BatchMode)"),
      kCluster);
  pet(app.add_option("--remote_launch,--remote-launch", c.cluster.remote_launch,
                     "launch's path on the hosts (default: this launch's own path)"),
      kCluster);
  pet(app.add_option("--env", c.cluster.env_text,
                     "More variables for the hosts' agents: NAME (its value here) or "
                     "NAME=VALUE, comma separated"),
      kCluster);
}

// Where the workers' output and launch's events go (docs/launch.md, "Output").
void add_output_flags(CLI::App& app, LaunchConfig& c, RawFlags& raw) {
  const char* kLogs = "Logs and output";
  pet(app.add_option("--log_dir,--log-dir", c.log_dir,
                     "Keep each worker's stdout.log, stderr.log and error.json under "
                     "DIR/<run_id>_<random>/attempt_<k>/<local_rank>/"),
      kLogs);
  pet(app.add_option("-r,--redirects", c.redirects,
                     "Send worker output to the log files only: 0 none, 1 stdout, 2 stderr, "
                     "3 both; or per local rank, e.g. 0:1,1:3 (needs --log_dir)"),
      kLogs);
  pet(app.add_option("-t,--tee", c.tee,
                     "Copy worker output to the log files too, same values as --redirects"),
      kLogs);
  pet(app.add_option("--log_line_prefix_template,--log-line-prefix-template", raw.prefix_flag,
                     "Prefix of each worker line on the console, torchrun's macros ${role_name}, "
                     "${rank}, ${local_rank}, ${hostname} (default "
                     "$TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, else [${role_name}${rank}]:)"),
      kLogs);
  pet(app.add_option("--local_ranks_filter,--local-ranks-filter", c.local_ranks_filter,
                     "Only these local ranks reach the console, e.g. 0 or 0,2"),
      kLogs);
  pet(app.add_option("--duplicate_stdout_filters,--duplicate-stdout-filters",
                     c.duplicate_stdout_text,
                     "Also write the workers' stdout lines that contain any of these "
                     "comma-separated strings (,, for a comma) to "
                     "attempt_<k>/filtered_stdout.log"),
      kLogs);
  pet(app.add_option("--duplicate_stderr_filters,--duplicate-stderr-filters",
                     c.duplicate_stderr_text,
                     "The same for stderr, to attempt_<k>/filtered_stderr.log"),
      kLogs);
  app.add_option("--event_log,--event-log", c.event_log,
                 "Append one JSON line per event of this node (round formed, workers started "
                 "with the recovery's phases, failures, restarts) to FILE (-: stderr)")
      ->group(kOps);
  app.add_option("--metrics_port,--metrics-port", c.metrics_port,
                 "Serve this node's Prometheus metrics (and the rendezvous server's, when it "
                 "hosts it) on 0.0.0.0:PORT/metrics; 0: any free port, logged at info level")
      ->check(CLI::Range(0, 65535))
      ->group(kOps);
  pet(app.add_option("--event_log_handler,--event-log-handler", c.event_log_handler,
                     "Where events are logged: console (launch's log), null or "
                     "dynamic_rendezvous (as null, torchrun's)"),
      kLogs)
      ->check(CLI::IsMember({"console", "null", "dynamic_rendezvous"}));
}

// Where the nodes meet: the rendezvous (elastic or static) and the TLS of the server a launch
// hosts.
void add_rendezvous_flags(CLI::App& app, LaunchConfig& c, RawFlags& raw) {
  const char* kRdzv = "Rendezvous";
  const char* kStatic = "Static rendezvous";
  pet(app.add_option("--rdzv_backend,--rdzv-backend", c.rdzv_backend,
                     "static (the default: fixed nodes, --node_rank) or c10d (elastic)"),
      kRdzv);
  raw.given.rdzv_endpoint = pet(app.add_option("--rdzv_endpoint,--rdzv-endpoint", c.rdzv_endpoint,
                     "Rendezvous HOST[:PORT]"),
      kRdzv);
  raw.given.rdzv_id =
      pet(app.add_option("--rdzv_id,--rdzv-id", c.rdzv_id, "Job id shared by every node"), kRdzv);
  pet(app.add_option("--rdzv_conf,--rdzv-conf", c.rdzv_conf_text,
                     "key=value,... : join_timeout, last_call_timeout, close_timeout, "
                     "keep_alive_interval, keep_alive_max_attempt, read_timeout, "
                     "reattach_timeout, in_place_timeout (seconds), token, is_host, use_agent_store, "
                     "store_cache, in_place, tls_ca, tls_cert, "
                     "tls_key, tls_server_name (other torchrun keys: accepted, ignored, warned about)"),
      kRdzv);
  // TLS for the server this launch hosts (docs/operations.md, "TLS").
  app.add_option("--tls_cert,--tls-cert", c.server_tls.files.cert,
                 "PEM certificate chain: the rendezvous server this launch hosts speaks TLS only")
      ->group(kOps);
  app.add_option("--tls_key,--tls-key", c.server_tls.files.key, "PEM private key of --tls_cert")
      ->group(kOps);
  app.add_option("--tls_ca,--tls-ca", c.server_tls.files.client_ca,
                 "PEM CA of the agents' certificates: mutual TLS (every agent needs "
                 "--rdzv_conf tls_cert=,tls_key=)")
      ->group(kOps);
  pet(app.add_option("--local_addr,--local-addr", c.local_addr,
                     "This node's address as other nodes reach it (default: its FQDN)"),
      kRdzv);
  raw.given.node_rank =
      pet(app.add_option("--node_rank,--node-rank", c.node_rank, "This node's rank"), kStatic)
          ->check(not_empty());
  raw.given.master_addr = pet(app.add_option("--master_addr,--master-addr", c.master_addr,
                     "Workers' MASTER_ADDR (default 127.0.0.1)"),
      kStatic);
  raw.given.master_port = pet(app.add_option("--master_port,--master-port", c.master_port,
                     "Workers' MASTER_PORT (default 29500)"),
      kStatic)
      ->check(not_empty());
}

// Every flag of launch, torchrun's and its own (a table).
void add_launch_flags(CLI::App& app, LaunchConfig& c, RawFlags& raw) {
  app.prefix_command();
  app.footer(
      "PROGRAM [ARGS...]: an executable (a path, or a name on PATH), a .py script (run as "
      "PYTHON -u, PYTHON being $PYTHON_EXEC, else $VIRTUAL_ENV/bin/python, else the first python3 "
      "on PATH that can import torch when the script imports it, else python3), or a module "
      "with -m. Everything after PROGRAM is passed to it. "
      "Details: docs/launch.md and docs/rendezvous.md.");
  app.set_help_flag("-h,--help", "Show this help and exit");
  app.set_version_flag("--version", muster::ops::version_line("launch"),
                       "Show the version and commit and exit");
  const char* kRdzv = "Rendezvous";
  const char* kWorkers = "Workers";
  const char* kProgram = "Program";
  // launch's own operator flags (docs/operations.md): like kCluster and kHangs, they take no
  // prefix away from torchrun's flags.
  const char* kCompat = "Accepted for torchrun compatibility";
  raw.given.nnodes = pet(app.add_option("--nnodes", raw.nnodes, "Number of nodes, N or MIN:MAX (elastic)"), kRdzv);
  raw.given.nproc = pet(app.add_option("--nproc_per_node,--nproc-per-node", c.nproc_spec,
                     "Workers per node: an integer, cpu, gpu, xpu or auto"),
      kWorkers);
  pet(app.add_flag("--standalone", c.standalone,
                   "Single node; the rendezvous server runs inside launch on a free port"),
      kRdzv);
  pet(app.add_option("--max_restarts,--max-restarts", c.max_restarts,
                     "Restarts of the worker group before the job fails"),
      kWorkers)
      ->check(not_empty());
  raw.shutdown_opt =
      pet(app.add_option("--shutdown_timeout,--shutdown-timeout", raw.shutdown_s,
                         "Seconds between SIGTERM and SIGKILL when stopping workers (default "
                         "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30)"),
          kWorkers)
          ->check(not_empty());
  pet(app.add_option("--signals_to_handle,--signals-to-handle", c.signals_to_handle,
                     "Signals forwarded to the workers (comma-separated names)"),
      kWorkers);
  pet(app.add_option("--role", c.role, "Worker role name (ROLE_NAME)"), kWorkers);
  raw.numa_opt = pet(app.add_option("--numa_binding,--numa-binding", c.numa_binding,
                     "Bind each local rank to CPUs (and memory) near its GPU, or round-robin "
                     "over NUMA nodes without GPUs: node, socket, exclusive or core-complex"),
      kWorkers);
  pet(app.add_flag("--virtual_local_rank,--virtual-local-rank", c.virtual_local_rank,
                   "Every worker gets LOCAL_RANK=0 and only its own device in "
                   "CUDA_VISIBLE_DEVICES (its local rank's, or that entry of launch's list)"),
      kWorkers);
  add_rendezvous_flags(app, c, raw);
  pet(app.add_flag("-m,--module", c.module, "Run PROGRAM as a Python module (python3 -u -m)"),
      kProgram);
  pet(app.add_flag("--no_python,--no-python", c.no_python, "Run PROGRAM directly, not via python"),
      kProgram);
  pet(app.add_flag("--run_path,--run-path", c.run_path,
                   "Run PROGRAM as a Python script whatever its name (python3 -u PROGRAM); takes "
                   "precedence over --no_python and -m, as in torchrun"),
      kProgram);
  const char* kLegacy = "torch.distributed.launch (legacy)";
  pet(app.add_flag("--legacy_launch,--legacy-launch", c.legacy_launch,
                   "Act as python -m torch.distributed.launch: PROGRAM gets --local-rank=N "
                   "(its local rank) before its own arguments, unless --use_env"),
      kLegacy);
  pet(app.add_flag("--use_env,--use-env", c.use_env,
                   "torch.distributed.launch's flag: LOCAL_RANK only in the environment, no "
                   "--local-rank argument (always so without --legacy_launch)"),
      kLegacy);
  add_output_flags(app, c, raw);
  pet(app.add_option("--monitor_interval,--monitor-interval", c.monitor_interval,
                     "Accepted (worker exits are events here)"),
      kCompat)
      ->check(not_empty());
  pet(app.add_option("--start_method,--start-method", c.start_method,
                     "Accepted (workers are always fork+exec'd)"),
      kCompat)
      ->check(CLI::IsMember({"spawn", "fork", "forkserver"}));
  add_hang_flags(app, c, raw);
  add_cluster_flags(app, c);
  pet(app.add_option("--logs_specs,--logs-specs", raw.logs_specs,
                     "Refused: a Python plug-in hook (use --log_dir, --redirects, --tee)"),
      kCompat);

}

// The program and its arguments: what the parse left.
absl::Status take_program(const CLI::App& app, LaunchConfig& c) {
  std::vector<std::string> rest = app.remaining();
  if (!rest.empty() && rest.front() == "--") rest.erase(rest.begin());
  if (rest.empty()) return absl::InvalidArgumentError("missing the program to run");
  if (rest.front().size() > 1 && rest.front()[0] == '-') {
    return absl::InvalidArgumentError(absl::StrCat("unrecognized option '", rest.front(), "'"));
  }
  c.program = rest.front();
  c.program_args.assign(rest.begin() + 1, rest.end());
  return absl::OkStatus();
}

// Nodes and workers per node. Under srun or mpirun the scheduler gives what no flag did
// (scheduler_env.h); not to a launch that starts the hosts itself (--hosts, --hostfile).
absl::Status resolve_sizes(RawFlags& raw, LaunchConfig& c, const HostInfo& host,
                           const std::map<std::string, std::string>& env, bool cluster) {
  HostInfo counted = host;
  if (!c.standalone && !cluster && scheduler_env_enabled(env)) {
    auto job = derive_scheduler_job(env);
    if (!job.ok()) return job.status();
    if (job->has_value()) {
      if (absl::Status s = apply_scheduler_job(**job, raw.given, c, raw.nnodes, counted); !s.ok()) {
        return s;
      }
    }
  }
  if (absl::Status s = parse_nnodes(raw.nnodes, c); !s.ok()) return s;
  // With --hosts, cpu/gpu/xpu/auto are counted by each host's agent on its own machine.
  const bool counted_remotely =
      cluster && (c.nproc_spec == "cpu" || c.nproc_spec == "gpu" || c.nproc_spec == "xpu" ||
                  c.nproc_spec == "auto");
  if (counted_remotely) {
    c.nproc_per_node = 1;
  } else if (absl::Status s = resolve_nproc(c, counted); !s.ok()) {
    return s;
  }
  if (c.max_restarts < 0) return absl::InvalidArgumentError("--max_restarts: must be 0 or more");
  return absl::OkStatus();
}

// --shutdown_timeout and --hang_timeout. torchrun's order for the first: the flag (or
// PET_SHUTDOWN_TIMEOUT), then TORCH_ELASTIC_SHUTDOWN_TIMEOUT.
absl::Status resolve_durations(RawFlags& raw, LaunchConfig& c,
                               const std::map<std::string, std::string>& env) {
  std::string shutdown_from = "--shutdown_timeout";
  if (auto it = env.find("TORCH_ELASTIC_SHUTDOWN_TIMEOUT");
      it != env.end() && raw.shutdown_opt->count() == 0) {
    shutdown_from = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT";
    if (!absl::SimpleAtod(it->second, &raw.shutdown_s)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "TORCH_ELASTIC_SHUTDOWN_TIMEOUT: expected seconds, got '", it->second, "'"));
    }
  }
  if (!(raw.shutdown_s >= 0) || !std::isfinite(raw.shutdown_s)) {
    return absl::InvalidArgumentError(absl::StrCat(shutdown_from, ": must be 0 or more seconds"));
  }
  auto shutdown = to_duration(shutdown_from, raw.shutdown_s, limits::kMaxShutdownTimeout);
  if (!shutdown.ok()) return shutdown.status();
  c.shutdown_timeout = *shutdown;
  if (!(raw.health_check_s > 0) || !std::isfinite(raw.health_check_s)) {
    return absl::InvalidArgumentError("--health_check_timeout: must be more than 0 seconds");
  }
  auto check = to_duration("--health_check_timeout", raw.health_check_s,
                           limits::kMaxHealthCheckTimeout);
  if (!check.ok()) return check.status();
  c.health_check_timeout = *check;
  if (!(raw.cooldown_s >= 1) || !std::isfinite(raw.cooldown_s)) {
    return absl::InvalidArgumentError("--straggler_cooldown: must be at least 1 second");
  }
  auto cooldown = to_duration("--straggler_cooldown", raw.cooldown_s,
                              limits::kMaxStragglerCooldown);
  if (!cooldown.ok()) return cooldown.status();
  c.straggler_cooldown = *cooldown;
  if (raw.hang_opt->count() == 0) return absl::OkStatus();
  if (!(raw.hang_s >= 0) || !std::isfinite(raw.hang_s)) {
    return absl::InvalidArgumentError("--hang_timeout: must be 0 or more seconds");
  }
  auto hang = to_duration("--hang_timeout", raw.hang_s, limits::kMaxHangTimeout);
  if (!hang.ok()) return hang.status();
  c.hang_timeout = *hang;
  return absl::OkStatus();
}

// How the program runs and where its output goes: python or not, the console prefix, log
// files, NUMA binding, devices, role.
absl::Status resolve_workers(const RawFlags& raw, LaunchConfig& c,
                             const std::map<std::string, std::string>& env) {
  // torchrun: --run_path takes precedence over --no_python (and -m); only -m with
  // --no_python is an error.
  if (c.run_path) c.module = c.no_python = false;
  if (c.module && c.no_python) {
    return absl::InvalidArgumentError("-m/--module and --no_python cannot be combined");
  }
  // torchrun: the flag when given non-empty, else the variable.
  if (!raw.prefix_flag.empty()) {
    c.log_line_prefix_template = substitute_hostname(raw.prefix_flag);
  } else if (auto it = env.find("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"); it != env.end()) {
    c.log_line_prefix_template = substitute_hostname(it->second);
  }
  if (absl::Status s = resolve_output(c); !s.ok()) return s;
  if (raw.numa_opt->count() > 0 || !c.numa_binding.empty()) {  // given empty: not a mode either
    auto m = muster::agent::parse_numa_mode(c.numa_binding);
    if (!m.ok()) return m.status();
    c.numa_mode = *m;
  }
  if (auto visible = env.find("CUDA_VISIBLE_DEVICES"); c.virtual_local_rank && visible != env.end()) {
    for (int lr = 0; lr < c.nproc_per_node; ++lr) {
      if (auto d = muster::agent::virtual_visible_device(&visible->second, lr); !d.ok()) {
        return d.status();
      }
    }
  }
  if (c.role.empty()) return absl::InvalidArgumentError("--role: must not be empty");
  if (c.standalone && c.max_nodes > 1) {
    return absl::InvalidArgumentError("--standalone runs one node: use --nnodes=1");
  }
  return absl::OkStatus();
}

// launch --hosts: the driver's own flags, and every host's agent's: this command's launch
// flags, less the driver's.
absl::Status resolve_cluster_flags(const CLI::App& app, const std::vector<std::string>& expanded,
                                   LaunchConfig& c) {
  auto flag_given = [&app](std::string_view name) {
    for (const CLI::Option* o : app.get_options()) {
      if (o->get_lnames().front() == name) return o->count() > 0;
    }
    return false;
  };
  if (absl::Status s = resolve_cluster(c, flag_given); !s.ok()) return s;
  const std::size_t flag_count = expanded.size() - (c.program_args.size() + 1);
  std::map<std::string, const CLI::Option*> by_name;
  for (const CLI::Option* o : app.get_options()) {
    for (const std::string& n : o->get_lnames()) by_name.emplace(n, o);
  }
  for (std::size_t i = 0; i < flag_count; ++i) {
    const std::string& a = expanded[i];
    if (a == "--") break;
    if (absl::StartsWith(a, "--")) {
      const std::string name = a.substr(2, a.find('=') - 2);
      auto it = by_name.find(name);
      if (it != by_name.end() && driver_sets_flag(it->second->get_lnames().front())) {
        if (a.find('=') == std::string::npos && it->second->get_items_expected_min() > 0) ++i;
        continue;
      }
    }
    c.cluster.agent_args.push_back(a);
  }
  return absl::OkStatus();
}

// After the parse: every value resolved and checked, in torchrun's order.
absl::Status resolve_config(const CLI::App& app, const std::vector<std::string>& expanded,
                            RawFlags& raw, LaunchConfig& c, const HostInfo& host,
                            const std::map<std::string, std::string>& env) {
  if (absl::Status s = take_program(app, c); !s.ok()) return s;
  if (!raw.logs_specs.empty()) {
    return absl::UnimplementedError(
        "--logs_specs names a Python plug-in, which launch cannot load; use --log_dir, "
        "--redirects and --tee");
  }
  const bool cluster = !c.cluster.hosts_text.empty() || !c.cluster.hostfile.empty();
  if (absl::Status s = resolve_sizes(raw, c, host, env, cluster); !s.ok()) return s;
  if (absl::Status s = resolve_durations(raw, c, env); !s.ok()) return s;
  if (absl::Status s = resolve_workers(raw, c, env); !s.ok()) return s;
  if (absl::Status s = resolve_rdzv_conf(c, env); !s.ok()) return s;
  if (absl::Status s = resolve_tls(c, env, cluster); !s.ok()) return s;
  if (cluster) return resolve_cluster_flags(app, expanded, c);
  if (absl::Status s = resolve_rendezvous(c); !s.ok()) return s;
  if (c.client_tls.enabled() && c.client_tls.files.server_name.empty()) {
    c.client_tls.files.server_name = c.mode == RdzvMode::kEmbedded ? "localhost" : c.endpoint.host;
  }
  return absl::OkStatus();
}

}  // namespace

ParseResult parse_launch_args(const std::vector<std::string>& args, const HostInfo& host,
                              const std::map<std::string, std::string>& env) {
  ParseResult result;
  LaunchConfig c;
  RawFlags raw;
  CLI::App app{"launch: start a distributed training job (a drop-in for torchrun)", "launch"};
  add_launch_flags(app, c, raw);
  auto expanded = expand_long_flags(app, args, {kCluster, kHangs, kOps});
  if (!expanded.ok()) {
    result.error = expanded.status();
    return result;
  }
  std::vector<std::string> reversed(expanded->rbegin(), expanded->rend());
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    result.help = app.help();
    return result;
  } catch (const CLI::CallForVersion&) {
    result.help = muster::ops::version_line("launch") + "\n";
    return result;
  } catch (const CLI::ParseError& e) {
    result.error = absl::InvalidArgumentError(one_line(e.what()));
    return result;
  }
  if (absl::Status s = resolve_config(app, *expanded, raw, c, host, env); !s.ok()) {
    result.error = s;
    return result;
  }
  result.config = std::move(c);
  return result;
}

}  // namespace muster::launcher
