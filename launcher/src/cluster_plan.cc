#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "muster/launcher/cluster.h"
#include "muster/rendezvous/limits.h"

namespace muster::launcher {
namespace {

namespace limits = muster::rendezvous::limits;

constexpr std::string_view kForwardedNames[] = {"PATH", "LD_LIBRARY_PATH", "PYTHONPATH",
                                                "VIRTUAL_ENV", "LOGLEVEL"};
// What a training job is configured with: NCCL's, torch's (and torchrun's PET_ defaults),
// launch's own, the threading and device libraries'.
constexpr std::string_view kForwardedPrefixes[] = {
    "NCCL_", "TORCH", "PET_", "MUSTER_", "PYTHON", "OMP_", "CUDA_", "GLOO_", "UCX_", "FI_", "HF_"};

bool forwarded(const std::string& name) {
  if (name == kStdinWatchVar || name == "MUSTER_RDZV_TOKEN") return false;  // set by the driver
  if (std::find(std::begin(kForwardedNames), std::end(kForwardedNames), name) !=
      std::end(kForwardedNames)) {
    return true;
  }
  return std::any_of(std::begin(kForwardedPrefixes), std::end(kForwardedPrefixes),
                     [&](std::string_view p) { return name.compare(0, p.size(), p) == 0; });
}

}  // namespace

std::string shell_quote(std::string_view word) {
  const bool plain = !word.empty() && std::all_of(word.begin(), word.end(), [](char ch) {
    return absl::ascii_isalnum(static_cast<unsigned char>(ch)) ||
           std::string_view("@%+=:,./_-").find(ch) != std::string_view::npos;
  });
  if (plain) return std::string(word);
  std::string out = "'";
  for (char ch : word) {
    if (ch == '\'') {
      out += "'\\''";
    } else {
      out += ch;
    }
  }
  out += '\'';
  return out;
}

std::vector<std::pair<std::string, std::string>> forwarded_env(
    const std::map<std::string, std::string>& env, const std::vector<std::string>& extra,
    const std::string& token) {
  std::map<std::string, std::string> out;
  for (const auto& [k, v] : env) {
    if (forwarded(k)) out[k] = v;
  }
  for (const std::string& item : extra) {
    const auto eq = item.find('=');
    if (eq != std::string::npos) {
      out[item.substr(0, eq)] = item.substr(eq + 1);
    } else if (auto it = env.find(item); it != env.end()) {
      out[item] = it->second;
    }
  }
  out[kStdinWatchVar] = std::string(1, '1');
  out["MUSTER_SCHEDULER_ENV"] = std::string(1, '0');  // the job's shape is the driver's
  if (!token.empty()) out["MUSTER_RDZV_TOKEN"] = token;
  return {out.begin(), out.end()};
}

std::vector<HostCommand> plan_hosts(const LaunchConfig& cfg, const ClusterPlanInput& in) {
  const auto env = forwarded_env(in.env, cfg.cluster.env, in.token);
  const std::string nnodes = cfg.min_nodes == cfg.max_nodes
                                 ? absl::StrCat(cfg.max_nodes)
                                 : absl::StrCat(cfg.min_nodes, ":", cfg.max_nodes);
  // The user's --rdzv_conf (without the quotes it may come in), and the driver's key.
  std::string conf(absl::StripAsciiWhitespace(cfg.rdzv_conf_text));
  if (conf.size() >= 2 && (conf.front() == '\'' || conf.front() == '"') && conf.back() == conf.front()) {
    conf = conf.substr(1, conf.size() - 2);
  }
  if (in.hosted) conf = conf.empty() ? "is_host=false" : conf + ",is_host=false";
  std::vector<HostCommand> plan;
  for (const HostSlots& h : cfg.cluster.hosts) {
    std::vector<std::string> agent{
        in.launch_path,
        "--nnodes=" + nnodes,
        "--nproc_per_node=" + (h.slots > 0 ? absl::StrCat(h.slots) : cfg.nproc_spec),
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=" + in.endpoint,
        "--rdzv_id=" + in.run_id};
    if (!conf.empty()) agent.push_back("--rdzv_conf=" + conf);
    agent.insert(agent.end(), cfg.cluster.agent_args.begin(), cfg.cluster.agent_args.end());
    agent.push_back("--");
    agent.push_back(cfg.program);
    agent.insert(agent.end(), cfg.program_args.begin(), cfg.program_args.end());

    HostCommand c;
    c.host = h.host;
    const auto at = h.host.find('@');
    c.local = in.is_local && in.is_local(at == std::string::npos ? h.host : h.host.substr(at + 1));
    if (c.local) {
      c.argv = std::move(agent);
      c.env = env;
    } else {
      // ssh joins its arguments into one command for the remote login shell.
      std::string remote = absl::StrCat("cd ", shell_quote(in.cwd), " 2>/dev/null; exec env");
      for (const auto& [k, v] : env) absl::StrAppend(&remote, " ", shell_quote(k + "=" + v));
      for (const std::string& a : agent) absl::StrAppend(&remote, " ", shell_quote(a));
      c.argv.push_back("ssh");
      // The user's options first: for -o settings ssh keeps the first value it reads.
      c.argv.insert(c.argv.end(), cfg.cluster.ssh_args.begin(), cfg.cluster.ssh_args.end());
      const auto seconds = [](std::chrono::milliseconds d) {
        return absl::StrCat(std::chrono::duration_cast<std::chrono::seconds>(d).count());
      };
      for (std::string opt : {
               std::string("BatchMode=yes"),
               "ConnectTimeout=" + seconds(limits::kSshConnectTimeout),
               "ServerAliveInterval=" + seconds(limits::kSshServerAliveInterval),
               "ServerAliveCountMax=" + absl::StrCat(limits::kSshServerAliveCount)}) {
        c.argv.push_back("-o");
        c.argv.push_back(std::move(opt));
      }
      c.argv.push_back("-T");  // no terminal: the agent's stdout and stderr stay apart
      c.argv.push_back("--");
      c.argv.push_back(h.host);
      c.argv.push_back(std::move(remote));
    }
    plan.push_back(std::move(c));
  }
  return plan;
}

}  // namespace muster::launcher
