#include "muster/launcher/config.h"

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <sstream>

#include <CLI/CLI.hpp>

#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace muster::launcher {
namespace {

absl::StatusOr<int> parse_positive(absl::string_view flag, absl::string_view v) {
  int n = 0;
  if (!absl::SimpleAtoi(v, &n) || n < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": expected a positive integer, got '", v, "'"));
  }
  return n;
}

absl::Status parse_nnodes(const std::string& v, LaunchConfig& c) {
  std::vector<absl::string_view> parts = absl::StrSplit(v, ':');
  if (parts.size() > 2) {
    return absl::InvalidArgumentError(absl::StrCat("--nnodes: expected N or MIN:MAX, got '", v, "'"));
  }
  auto lo = parse_positive("--nnodes", parts[0]);
  if (!lo.ok()) return lo.status();
  auto hi = parts.size() == 2 ? parse_positive("--nnodes", parts[1]) : lo;
  if (!hi.ok()) return hi.status();
  if (*hi < *lo) {
    return absl::InvalidArgumentError(
        absl::StrCat("--nnodes: MIN ", *lo, " is greater than MAX ", *hi));
  }
  c.min_nodes = *lo;
  c.max_nodes = *hi;
  return absl::OkStatus();
}

absl::Status resolve_nproc(LaunchConfig& c, const HostInfo& host) {
  const std::string& v = c.nproc_spec;
  if (v == "cpu") {
    c.nproc_per_node = host.cpu_count;
  } else if (v == "gpu" || v == "auto") {
    int gpus = host.gpu_count();
    if (v == "gpu" && gpus < 1) {
      return absl::InvalidArgumentError("--nproc_per_node=gpu: no CUDA device is visible");
    }
    c.nproc_per_node = gpus > 0 ? gpus : host.cpu_count;
  } else {
    auto n = parse_positive("--nproc_per_node", v);
    if (!n.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--nproc_per_node: expected a positive integer, cpu, gpu or auto, got '", v, "'"));
    }
    c.nproc_per_node = *n;
  }
  return absl::OkStatus();
}

// CLI11's messages can span lines; the user gets one.
std::string one_line(std::string s) {
  for (char& ch : s) {
    if (ch == '\n') ch = ' ';
  }
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

bool is_executable_file(const std::string& p) {
  struct stat st{};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(p.c_str(), X_OK) == 0;
}

}  // namespace

ParseResult parse_launch_args(const std::vector<std::string>& args, const HostInfo& host) {
  ParseResult result;
  LaunchConfig c;
  std::string nnodes = "1";
  double shutdown_s = 30.0;
  CLI::App app{"launch: start a distributed training job (a drop-in for torchrun)", "launch"};
  app.prefix_command();
  app.set_help_flag("-h,--help", "Show this help and exit");
  app.add_option("--nnodes", nnodes, "Number of nodes, N or MIN:MAX (elastic)");
  app.add_option("--nproc_per_node,--nproc-per-node", c.nproc_spec,
                 "Workers per node: an integer, cpu, gpu or auto");
  app.add_flag("--standalone", c.standalone,
               "Single node; the rendezvous server runs inside launch on a free port");
  app.add_option("--max_restarts,--max-restarts", c.max_restarts,
                 "Restarts of the worker group before the job fails");
  app.add_option("--shutdown_timeout,--shutdown-timeout", shutdown_s,
                 "Seconds between SIGTERM and SIGKILL when stopping workers");
  app.add_option("--monitor_interval,--monitor-interval", c.monitor_interval,
                 "Accepted for torchrun compatibility (worker exits are events here)");
  app.add_option("--start_method,--start-method", c.start_method,
                 "Accepted for torchrun compatibility (workers are always fork+exec'd)")
      ->check(CLI::IsMember({"spawn", "fork", "forkserver"}));
  app.add_option("--rdzv_backend,--rdzv-backend", c.rdzv_backend, "Rendezvous backend");
  app.add_option("--rdzv_endpoint,--rdzv-endpoint", c.rdzv_endpoint, "Rendezvous HOST[:PORT]");
  app.add_option("--rdzv_id,--rdzv-id", c.rdzv_id, "Job id shared by every node");
  app.add_option("--role", c.role, "Worker role name (ROLE_NAME)");
  app.add_flag("-m,--module", c.module, "Run PROGRAM as a Python module (python3 -u -m)");
  app.add_flag("--no_python,--no-python", c.no_python, "Run PROGRAM directly, not via python");

  std::vector<std::string> reversed(args.rbegin(), args.rend());
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    result.help = app.help();
    return result;
  } catch (const CLI::ParseError& e) {
    result.error = absl::InvalidArgumentError(one_line(e.what()));
    return result;
  }
  std::vector<std::string> rest = app.remaining();
  if (!rest.empty() && rest.front() == "--") rest.erase(rest.begin());
  if (rest.empty()) {
    result.error = absl::InvalidArgumentError("missing the program to run");
    return result;
  }
  if (rest.front().size() > 1 && rest.front()[0] == '-') {
    result.error = absl::InvalidArgumentError(absl::StrCat("unrecognized option '", rest.front(), "'"));
    return result;
  }
  c.program = rest.front();
  c.program_args.assign(rest.begin() + 1, rest.end());

  if (absl::Status s = parse_nnodes(nnodes, c); !s.ok()) {
    result.error = s;
    return result;
  }
  if (absl::Status s = resolve_nproc(c, host); !s.ok()) {
    result.error = s;
    return result;
  }
  if (c.max_restarts < 0) {
    result.error = absl::InvalidArgumentError("--max_restarts: must be 0 or more");
    return result;
  }
  if (!(shutdown_s >= 0) || !std::isfinite(shutdown_s)) {
    result.error = absl::InvalidArgumentError("--shutdown_timeout: must be 0 or more seconds");
    return result;
  }
  c.shutdown_timeout = std::chrono::milliseconds(static_cast<long long>(shutdown_s * 1000));
  if (c.module && c.no_python) {
    result.error = absl::InvalidArgumentError("-m/--module and --no_python cannot be combined");
    return result;
  }
  if (c.role.empty()) {
    result.error = absl::InvalidArgumentError("--role: must not be empty");
    return result;
  }
  if (c.standalone && c.max_nodes > 1) {
    result.error = absl::InvalidArgumentError("--standalone runs one node: use --nnodes=1");
    return result;
  }
  if (!c.standalone && (c.max_nodes > 1 || !c.rdzv_endpoint.empty())) {
    result.error = absl::UnimplementedError(
        "multi-node rendezvous (--nnodes > 1 or --rdzv_endpoint) is not available yet; "
        "use --standalone");
    return result;
  }
  result.config = std::move(c);
  return result;
}

absl::StatusOr<std::string> find_executable(const std::string& name, const std::string& path_var) {
  if (name.find('/') != std::string::npos) {
    if (::access(name.c_str(), F_OK) != 0) {
      return absl::NotFoundError(absl::StrCat("program '", name, "' does not exist"));
    }
    if (!is_executable_file(name)) {
      return absl::PermissionDeniedError(absl::StrCat("program '", name, "' is not executable"));
    }
    return name;
  }
  for (absl::string_view dir : absl::StrSplit(path_var, ':')) {
    std::string candidate = absl::StrCat(dir.empty() ? "." : dir, "/", name);
    if (is_executable_file(candidate)) return candidate;
  }
  return absl::NotFoundError(absl::StrCat("program '", name, "' not found on PATH"));
}

absl::StatusOr<Entrypoint> resolve_entrypoint(const LaunchConfig& c,
                                              const std::map<std::string, std::string>& env) {
  auto get = [&env](const char* k) {
    auto it = env.find(k);
    return it == env.end() ? std::string() : it->second;
  };
  const std::string path_var = get("PATH");
  Entrypoint e;
  e.name = c.program;
  const bool python = !c.no_python && (c.module || absl::EndsWith(c.program, ".py"));
  if (!python) {
    auto exe = find_executable(c.program, path_var);
    if (!exe.ok()) return exe.status();
    e.path = *exe;
    e.argv.push_back(c.program);
  } else {
    std::string interp = get("PYTHON_EXEC");
    auto exe = find_executable(interp.empty() ? "python3" : interp, path_var);
    if (!exe.ok()) {
      return absl::NotFoundError(absl::StrCat("python interpreter: ", exe.status().message()));
    }
    if (!c.module && ::access(c.program.c_str(), R_OK) != 0) {
      return absl::NotFoundError(absl::StrCat("script '", c.program, "' does not exist"));
    }
    e.path = *exe;
    e.argv = {*exe, "-u"};
    if (c.module) e.argv.push_back("-m");
    e.argv.push_back(c.program);
  }
  e.argv.insert(e.argv.end(), c.program_args.begin(), c.program_args.end());
  return e;
}

int detect_gpu_count() {
  // The driver API, loaded only when asked: no link-time CUDA dependency.
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return 0;
  using InitFn = int (*)(unsigned);
  using CountFn = int (*)(int*);
  auto init = reinterpret_cast<InitFn>(::dlsym(lib, "cuInit"));
  auto count = reinterpret_cast<CountFn>(::dlsym(lib, "cuDeviceGetCount"));
  int n = 0;
  if (init == nullptr || count == nullptr || init(0) != 0 || count(&n) != 0) n = 0;
  return n;
}

}  // namespace muster::launcher
