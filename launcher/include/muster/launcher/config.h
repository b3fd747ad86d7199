// `launch`'s command line -> LaunchConfig, validated once.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "muster/agent/numa.h"
#include "muster/launcher/hostfile.h"
#include "muster/launcher/python.h"
#include "muster/ops/endpoint.h"
#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/timeouts.h"
#include "muster/rendezvous/tls.h"

namespace muster::launcher {

// torchrun's default rendezvous port (c10d), when --rdzv_endpoint gives none.
inline constexpr int kDefaultRdzvPort = ops::kDefaultRendezvousPort;

// HOST:PORT, [V6]:PORT, HOST or [V6] (the port then defaults): ops::parse_host_port. Port 0 is
// accepted here (a free port, for a single node: resolve_rendezvous decides).
using Endpoint = ops::HostPort;
absl::StatusOr<Endpoint> parse_endpoint(const std::string& text, int default_port);
// --rdzv_endpoint=A[,B,...]: one endpoint or a comma-separated list of at most
// limits::kMaxRdzvEndpoints, each as parse_endpoint takes it. The first is the one the
// hosting rule (is_host) looks at; the agent moves to the next when one cannot be reached
// (docs/rendezvous.md, "Restarting the server without restarting workers").
absl::StatusOr<std::vector<Endpoint>> parse_endpoints(const std::string& text, int default_port);

// --rdzv_conf key=value,...: torchrun's keys, in seconds. The text may be wrapped in one pair
// of quotes ('...' or "..."), as torchrun's own tests pass it; keys and values are trimmed.
// Keys launch has no use for (torchrun's `timeout`, `store_type`, `use_libuv`, ..., or a
// custom backend's) are accepted, as torchrun passes them through, and listed in
// `ignored_keys` for one warning.
struct RdzvConf {
  muster::rendezvous::RendezvousTimeouts timeouts;  // join, last_call, keep_alive_*
  std::chrono::milliseconds read_timeout{std::chrono::seconds(60)};
  std::chrono::milliseconds close_timeout{std::chrono::seconds(30)};
  std::string token;            // or $MUSTER_RDZV_TOKEN
  std::optional<bool> is_host;  // override the hosting rule
  // Workers use the run's TCPStore-protocol store on the rendezvous server (MASTER_ADDR,
  // MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE=True) when it has one; false: rank 0 hosts its own.
  bool use_agent_store = true;
  // store_cache: the agents answer reads of keys their own node set (docs/rendezvous.md);
  // false: every read goes to the server (a job that orders a SET against another node's read
  // by something other than the store).
  bool store_cache = true;
  // in_place, in_place_timeout (docs/in_place.md): as --in_place; the wait for the re-formed
  // round's workers to report resumed.
  bool in_place = false;
  std::chrono::milliseconds in_place_timeout = muster::rendezvous::limits::kDefaultInPlaceTimeout;
  // tls_ca, tls_cert, tls_key, tls_server_name: the agent's TLS to the server (each, when
  // not given here, from MUSTER_TLS_CA, _CERT, _KEY, _SERVER_NAME; docs/operations.md).
  muster::rendezvous::ClientTlsFiles tls;
  std::vector<std::string> ignored_keys;  // in the order given
};
absl::StatusOr<RdzvConf> parse_rdzv_conf(const std::string& text);

// How this launch takes part in the rendezvous.
enum class RdzvMode {
  kEmbedded,  // one node: the server runs in-process on 127.0.0.1, port 0 (also for an
              // --rdzv_endpoint with port 0, torchrun's "pick a free port" on one node)
  kStatic,    // fixed membership; node 0 hosts the server
  kC10d,      // elastic; the agent whose host is the endpoint hosts it (or rdzvd does)
};

// launch --hosts / --hostfile (docs/cluster.md): this command starts one agent per host (over
// ssh; directly for this machine) and hosts the rendezvous, unless --rdzv_endpoint names one.
struct ClusterOptions {
  // As given.
  std::string hosts_text, hostfile, include, exclude, ssh_args_text, env_text;
  std::string remote_launch;  // launch's path on the hosts (default: this binary's own)
  // Resolved.
  std::vector<HostSlots> hosts;        // the list's or the file's, after --include/--exclude
  std::vector<std::string> ssh_args;   // split as a shell would (quotes), nothing expanded
  std::vector<std::string> env;        // --env items: NAME (its value here) or NAME=VALUE
  // This command's own launch flags (canonical spellings), less the cluster's and those the
  // driver sets for each host (--nnodes, --nproc_per_node, --rdzv_*, --local_addr).
  std::vector<std::string> agent_args;
  bool enabled() const { return !hosts.empty(); }
};

// Every flag's default lives here.
struct LaunchConfig {
  bool standalone = false;
  int min_nodes = 1;
  int max_nodes = 1;
  std::string nproc_spec = "1";  // as given: an int, "cpu", "gpu" or "auto"
  int nproc_per_node = 1;        // resolved
  int max_restarts = 0;
  double monitor_interval = 0.1;       // accepted for torchrun compatibility; exits are events here
  std::string start_method = "spawn";  // accepted; workers are always fork+exec'd
  std::string rdzv_backend = "static";
  std::string rdzv_endpoint;
  std::string rdzv_id = "none";
  std::string rdzv_conf_text;
  RdzvConf rdzv_conf;
  // --tls_cert, --tls_key, --tls_ca: TLS for the server this launch hosts (if it does), read
  // and checked at parse time.
  muster::rendezvous::ServerTls server_tls;
  // The agent's TLS (rdzv_conf.tls read and checked; its server name defaults to the
  // endpoint's host, "localhost" for the embedded server). With --hosts not read here: the
  // files are the hosts' (the same paths there).
  muster::rendezvous::ClientTls client_tls;
  RdzvMode mode = RdzvMode::kEmbedded;
  Endpoint endpoint;        // kStatic / kC10d: where the rendezvous server is
  std::vector<Endpoint> more_endpoints;  // the rest of an --rdzv_endpoint list, in order
  int node_rank = -1;       // static: this node's group rank
  std::string master_addr;  // static: workers' MASTER_ADDR (default 127.0.0.1)
  int master_port = 0;      // static: workers' MASTER_PORT (default 29500)
  std::string local_addr;   // this node's address as others reach it (default: fqdn)
  std::string role = "default";
  bool module = false;     // -m: run the program as `python3 -u -m <module>`
  bool no_python = false;  // run the program directly, never through python
  bool run_path = false;   // run the program as a python script whatever its name
  // --legacy_launch: torch.distributed.launch's habits (a drop-in for `python -m
  // torch.distributed.launch`): unless --use_env, the program is given --local-rank=N first.
  bool legacy_launch = false;
  bool use_env = false;  // --use_env/--use-env: accepted always; torchrun's rule without it
  // Output (torchrun's): --log_dir, --redirects, --tee, --local_ranks_filter.
  std::string log_dir;
  std::string redirects = "0";
  std::string tee = "0";
  std::string local_ranks_filter;
  // The console prefix's template (torchrun's macros, docs/launch.md "Output"): the
  // --log_line_prefix_template flag (torchrun main; PET_LOG_LINE_PREFIX_TEMPLATE) when given
  // non-empty, else $TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, with `${hostname}` (this host's
  // short name) already substituted; empty: the default prefix.
  std::string log_line_prefix_template;
  // --duplicate_stdout_filters / --duplicate_stderr_filters (torchrun 2.x) as given, and split
  // by parse_filter_list.
  std::string duplicate_stdout_text, duplicate_stderr_text;
  std::vector<std::string> duplicate_stdout_filters, duplicate_stderr_filters;
  std::string event_log;  // --event_log FILE ("-": stderr): JSON lines (event_log.h); empty: off
  // --metrics_port PORT: Prometheus metrics on 0.0.0.0:PORT/metrics (0: a free port, logged);
  // -1: off.
  int metrics_port = -1;
  std::string event_log_handler = "console";  // accepted: events go to launch's own log
  std::string signals_to_handle = "SIGTERM,SIGINT,SIGHUP,SIGQUIT";
  // --virtual_local_rank (torchrun 2.x): every worker gets LOCAL_RANK=0 and only its own
  // device in CUDA_VISIBLE_DEVICES. Checked at parse time: with CUDA_VISIBLE_DEVICES set, it
  // must have an entry for every local rank.
  bool virtual_local_rank = false;
  // --numa_binding (torchrun 2.x): "" (off), node, socket, exclusive or core-complex; the
  // per-rank plan is made by main from the host's topology (agent/numa.h).
  std::string numa_binding;
  std::optional<muster::agent::NumaMode> numa_mode;  // resolved from numa_binding
  // Resolved per local rank: bit 1 stdout, bit 2 stderr. A stream both redirected and teed is
  // teed (torchrun's rule: tee adds to the redirects), so the two never share a bit. With
  // --log_dir=/dev/null (torchrun's "no files") both are 0 and log_dir is cleared.
  std::vector<int> redirect_of;  // to the log files only
  std::vector<int> tee_of;       // to the log files and the console
  std::vector<bool> console_of;  // false: --local_ranks_filter hides this rank on the console
  std::vector<int> signals;      // numbers of signals_to_handle
  // --shutdown_timeout (or PET_SHUTDOWN_TIMEOUT), else $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 s.
  std::chrono::milliseconds shutdown_timeout{std::chrono::seconds(30)};
  // --hang_timeout (docs/hangs.md): 0 is off.
  std::chrono::milliseconds hang_timeout{0};
  bool in_place = false;  // --in_place (or rdzv_conf in_place=true)
  bool watch_stragglers = false;  // --watch_stragglers (docs/stragglers.md)
  // --exclude_stragglers, --straggler_cooldown (docs/stragglers.md, "Exclusion").
  bool exclude_stragglers = false;
  bool preflight = false;  // --preflight (docs/stragglers.md, "Pre-flight")
  std::chrono::milliseconds straggler_cooldown =
      muster::rendezvous::limits::kDefaultStragglerCooldown;
  // --health_check CMD, --health_check_timeout (docs/launch.md, "Health checks"): empty: none.
  std::string health_check;
  std::chrono::milliseconds health_check_timeout = muster::rendezvous::limits::kDefaultHealthCheckTimeout;
  int spares = muster::rendezvous::limits::kDefaultSpares;  // --spares (with --in_place)
  int max_restarts_without_progress = 0;          // 0: off
  std::int64_t restart_budget_reset_after_steps = 0;  // 0: off
  ClusterOptions cluster;
  std::string program;
  std::vector<std::string> program_args;
  // Under an srun step or mpirun (scheduler_env.h): what the scheduler's environment gave,
  // one line for the log, with the flags that overrode it; empty otherwise.
  std::string scheduler_summary;
};

// What parsing needs to know about this host (injected so tests can fake it).
struct HostInfo {
  int cpu_count = 1;
  std::function<int()> gpu_count = [] { return 0; };  // called only for gpu/auto
  std::function<int()> xpu_count = [] { return 0; };  // called only for xpu/auto
};

struct ParseResult {
  std::optional<LaunchConfig> config;  // set on success
  std::string help;                    // set when --help was asked for (exit 0)
  absl::Status error;                  // usage error: print one line, exit 2
};

// `args` excludes argv[0]. Everything after the program is the program's own arguments.
// As argparse does for torchrun: an unambiguous prefix of a long flag names it (`--nproc`),
// an ambiguous one is a usage error naming the candidates, and `--flag=` gives the flag an
// empty value (it never takes the next argument). Reads PET_* and
// TORCH_ELASTIC_SHUTDOWN_TIMEOUT from the environment.
//
// Under a scheduler step (srun, mpirun: derive_scheduler_job over `env`) and without
// --standalone, the job's shape comes from the scheduler where no flag (nor PET_*) gives it:
// --nnodes, --nproc_per_node, --rdzv_id, and, unless --rdzv_backend=c10d or --rdzv_endpoint
// is given, the static rendezvous (--node_rank, --master_addr, --master_port). The
// scheduler's own errors are usage errors. MUSTER_SCHEDULER_ENV=0 in `env` turns this off.
// The first form reads `env` from this process's environment.
ParseResult parse_launch_args(const std::vector<std::string>& args, const HostInfo& host);
ParseResult parse_launch_args(const std::vector<std::string>& args, const HostInfo& host,
                              const std::map<std::string, std::string>& env);

// --ssh_args: split as a POSIX shell splits words (blanks; '...' and "..." quoting; \ escapes),
// nothing expanded. An unclosed quote is an error.
absl::StatusOr<std::vector<std::string>> split_shell_words(const std::string& text);

// How the program is started.
struct Entrypoint {
  std::string path;               // the executable actually exec'd
  std::vector<std::string> argv;  // argv[0] included
  std::string name;               // what summaries call the job (the program as given)
  std::string python_reason;      // a Python program: why this interpreter (python.h); else empty
};

// Resolves the program: `--no_python` or a non-.py program: an executable path, or a name
// looked up on PATH; `x.py`: `PYTHON -u x.py`; `-m mod`: `PYTHON -u -m mod`, where PYTHON is
// choose_python's (python.h: PYTHON_EXEC, VIRTUAL_ENV, a python3 on PATH that can import
// torch when the program imports it, python3 from PATH; `probe` asks an interpreter about
// torch). Fails with a usage error when the program or the interpreter is missing or not
// executable.
absl::StatusOr<Entrypoint> resolve_entrypoint(const LaunchConfig& config,
                                              const std::map<std::string, std::string>& env,
                                              const TorchProbe& probe = can_import_torch);

// Looks `name` up as execvp would (a name with a slash is taken as a path).
absl::StatusOr<std::string> find_executable(const std::string& name, const std::string& path_var);

// A regular file this process may execute.
bool is_executable_file(const std::string& path);

// Whether a host is this machine: one of `addresses` (what its name resolved to, looked up
// by the caller) is an address of one of this machine's interfaces. Never by comparing names
// (a pod's hostname and its service name differ; a name may be shared).
bool is_local_host(const std::vector<std::string>& addresses);

// launch's own log level, as an spdlog level name: $MUSTER_LOG_LEVEL when set (spdlog's
// names), else $LOGLEVEL as torchrun reads it (Python's names, any case: DEBUG, INFO,
// WARNING/WARN, ERROR, CRITICAL/FATAL, NOTSET), else "warning". A LOGLEVEL that is not a
// level is an error. Pass nullptr for an unset variable.
absl::StatusOr<std::string> resolve_log_level(const char* muster_log_level, const char* loglevel);

// torchrun's filter lists: comma separated, ",," stands for a comma inside a filter, empty
// items are dropped (so "" is no filter at all). Filters are substrings, kept as given.
std::vector<std::string> parse_filter_list(const std::string& text);

// Number of CUDA devices visible to this process (0 without a driver or a GPU).
int detect_gpu_count();
// Intel GPUs (torch's "xpu") through the Level Zero loader (libze_loader.so.1), loaded only when
// asked; 0 when it is missing or sees none. ZE_AFFINITY_MASK is the loader's to apply.
int detect_xpu_count();

}  // namespace muster::launcher
