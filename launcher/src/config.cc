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
#include "config_internal.h"
#include "tls_config.h"

namespace muster::launcher {

namespace limits = muster::rendezvous::limits;
namespace internal {

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

}  // namespace internal

using namespace internal;

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

namespace {

// An rdzv_conf value that is true or false (1/0, yes/no too, any case).
absl::StatusOr<bool> parse_bool(absl::string_view key, absl::string_view value) {
  const std::string v = absl::AsciiStrToLower(value);
  if (v == "1" || v == "true" || v == "yes") return true;
  if (v == "0" || v == "false" || v == "no") return false;
  return absl::InvalidArgumentError(
      absl::StrCat("--rdzv_conf ", key, ": expected true or false, got '", value, "'"));
}

// Where an rdzv_conf key that is true or false goes (null: not such a key). is_host, which may
// also be left unset, is not one of them.
bool* bool_key(RdzvConf& c, absl::string_view key) {
  if (key == "use_agent_store") return &c.use_agent_store;
  if (key == "store_cache") return &c.store_cache;
  if (key == "in_place") return &c.in_place;
  return nullptr;
}

absl::Status parse_keep_alive_attempts(absl::string_view value, int& into) {
  std::int64_t n = 0;
  if (!absl::SimpleAtoi(value, &n) || n < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--rdzv_conf keep_alive_max_attempt: expected a positive integer, got '", value, "'"));
  }
  if (n > limits::kMaxKeepAliveAttempts) {
    return absl::InvalidArgumentError(absl::StrCat("--rdzv_conf keep_alive_max_attempt: ", n,
                                                   " is above the limit of ",
                                                   limits::kMaxKeepAliveAttempts));
  }
  into = static_cast<int>(n);
  return absl::OkStatus();
}

}  // namespace

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
    // `positive`: 0 is refused too.
    auto seconds = [&](std::chrono::milliseconds& into, std::chrono::milliseconds max,
                       bool positive = false) -> absl::Status {
      auto v = parse_seconds(key, value, max);
      if (!v.ok()) return v.status();
      if (positive && v->count() == 0) {
        return absl::InvalidArgumentError(absl::StrCat("--rdzv_conf ", key, ": must be above 0"));
      }
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
      st = seconds(c.timeouts.reattach_timeout, limits::kMaxReattachTimeout, true);
    } else if (key == "keep_alive_interval") {
      st = seconds(c.timeouts.keep_alive_interval, limits::kMaxKeepAliveInterval, true);
    } else if (key == "keep_alive_max_attempt") {
      st = parse_keep_alive_attempts(value, c.timeouts.keep_alive_max_attempt);
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
    } else if (key == "in_place_timeout") {
      st = seconds(c.in_place_timeout, limits::kMaxInPlaceTimeout, true);
    } else if (key == "is_host") {
      auto b = parse_bool(key, value);
      st = b.status();
      if (b.ok()) c.is_host = *b;
    } else if (bool* into = bool_key(c, key)) {
      auto b = parse_bool(key, value);
      st = b.status();
      if (b.ok()) *into = *b;
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

bool is_local_host(const std::vector<std::string>& addresses) {
  return muster::rendezvous::is_local_address(addresses);
}

namespace internal {

// --rdzv_conf, and its token's fallback, $MUSTER_RDZV_TOKEN: for every kind of launch.
absl::Status resolve_rdzv_conf(LaunchConfig& c, const std::map<std::string, std::string>& env) {
  auto conf = parse_rdzv_conf(c.rdzv_conf_text);
  if (!conf.ok()) return conf.status();
  c.rdzv_conf = *conf;
  if (c.rdzv_conf.token.empty()) {
    if (auto t = env.find("MUSTER_RDZV_TOKEN"); t != env.end()) c.rdzv_conf.token = t->second;
  }
  if (c.spares > 0 && !c.in_place && !c.rdzv_conf.in_place) {
    return absl::InvalidArgumentError("--spares needs --in_place (a spare takes a dead rank's "
                                      "place in an in-place re-form)");
  }
  if (c.exclude_stragglers && !c.in_place && !c.rdzv_conf.in_place) {
    return absl::InvalidArgumentError("--exclude_stragglers needs --in_place (the others keep "
                                      "their workers when a straggler's node leaves)");
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

}  // namespace internal

using namespace internal;

ParseResult parse_launch_args(const std::vector<std::string>& args, const HostInfo& host) {
  return parse_launch_args(args, host, muster::agent::current_environment());
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
