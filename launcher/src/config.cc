#include "muster/launcher/config.h"

#include "muster/ops/endpoint.h"

#include <arpa/inet.h>
#include <signal.h>
#include <dlfcn.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cctype>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/strip.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "muster/agent/numa.h"
#include "muster/agent/worker_env.h"
#include "muster/launcher/scheduler_env.h"
#include "muster/ops/build_info.h"
#include "muster/rendezvous/limits.h"
#include "muster/rendezvous/resolve.h"
#include "cluster_config.h"
#include "tls_config.h"

namespace muster::launcher {

namespace limits = muster::rendezvous::limits;
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
    return absl::InvalidArgumentError(
        absl::StrCat("--nnodes: expected N or MIN:MAX, got '", v, "'"));
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
  } else if (v == "gpu") {
    c.nproc_per_node = host.gpu_count();
    if (c.nproc_per_node < 1) {
      return absl::InvalidArgumentError("--nproc_per_node=gpu: no CUDA device is visible");
    }
  } else if (v == "xpu") {
    c.nproc_per_node = host.xpu_count();
    if (c.nproc_per_node < 1) {
      return absl::InvalidArgumentError(
          "--nproc_per_node=xpu: no Intel GPU is visible (Level Zero's libze_loader.so.1)");
    }
  } else if (v == "auto") {
    // As torch.accelerator picks: the accelerator present (CUDA first), else the CPUs.
    int n = host.gpu_count();
    if (n < 1) n = host.xpu_count();
    c.nproc_per_node = n > 0 ? n : host.cpu_count;
  } else if (v == "npu" || v == "hpu" || v == "mtia" || v == "mps" || v == "musa" ||
             v == "privateuseone") {
    // Accelerators torchrun counts through torch; launch has no way to count them.
    return absl::InvalidArgumentError(absl::StrCat(
        "--nproc_per_node=", v, ": launch counts CUDA devices (gpu), Intel GPUs (xpu), either "
        "(auto) and CPUs (cpu); give the number of workers"));
  } else {
    auto n = parse_positive("--nproc_per_node", v);
    if (!n.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--nproc_per_node: expected a positive integer, cpu, gpu, xpu or auto, got '", v, "'"));
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

absl::Status resolve_rendezvous(LaunchConfig& c);
absl::Status resolve_output(LaunchConfig& c);

std::string seconds_text(std::chrono::milliseconds d) {
  return absl::StrCat(std::chrono::duration_cast<std::chrono::seconds>(d).count());
}

// Seconds (a decimal number) -> milliseconds, refused above `max`: a huge value must be a
// usage error naming the bound, never an overflow that ends the wait at once.
absl::StatusOr<std::chrono::milliseconds> to_duration(absl::string_view what, double secs,
                                                      std::chrono::milliseconds max) {
  if (secs * 1000 > static_cast<double>(max.count())) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", secs, " s is above the limit of ",
                                                   seconds_text(max), " s"));
  }
  return std::chrono::milliseconds(static_cast<long long>(secs * 1000));
}

absl::StatusOr<std::chrono::milliseconds> parse_seconds(absl::string_view key, absl::string_view v,
                                                        std::chrono::milliseconds max) {
  double secs = 0;
  if (!absl::SimpleAtod(v, &secs) || !(secs >= 0) || !std::isfinite(secs)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rdzv_conf ", key, ": expected seconds, got '", v, "'"));
  }
  return to_duration(absl::StrCat("--rdzv_conf ", key), secs, max);
}

// argparse's ways with long flags, which CLI11 lacks, applied to launch's own arguments (up
// to the program): a unique prefix names its flag (both spellings of one flag are one flag;
// a prefix that matches one torchrun flag and some of launch's own, in `own_groups`,
// names the torchrun flag, as torchrun would), and `--flag=` is an empty value, passed to CLI11 as a separate "" so that it never takes
// the next argument. Unknown flags are left for CLI11 to name.
absl::StatusOr<std::vector<std::string>> expand_long_flags(const CLI::App& app,
                                                           const std::vector<std::string>& args,
                                                           const std::set<std::string>& own_groups) {
  std::map<std::string, const CLI::Option*> long_names, short_names;
  for (const CLI::Option* o : app.get_options()) {
    for (const std::string& n : o->get_lnames()) long_names.emplace(n, o);
    for (const std::string& n : o->get_snames()) short_names.emplace(n, o);
  }
  auto takes_value = [](const CLI::Option* o) { return o->get_items_expected_min() > 0; };
  std::vector<std::string> out;
  std::size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--" || a.size() < 2 || a[0] != '-') break;  // the program: the rest is its own
    if (a[1] != '-') {  // a short flag: -r and -t take the next argument unless attached (-r3)
      out.push_back(a);
      auto it = short_names.find(a.substr(1));
      if (it != short_names.end() && takes_value(it->second) && i + 1 < args.size()) {
        out.push_back(args[++i]);
      }
      continue;
    }
    const auto eq = a.find('=');
    const std::string name = a.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    const CLI::Option* opt = nullptr;
    std::string full = name;
    if (auto exact = long_names.find(name); exact != long_names.end()) {
      opt = exact->second;
    } else {
      std::vector<std::string> candidates;  // the first matching name of each flag
      std::set<const CLI::Option*> flags;
      for (auto it = long_names.lower_bound(name);
           it != long_names.end() && absl::StartsWith(it->first, name); ++it) {
        if (flags.insert(it->second).second) {
          candidates.push_back("--" + it->second->get_lnames().front());  // its first spelling
        }
      }
      // A prefix that torchrun itself would take as one of its flags still means that flag:
      // launch's own flags (the group `own_group`) need more letters where they share one.
      if (candidates.size() > 1) {
        std::set<const CLI::Option*> torchrun_flags;
        for (const CLI::Option* o : flags) {
          if (own_groups.count(o->get_group()) == 0) torchrun_flags.insert(o);
        }
        if (torchrun_flags.size() == 1) {
          flags = torchrun_flags;
          candidates = {"--" + (*flags.begin())->get_lnames().front()};
        }
      }
      if (candidates.size() > 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "ambiguous option '--", name, "' could match ", absl::StrJoin(candidates, ", ")));
      }
      if (candidates.size() == 1) {
        opt = *flags.begin();
        full = opt->get_lnames().front();
      }
    }
    if (opt == nullptr) {
      out.push_back(a);
      continue;
    }
    if (eq == std::string::npos) {
      out.push_back("--" + full);
      if (takes_value(opt) && i + 1 < args.size()) out.push_back(args[++i]);
    } else if (eq + 1 == a.size() && takes_value(opt)) {
      out.push_back("--" + full);
      out.push_back("");
    } else {
      out.push_back(absl::StrCat("--", full, a.substr(eq)));
    }
  }
  out.insert(out.end(), args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
  return out;
}

// CLI11 turns an empty value into 0 for a number; argparse refuses it, and so does launch.
CLI::Validator not_empty() {
  return CLI::Validator(
      [](std::string& v) { return v.empty() ? std::string("expected a number, got ''") : ""; },
      "", "not empty");
}

constexpr int kDefaultMasterPort = 29500;

// The flags a scheduler's job may fill; one given (on the command line or by PET_*: CLI11
// counts both) wins.
struct SchedulerFlags {
  CLI::Option* nnodes = nullptr;
  CLI::Option* nproc = nullptr;
  CLI::Option* rdzv_endpoint = nullptr;
  CLI::Option* rdzv_id = nullptr;
  CLI::Option* node_rank = nullptr;
  CLI::Option* master_addr = nullptr;
  CLI::Option* master_port = nullptr;
};

// Fills from `job` what no flag gave, and says so in c.scheduler_summary. The static
// rendezvous's ranks come along unless the user chose c10d; its place (master address and
// port) only when no --rdzv_endpoint names it either.
absl::Status apply_scheduler_job(const SchedulerJob& job, const SchedulerFlags& given,
                                 LaunchConfig& c, std::string& nnodes, HostInfo& counted) {
  std::vector<std::string> kept;
  auto from_job = [&kept](const CLI::Option* o) {
    if (o->count() == 0) return true;
    kept.push_back("--" + o->get_lnames().front());
    return false;
  };
  if (from_job(given.nnodes)) nnodes = absl::StrCat(job.nnodes);
  if (job.nproc_per_node && from_job(given.nproc)) {
    c.nproc_spec = absl::StrCat(*job.nproc_per_node);
  }
  if (job.cpus_on_node) counted.cpu_count = *job.cpus_on_node;  // cpu, and auto without GPUs
  if (from_job(given.rdzv_id)) c.rdzv_id = job.run_id;
  std::string note;
  if (c.rdzv_backend == "static") {
    if (from_job(given.node_rank)) c.node_rank = job.node_rank;
    const bool endpoint_given = given.rdzv_endpoint->count() > 0;
    if (endpoint_given) {
      // Still the workers' MASTER_ADDR where the scheduler knows it.
      if (!job.master_addr.empty() && from_job(given.master_addr)) c.master_addr = job.master_addr;
    } else if (from_job(given.master_addr)) {
      if (job.master_addr.empty()) return absl::InvalidArgumentError(job.missing_master);
      c.master_addr = job.master_addr;
    }
    if (from_job(given.master_port)) c.master_port = job.master_port;
    note = endpoint_given ? "; the rendezvous is --rdzv_endpoint's" : "; static rendezvous";
  } else {
    note = absl::StrCat("; the rendezvous is --rdzv_backend=", c.rdzv_backend, "'s");
  }
  c.scheduler_summary = absl::StrCat(job.summary, note);
  if (!kept.empty()) {
    absl::StrAppend(&c.scheduler_summary, "; given, so kept: ", absl::StrJoin(kept, ", "));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Endpoint> parse_endpoint(const std::string& text, int default_port) {
  auto e = ops::parse_host_port(text, default_port, 0);
  if (!e.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--rdzv_endpoint: '", text, "' ",
                                                   e.status().message(), " (expected HOST[:PORT])"));
  }
  return *e;
}

absl::StatusOr<std::vector<Endpoint>> parse_endpoints(const std::string& text, int default_port) {
  std::vector<Endpoint> out;
  for (absl::string_view raw : absl::StrSplit(text, ',')) {
    absl::string_view item = absl::StripAsciiWhitespace(raw);
    if (item.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--rdzv_endpoint: '", text, "' has an empty item (expected HOST[:PORT],...)"));
    }
    auto e = parse_endpoint(std::string(item), default_port);
    if (!e.ok()) return e.status();
    out.push_back(std::move(*e));
  }
  if (out.size() > limits::kMaxRdzvEndpoints) {
    return absl::InvalidArgumentError(absl::StrCat("--rdzv_endpoint: ", out.size(),
                                                   " endpoints, more than the limit of ",
                                                   limits::kMaxRdzvEndpoints));
  }
  if (out.size() > 1) {
    for (const Endpoint& e : out) {
      if (e.port == 0) {
        return absl::InvalidArgumentError(
            "--rdzv_endpoint: port 0 (a free port) is for a single endpoint on a single node");
      }
    }
  }
  return out;
}

absl::StatusOr<RdzvConf> parse_rdzv_conf(const std::string& text) {
  RdzvConf c;
  absl::string_view all = absl::StripAsciiWhitespace(text);
  // One pair of quotes around the whole text, as a shell-less caller passes it through.
  if (all.size() >= 2 && (all.front() == '\'' || all.front() == '"') && all.back() == all.front()) {
    all = absl::StripAsciiWhitespace(all.substr(1, all.size() - 2));
  }
  if (all.empty()) return c;
  for (absl::string_view raw : absl::StrSplit(all, ',')) {
    absl::string_view item = absl::StripAsciiWhitespace(raw);
    if (item.empty()) continue;
    auto eq = item.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat("--rdzv_conf: '", item, "' is not key=value"));
    }
    absl::string_view key = absl::StripAsciiWhitespace(item.substr(0, eq));
    absl::string_view value = absl::StripAsciiWhitespace(item.substr(eq + 1));
    if (key.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--rdzv_conf: '", item, "' has no key"));
    }
    auto seconds = [&](std::chrono::milliseconds& into,
                       std::chrono::milliseconds max) -> absl::Status {
      auto v = parse_seconds(key, value, max);
      if (!v.ok()) return v.status();
      into = *v;
      return absl::OkStatus();
    };
    absl::Status st;
    if (key == "join_timeout") {
      st = seconds(c.timeouts.join_timeout, limits::kMaxJoinTimeout);
    } else if (key == "last_call_timeout") {
      st = seconds(c.timeouts.last_call_timeout, limits::kMaxLastCallTimeout);
    } else if (key == "close_timeout") {
      st = seconds(c.close_timeout, limits::kMaxCloseTimeout);
    } else if (key == "read_timeout") {
      st = seconds(c.read_timeout, limits::kMaxReadTimeout);
    } else if (key == "reattach_timeout") {
      st = seconds(c.timeouts.reattach_timeout, limits::kMaxReattachTimeout);
      if (st.ok() && c.timeouts.reattach_timeout.count() == 0) {
        st = absl::InvalidArgumentError("--rdzv_conf reattach_timeout: must be above 0");
      }
    } else if (key == "keep_alive_interval") {
      st = seconds(c.timeouts.keep_alive_interval, limits::kMaxKeepAliveInterval);
      if (st.ok() && c.timeouts.keep_alive_interval.count() == 0) {
        st = absl::InvalidArgumentError("--rdzv_conf keep_alive_interval: must be above 0");
      }
    } else if (key == "keep_alive_max_attempt") {
      std::int64_t n = 0;
      if (!absl::SimpleAtoi(value, &n) || n < 1) {
        st = absl::InvalidArgumentError(absl::StrCat(
            "--rdzv_conf keep_alive_max_attempt: expected a positive integer, got '", value, "'"));
      } else if (n > limits::kMaxKeepAliveAttempts) {
        st = absl::InvalidArgumentError(
            absl::StrCat("--rdzv_conf keep_alive_max_attempt: ", n, " is above the limit of ",
                         limits::kMaxKeepAliveAttempts));
      } else {
        c.timeouts.keep_alive_max_attempt = static_cast<int>(n);
      }
    } else if (key == "token") {
      c.token = std::string(value);
    } else if (key == "tls_ca") {
      c.tls.ca = std::string(value);
    } else if (key == "tls_cert") {
      c.tls.cert = std::string(value);
    } else if (key == "tls_key") {
      c.tls.key = std::string(value);
    } else if (key == "tls_server_name") {
      c.tls.server_name = std::string(value);
    } else if (key == "is_host" || key == "use_agent_store") {
      std::string v = absl::AsciiStrToLower(value);
      std::optional<bool> b;
      if (v == "1" || v == "true" || v == "yes") b = true;
      if (v == "0" || v == "false" || v == "no") b = false;
      if (!b) {
        st = absl::InvalidArgumentError(absl::StrCat("--rdzv_conf ", key,
                                                     ": expected true or false, got '", value, "'"));
      } else if (key == "is_host") {
        c.is_host = b;
      } else {
        c.use_agent_store = *b;
      }
    } else {
      // torchrun hands every key to its backend: `timeout`, `heartbeat_timeout`,
      // `store_type`, `use_libuv`, a custom backend's own. None changes anything here.
      c.ignored_keys.emplace_back(key);
    }
    if (!st.ok()) return st;
  }
  const auto& t = c.timeouts;
  if (t.keep_alive_interval > limits::kMaxLivenessWindow / t.keep_alive_max_attempt) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--rdzv_conf: keep_alive_interval x keep_alive_max_attempt (the liveness window) is "
        "above the limit of ",
        std::chrono::duration_cast<std::chrono::seconds>(limits::kMaxLivenessWindow).count(),
        " s"));
  }
  return c;
}

bool is_local_host(const std::string& host, const std::vector<std::string>& addresses) {
  if (host == "localhost") return true;
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) == 0 && host == name) return true;
  return muster::rendezvous::is_local_address(addresses);
}

namespace {

// --rdzv_conf, and its token's fallback, $MUSTER_RDZV_TOKEN: for every kind of launch.
absl::Status resolve_rdzv_conf(LaunchConfig& c) {
  auto conf = parse_rdzv_conf(c.rdzv_conf_text);
  if (!conf.ok()) return conf.status();
  c.rdzv_conf = *conf;
  if (c.rdzv_conf.token.empty()) {
    if (const char* t = std::getenv("MUSTER_RDZV_TOKEN"); t != nullptr) c.rdzv_conf.token = t;
  }
  return absl::OkStatus();
}

absl::Status resolve_rendezvous(LaunchConfig& c) {
  if (c.master_port < 0 || c.master_port > 65535) {
    return absl::InvalidArgumentError("--master_port: must be a port number");
  }
  // torchrun >= 2.6: one node, static, no endpoint and no master port is --standalone (c10d on
  // a free port, a random run id), so two such jobs on one host never meet on 29500.
  if (!c.standalone && c.rdzv_backend == "static" && c.max_nodes == 1 &&
      c.rdzv_endpoint.empty() && c.master_port == 0) {
    c.standalone = true;
    c.rdzv_backend = "c10d";
  }
  if (c.standalone) {
    c.mode = RdzvMode::kEmbedded;
    return absl::OkStatus();
  }
  std::optional<Endpoint> ep;  // --rdzv_endpoint, parsed once
  if (!c.rdzv_endpoint.empty()) {
    auto parsed = parse_endpoints(c.rdzv_endpoint, kDefaultRdzvPort);
    if (!parsed.ok()) return parsed.status();
    ep = parsed->front();
    c.more_endpoints.assign(parsed->begin() + 1, parsed->end());
  }
  if (c.rdzv_backend == "static") {
    if (c.min_nodes != c.max_nodes) {
      return absl::InvalidArgumentError(
          "--rdzv_backend=static needs a fixed --nnodes (MIN:MAX is for c10d)");
    }
    if (c.node_rank < 0) c.node_rank = 0;
    if (c.node_rank >= c.max_nodes) {
      return absl::InvalidArgumentError(
          absl::StrCat("--node_rank: ", c.node_rank, " is not below --nnodes=", c.max_nodes));
    }
    const bool master_addr_given = !c.master_addr.empty();
    const bool master_port_given = c.master_port != 0;
    if (c.master_addr.empty()) c.master_addr = "127.0.0.1";
    if (c.master_port == 0) c.master_port = kDefaultMasterPort;
    if (ep) {
      // torchrun's static rendezvous: the workers' MASTER_ADDR is the endpoint's host (node 0,
      // which hosts the server there), not 127.0.0.1; MASTER_PORT stays theirs, apart from the
      // server's port.
      if (!master_addr_given) c.master_addr = ep->host;
      if (!master_port_given && ep->port == c.master_port) c.master_port = ep->port + 1;
      if (c.master_port > 65535) return absl::InvalidArgumentError("--rdzv_endpoint: port too high");
    }
    if (c.max_nodes == 1 && c.rdzv_endpoint.empty()) {
      c.mode = RdzvMode::kEmbedded;  // nobody else to meet: the server stays private
      return absl::OkStatus();
    }
    c.mode = RdzvMode::kStatic;
    if (c.rdzv_endpoint.empty()) {
      // MASTER_PORT belongs to the workers (torch's TCPStore); the server takes the next one.
      c.endpoint = Endpoint{c.master_addr, c.master_port + 1};
      if (c.endpoint.port > 65535) return absl::InvalidArgumentError("--master_port: too high");
      return absl::OkStatus();
    }
  } else if (c.rdzv_backend == "c10d") {
    c.mode = RdzvMode::kC10d;
    if (c.rdzv_endpoint.empty()) {
      if (c.max_nodes == 1) {
        c.mode = RdzvMode::kEmbedded;
        return absl::OkStatus();
      }
      return absl::InvalidArgumentError("--rdzv_backend=c10d needs --rdzv_endpoint=HOST[:PORT]");
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--rdzv_backend: '", c.rdzv_backend,
                                                   "' is not supported (use c10d or static)"));
  }
  c.endpoint = *ep;  // every branch without an endpoint has returned
  if (c.endpoint.port == 0) {
    // torchrun's recipe for several single-node jobs on one host: the agent hosts the server
    // on a port the kernel picks. Nobody else has to find it, so nobody else may be expected.
    if (c.max_nodes > 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--rdzv_endpoint: port 0 (a free port) is for a single node (--nnodes=1); other nodes "
          "could not find it"));
    }
    c.mode = RdzvMode::kEmbedded;
  }
  return absl::OkStatus();
}

// torchrun's Std spec: "N" for every local rank, or "rank:N,rank:N" (others 0); N in 0..3.
absl::StatusOr<std::vector<int>> parse_std(absl::string_view flag, const std::string& v, int nproc) {
  std::vector<int> out(nproc, 0);
  auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        flag, ": expected 0-3 (1 stdout, 2 stderr, 3 both) or LOCAL_RANK:N,..., got '", v, "'"));
  };
  int n = 0;
  if (absl::SimpleAtoi(v, &n)) {
    if (n < 0 || n > 3) return bad();
    std::fill(out.begin(), out.end(), n);
    return out;
  }
  for (absl::string_view item : absl::StrSplit(v, ',')) {
    std::vector<absl::string_view> kv = absl::StrSplit(item, ':');
    int rank = 0;
    if (kv.size() != 2 || !absl::SimpleAtoi(kv[0], &rank) || !absl::SimpleAtoi(kv[1], &n) ||
        n < 0 || n > 3 || rank < 0) {
      return bad();
    }
    if (rank < nproc) out[rank] = n;
  }
  return out;
}

absl::Status resolve_output(LaunchConfig& c) {
  auto redirects = parse_std("--redirects", c.redirects, c.nproc_per_node);
  if (!redirects.ok()) return redirects.status();
  auto tee = parse_std("--tee", c.tee, c.nproc_per_node);
  if (!tee.ok()) return tee.status();
  c.redirect_of = *redirects;
  c.tee_of = *tee;
  const bool no_files = c.log_dir == "/dev/null";
  if (no_files) {
    // torchrun's "no files": every stream stays on the console, nothing is written.
    c.log_dir.clear();
    std::fill(c.redirect_of.begin(), c.redirect_of.end(), 0);
    std::fill(c.tee_of.begin(), c.tee_of.end(), 0);
  }
  // torchrun tees by redirecting to the file and tailing it: a teed stream reaches the
  // console even when it is also redirected.
  for (int r = 0; r < c.nproc_per_node; ++r) c.redirect_of[r] &= ~c.tee_of[r];
  c.console_of.assign(c.nproc_per_node, c.local_ranks_filter.empty());
  if (!c.local_ranks_filter.empty()) {
    for (absl::string_view r : absl::StrSplit(c.local_ranks_filter, ',')) {
      int rank = 0;
      if (!absl::SimpleAtoi(r, &rank) || rank < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--local_ranks_filter: expected local ranks like 0,2, got '", c.local_ranks_filter, "'"));
      }
      if (rank < c.nproc_per_node) c.console_of[rank] = true;
    }
  }
  if (!no_files) {  // --log_dir=/dev/null: nowhere to write the filtered copies either
    c.duplicate_stdout_filters = parse_filter_list(c.duplicate_stdout_text);
    c.duplicate_stderr_filters = parse_filter_list(c.duplicate_stderr_text);
  }
  c.signals.clear();
  for (absl::string_view name : absl::StrSplit(c.signals_to_handle, ',', absl::SkipEmpty())) {
    std::string n = absl::AsciiStrToUpper(absl::StripAsciiWhitespace(name));
    if (!absl::StartsWith(n, "SIG")) n = "SIG" + n;
    int num = 0;
    for (int sig = 1; sig < NSIG && num == 0; ++sig) {
      const char* abbrev = sigabbrev_np(sig);
      if (abbrev != nullptr && n == absl::StrCat("SIG", abbrev)) num = sig;
    }
    if (num == 0 || num == SIGKILL || num == SIGSTOP) {
      return absl::InvalidArgumentError(
          absl::StrCat("--signals_to_handle: '", name, "' is not a signal launch can handle"));
    }
    c.signals.push_back(num);
  }
  return absl::OkStatus();
}

// torchrun's `${hostname}` prefix macro (torch's socket.gethostname(): the short name; the
// same for every worker of this node, so it is put in here, before the agent expands the
// per-worker macros). As Template.safe_substitute: `$hostname` too, `$$` stays for the agent
// to turn into `$`, and a longer name (`$hostnames`) is not this macro.
std::string substitute_hostname(const std::string& tmpl) {
  if (tmpl.find('$') == std::string::npos) return tmpl;
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) name[0] = '\0';
  constexpr absl::string_view kBraced = "${hostname}", kBare = "$hostname";
  auto ident = [](char ch) { return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_'; };
  std::string out;
  for (std::size_t i = 0; i < tmpl.size();) {
    const absl::string_view rest = absl::string_view(tmpl).substr(i);
    if (absl::StartsWith(rest, "$$")) {
      out += "$$";
      i += 2;
    } else if (absl::StartsWith(rest, kBraced)) {
      out += name;
      i += kBraced.size();
    } else if (absl::StartsWith(rest, kBare) &&
               (rest.size() == kBare.size() || !ident(rest[kBare.size()]))) {
      out += name;
      i += kBare.size();
    } else {
      out += tmpl[i++];
    }
  }
  return out;
}

}  // namespace

ParseResult parse_launch_args(const std::vector<std::string>& args, const HostInfo& host) {
  return parse_launch_args(args, host, muster::agent::current_environment());
}

ParseResult parse_launch_args(const std::vector<std::string>& args, const HostInfo& host,
                              const std::map<std::string, std::string>& env) {
  ParseResult result;
  LaunchConfig c;
  std::string nnodes = "1";
  double shutdown_s = 30.0;
  CLI::App app{"launch: start a distributed training job (a drop-in for torchrun)", "launch"};
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
  // Every flag also reads PET_<NAME> (torchrun's env defaults, as Kubeflow's PyTorchJob sets
  // them); a flag on the command line wins.
  auto pet = [](CLI::Option* o, const char* group) {
    std::string name = o->get_lnames().front();
    for (char& ch : name) ch = ch == '-' ? '_' : static_cast<char>(std::toupper(ch));
    return o->envname("PET_" + name)->group(group);
  };
  const char* kRdzv = "Rendezvous";
  const char* kStatic = "Static rendezvous";
  const char* kWorkers = "Workers";
  const char* kProgram = "Program";
  const char* kLogs = "Logs and output";
  // launch's own operator flags (docs/operations.md): like kCluster and kHangs, they take no
  // prefix away from torchrun's flags.
  const char* kOps = "Operations (docs/operations.md)";
  const char* kCompat = "Accepted for torchrun compatibility";
  SchedulerFlags given;
  given.nnodes = pet(app.add_option("--nnodes", nnodes, "Number of nodes, N or MIN:MAX (elastic)"), kRdzv);
  given.nproc = pet(app.add_option("--nproc_per_node,--nproc-per-node", c.nproc_spec,
                     "Workers per node: an integer, cpu, gpu, xpu or auto"),
      kWorkers);
  pet(app.add_flag("--standalone", c.standalone,
                   "Single node; the rendezvous server runs inside launch on a free port"),
      kRdzv);
  pet(app.add_option("--max_restarts,--max-restarts", c.max_restarts,
                     "Restarts of the worker group before the job fails"),
      kWorkers)
      ->check(not_empty());
  CLI::Option* shutdown_opt =
      pet(app.add_option("--shutdown_timeout,--shutdown-timeout", shutdown_s,
                         "Seconds between SIGTERM and SIGKILL when stopping workers (default "
                         "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30)"),
          kWorkers)
          ->check(not_empty());
  pet(app.add_option("--signals_to_handle,--signals-to-handle", c.signals_to_handle,
                     "Signals forwarded to the workers (comma-separated names)"),
      kWorkers);
  pet(app.add_option("--role", c.role, "Worker role name (ROLE_NAME)"), kWorkers);
  CLI::Option* numa_opt = pet(app.add_option("--numa_binding,--numa-binding", c.numa_binding,
                     "Bind each local rank to CPUs (and memory) near its GPU, or round-robin "
                     "over NUMA nodes without GPUs: node, socket, exclusive or core-complex"),
      kWorkers);
  pet(app.add_flag("--virtual_local_rank,--virtual-local-rank", c.virtual_local_rank,
                   "Every worker gets LOCAL_RANK=0 and only its own device in "
                   "CUDA_VISIBLE_DEVICES (its local rank's, or that entry of launch's list)"),
      kWorkers);
  pet(app.add_option("--rdzv_backend,--rdzv-backend", c.rdzv_backend,
                     "static (the default: fixed nodes, --node_rank) or c10d (elastic)"),
      kRdzv);
  given.rdzv_endpoint = pet(app.add_option("--rdzv_endpoint,--rdzv-endpoint", c.rdzv_endpoint,
                     "Rendezvous HOST[:PORT]"),
      kRdzv);
  given.rdzv_id =
      pet(app.add_option("--rdzv_id,--rdzv-id", c.rdzv_id, "Job id shared by every node"), kRdzv);
  pet(app.add_option("--rdzv_conf,--rdzv-conf", c.rdzv_conf_text,
                     "key=value,... : join_timeout, last_call_timeout, close_timeout, "
                     "keep_alive_interval, keep_alive_max_attempt, read_timeout, "
                     "reattach_timeout (seconds), token, is_host, use_agent_store, tls_ca, tls_cert, "
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
  given.node_rank =
      pet(app.add_option("--node_rank,--node-rank", c.node_rank, "This node's rank"), kStatic)
          ->check(not_empty());
  given.master_addr = pet(app.add_option("--master_addr,--master-addr", c.master_addr,
                     "Workers' MASTER_ADDR (default 127.0.0.1)"),
      kStatic);
  given.master_port = pet(app.add_option("--master_port,--master-port", c.master_port,
                     "Workers' MASTER_PORT (default 29500)"),
      kStatic)
      ->check(not_empty());
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
  std::string prefix_flag;
  pet(app.add_option("--log_line_prefix_template,--log-line-prefix-template", prefix_flag,
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
  pet(app.add_option("--monitor_interval,--monitor-interval", c.monitor_interval,
                     "Accepted (worker exits are events here)"),
      kCompat)
      ->check(not_empty());
  pet(app.add_option("--start_method,--start-method", c.start_method,
                     "Accepted (workers are always fork+exec'd)"),
      kCompat)
      ->check(CLI::IsMember({"spawn", "fork", "forkserver"}));
  const char* kHangs = "Hangs (docs/hangs.md)";
  double hang_s = 0;
  CLI::Option* hang_opt =
      pet(app.add_option("--hang_timeout,--hang-timeout", hang_s,
                         "Seconds a rank's progress (its progress page) may stay still while "
                         "another rank got further; then its stacks are dumped and the group "
                         "fails (0: off, the default)"),
          kHangs)
          ->check(not_empty());
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
  const char* kCluster = "Many hosts from one command (docs/cluster.md)";
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
  std::string logs_specs;
  pet(app.add_option("--logs_specs,--logs-specs", logs_specs,
                     "Refused: a Python plug-in hook (use --log_dir, --redirects, --tee)"),
      kCompat);

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
  std::vector<std::string> rest = app.remaining();
  if (!rest.empty() && rest.front() == "--") rest.erase(rest.begin());
  if (rest.empty()) {
    result.error = absl::InvalidArgumentError("missing the program to run");
    return result;
  }
  if (rest.front().size() > 1 && rest.front()[0] == '-') {
    result.error =
        absl::InvalidArgumentError(absl::StrCat("unrecognized option '", rest.front(), "'"));
    return result;
  }
  c.program = rest.front();
  c.program_args.assign(rest.begin() + 1, rest.end());

  if (!logs_specs.empty()) {
    result.error = absl::UnimplementedError(
        "--logs_specs names a Python plug-in, which launch cannot load; use --log_dir, "
        "--redirects and --tee");
    return result;
  }
  // Under srun or mpirun the scheduler gives what no flag did (scheduler_env.h); not to a
  // launch that starts the hosts itself (--hosts, --hostfile).
  const bool cluster = !c.cluster.hosts_text.empty() || !c.cluster.hostfile.empty();
  HostInfo counted = host;
  if (!c.standalone && !cluster && scheduler_env_enabled(env)) {
    auto job = derive_scheduler_job(env);
    if (!job.ok()) {
      result.error = job.status();
      return result;
    }
    if (job->has_value()) {
      if (absl::Status s = apply_scheduler_job(**job, given, c, nnodes, counted); !s.ok()) {
        result.error = s;
        return result;
      }
    }
  }
  if (absl::Status s = parse_nnodes(nnodes, c); !s.ok()) {
    result.error = s;
    return result;
  }
  // With --hosts, cpu/gpu/xpu/auto are counted by each host's agent on its own machine.
  const bool counted_remotely =
      cluster && (c.nproc_spec == "cpu" || c.nproc_spec == "gpu" || c.nproc_spec == "xpu" ||
                  c.nproc_spec == "auto");
  if (counted_remotely) {
    c.nproc_per_node = 1;
  } else if (absl::Status s = resolve_nproc(c, counted); !s.ok()) {
    result.error = s;
    return result;
  }
  if (c.max_restarts < 0) {
    result.error = absl::InvalidArgumentError("--max_restarts: must be 0 or more");
    return result;
  }
  // torchrun's order: the flag (or PET_SHUTDOWN_TIMEOUT), then TORCH_ELASTIC_SHUTDOWN_TIMEOUT.
  std::string shutdown_from = "--shutdown_timeout";
  if (const char* env = std::getenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT");
      env != nullptr && shutdown_opt->count() == 0) {
    shutdown_from = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT";
    if (!absl::SimpleAtod(env, &shutdown_s)) {
      result.error = absl::InvalidArgumentError(
          absl::StrCat("TORCH_ELASTIC_SHUTDOWN_TIMEOUT: expected seconds, got '", env, "'"));
      return result;
    }
  }
  if (!(shutdown_s >= 0) || !std::isfinite(shutdown_s)) {
    result.error =
        absl::InvalidArgumentError(absl::StrCat(shutdown_from, ": must be 0 or more seconds"));
    return result;
  }
  if (auto d = to_duration(shutdown_from, shutdown_s, limits::kMaxShutdownTimeout);
      d.ok()) {
    c.shutdown_timeout = *d;
  } else {
    result.error = d.status();
    return result;
  }
  if (hang_opt->count() > 0) {
    if (!(hang_s >= 0) || !std::isfinite(hang_s)) {
      result.error = absl::InvalidArgumentError("--hang_timeout: must be 0 or more seconds");
      return result;
    }
    auto d = to_duration("--hang_timeout", hang_s, limits::kMaxHangTimeout);
    if (!d.ok()) {
      result.error = d.status();
      return result;
    }
    c.hang_timeout = *d;
  }
  // torchrun: --run_path takes precedence over --no_python (and -m); only -m with
  // --no_python is an error.
  if (c.run_path) c.module = c.no_python = false;
  if (c.module && c.no_python) {
    result.error = absl::InvalidArgumentError("-m/--module and --no_python cannot be combined");
    return result;
  }
  // torchrun: the flag when given non-empty, else the variable.
  if (!prefix_flag.empty()) {
    c.log_line_prefix_template = substitute_hostname(prefix_flag);
  } else if (auto it = env.find("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"); it != env.end()) {
    c.log_line_prefix_template = substitute_hostname(it->second);
  }
  if (absl::Status s = resolve_output(c); !s.ok()) {
    result.error = s;
    return result;
  }
  if (numa_opt->count() > 0 || !c.numa_binding.empty()) {  // given empty: not a mode either
    auto m = muster::agent::parse_numa_mode(c.numa_binding);
    if (!m.ok()) {
      result.error = m.status();
      return result;
    }
    c.numa_mode = *m;
  }
  if (c.virtual_local_rank) {
    if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES"); visible != nullptr) {
      const std::string list = visible;
      for (int lr = 0; lr < c.nproc_per_node; ++lr) {
        if (auto d = muster::agent::virtual_visible_device(&list, lr); !d.ok()) {
          result.error = d.status();
          return result;
        }
      }
    }
  }
  if (c.role.empty()) {
    result.error = absl::InvalidArgumentError("--role: must not be empty");
    return result;
  }
  if (c.standalone && c.max_nodes > 1) {
    result.error = absl::InvalidArgumentError("--standalone runs one node: use --nnodes=1");
    return result;
  }
  if (absl::Status s = resolve_rdzv_conf(c); !s.ok()) {
    result.error = s;
    return result;
  }
  if (absl::Status s = resolve_tls(c, env, cluster); !s.ok()) {
    result.error = s;
    return result;
  }
  if (cluster) {
    auto flag_given = [&app](std::string_view name) {
      for (const CLI::Option* o : app.get_options()) {
        if (o->get_lnames().front() == name) return o->count() > 0;
      }
      return false;
    };
    if (absl::Status s = resolve_cluster(c, flag_given); !s.ok()) {
      result.error = s;
      return result;
    }
    // Every host's agent gets this command's launch flags, less the driver's (above).
    const std::size_t flag_count = expanded->size() - (c.program_args.size() + 1);
    std::map<std::string, const CLI::Option*> by_name;
    for (const CLI::Option* o : app.get_options()) {
      for (const std::string& n : o->get_lnames()) by_name.emplace(n, o);
    }
    for (std::size_t i = 0; i < flag_count; ++i) {
      const std::string& a = (*expanded)[i];
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
  } else if (absl::Status s = resolve_rendezvous(c); !s.ok()) {
    result.error = s;
    return result;
  } else if (c.client_tls.enabled() && c.client_tls.files.server_name.empty()) {
    c.client_tls.files.server_name = c.mode == RdzvMode::kEmbedded ? "localhost" : c.endpoint.host;
  }
  result.config = std::move(c);
  return result;
}

bool is_executable_file(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(p.c_str(), X_OK) == 0;
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
                                              const std::map<std::string, std::string>& env,
                                              const TorchProbe& probe) {
  auto it = env.find("PATH");
  const std::string path_var = it == env.end() ? std::string() : it->second;
  Entrypoint e;
  e.name = c.program;
  const bool python =
      !c.no_python && (c.module || c.run_path || absl::EndsWith(c.program, ".py"));
  if (!python) {
    auto exe = find_executable(c.program, path_var);
    if (!exe.ok()) return exe.status();
    e.path = *exe;
    e.argv.push_back(c.program);
  } else {
    if (!c.module && ::access(c.program.c_str(), R_OK) != 0) {
      return absl::NotFoundError(absl::StrCat("script '", c.program, "' does not exist"));
    }
    const std::string source = c.module ? module_source(c.program) : c.program;
    const bool wants_torch = !source.empty() && script_imports_torch(source);
    auto choice = choose_python(env, wants_torch, probe, kTorchProbeBudget);
    if (!choice.ok()) return choice.status();
    e.path = choice->path;
    e.python_reason = choice->reason;
    e.argv = {choice->path, "-u"};
    if (c.module) e.argv.push_back("-m");
    e.argv.push_back(c.program);
  }
  // torch.distributed.launch's argument (torch 2.x spells it --local-rank; the agent puts each
  // worker's local rank in place of the macro, as torchrun does for any ${local_rank}).
  if (c.legacy_launch && !c.use_env) e.argv.push_back("--local-rank=${local_rank}");
  e.argv.insert(e.argv.end(), c.program_args.begin(), c.program_args.end());
  return e;
}

absl::StatusOr<std::string> resolve_log_level(const char* muster_log_level, const char* loglevel) {
  if (muster_log_level != nullptr) return std::string(muster_log_level);
  if (loglevel == nullptr) return std::string("warning");
  const std::string v = absl::AsciiStrToUpper(absl::StripAsciiWhitespace(loglevel));
  static constexpr std::pair<const char*, const char*> kPython[] = {
      {"NOTSET", "trace"}, {"DEBUG", "debug"},       {"INFO", "info"},
      {"WARNING", "warning"}, {"WARN", "warning"},   {"ERROR", "error"},
      {"CRITICAL", "critical"}, {"FATAL", "critical"},
  };
  for (const auto& [python, spd] : kPython) {
    if (v == python) return std::string(spd);
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "LOGLEVEL: '", loglevel, "' is not a log level (DEBUG, INFO, WARNING, ERROR, CRITICAL)"));
}

std::vector<std::string> parse_filter_list(const std::string& text) {
  std::vector<std::string> out;
  std::string item;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] != ',') {
      item += text[i];
    } else if (i + 1 < text.size() && text[i + 1] == ',') {
      item += ',';  // ",," is a comma inside the filter
      ++i;
    } else {
      if (!item.empty()) out.push_back(item);
      item.clear();
    }
  }
  if (!item.empty()) out.push_back(item);
  return out;
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

int detect_xpu_count() {
  // Level Zero's loader, as detect_gpu_count loads CUDA's driver: zeInit, then the devices of
  // every driver.
  void* lib = ::dlopen("libze_loader.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return 0;
  using InitFn = int (*)(unsigned);
  using DriverGetFn = int (*)(std::uint32_t*, void**);
  using DeviceGetFn = int (*)(void*, std::uint32_t*, void**);
  auto init = reinterpret_cast<InitFn>(::dlsym(lib, "zeInit"));
  auto drivers_of = reinterpret_cast<DriverGetFn>(::dlsym(lib, "zeDriverGet"));
  auto devices_of = reinterpret_cast<DeviceGetFn>(::dlsym(lib, "zeDeviceGet"));
  constexpr unsigned kGpuOnly = 1;  // ZE_INIT_FLAG_GPU_ONLY
  std::uint32_t ndrivers = 0;
  if (init == nullptr || drivers_of == nullptr || devices_of == nullptr || init(kGpuOnly) != 0 ||
      drivers_of(&ndrivers, nullptr) != 0) {
    return 0;
  }
  ndrivers = std::min<std::uint32_t>(ndrivers, 64);
  std::vector<void*> drivers(ndrivers);
  if (ndrivers == 0 || drivers_of(&ndrivers, drivers.data()) != 0) return 0;
  int n = 0;
  for (std::uint32_t i = 0; i < ndrivers && i < drivers.size(); ++i) {
    std::uint32_t devices = 0;
    if (devices_of(drivers[i], &devices, nullptr) == 0) n += static_cast<int>(devices);
  }
  return n;
}

}  // namespace muster::launcher
