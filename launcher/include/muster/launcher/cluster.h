// launch --hosts / --hostfile: what each host's agent is started with (docs/cluster.md).
//
// The driver (this launch) starts one agent per host: over ssh (OpenSSH's client, BatchMode,
// the user's own keys and config, --ssh_args first so that they win), or directly when the
// host is this machine. Every agent is the same launch binary with this command's flags, the
// c10d rendezvous at `endpoint` (the driver's own server unless --rdzv_endpoint names one),
// and its host's worker count. Agents watch their stdin (MUSTER_STDIN_WATCH=1): the driver
// keeps it open while it runs, so the end of the ssh session, however it ends, stops that
// host's agent and workers.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "muster/launcher/config.h"

namespace muster::launcher {

// The variable an agent started by the driver finds set to "1": it stops when its stdin ends.
inline constexpr char kStdinWatchVar[] = "MUSTER_STDIN_WATCH";

struct HostCommand {
  std::string host;               // as listed (a user@ kept)
  bool local = false;             // this machine: started directly, not over ssh
  std::vector<std::string> argv;  // argv[0]: "ssh" (looked up on PATH) or launch's path
  // A local agent's environment on top of the driver's own; a remote one gets the same
  // variables through `env` in its command line.
  std::vector<std::pair<std::string, std::string>> env;
};

struct ClusterPlanInput {
  std::string endpoint;     // the rendezvous as every agent reaches it, HOST:PORT
  bool hosted = false;      // by the driver: no agent hosts it (--rdzv_conf is_host=false)
  std::string run_id;
  std::string token;        // the agents' MUSTER_RDZV_TOKEN ("": none)
  std::string launch_path;  // launch's path on the hosts
  std::string cwd;          // the remote agents start here (the same path is assumed there)
  std::map<std::string, std::string> env;           // the driver's environment
  std::function<bool(const std::string&)> is_local;  // a host name that is this machine
};

// A word for a POSIX shell: 'text' with every ' written as '\''; plain words stay as they are.
std::string shell_quote(std::string_view word);

// The variables the hosts' agents get from the driver's environment: PATH, LD_LIBRARY_PATH,
// PYTHONPATH, VIRTUAL_ENV, LOGLEVEL and every variable starting with one of kForwardedPrefixes,
// then --env's items (NAME: its value here, skipped when unset; NAME=VALUE as given), then
// MUSTER_STDIN_WATCH=1, MUSTER_SCHEDULER_ENV=0 (scheduler_env.h) and the token. Sorted by
// name, one entry per name, the last given wins.
std::vector<std::pair<std::string, std::string>> forwarded_env(
    const std::map<std::string, std::string>& env, const std::vector<std::string>& extra,
    const std::string& token);

// One command per host, in the hosts' order. Each agent gets --rdzv_conf as given, with
// is_host=false added when the driver hosts the rendezvous.
std::vector<HostCommand> plan_hosts(const LaunchConfig& cfg, const ClusterPlanInput& in);

}  // namespace muster::launcher
