#include "muster/agent/worker_env.h"

#include <cctype>

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "muster/ops/worker_env_names.h"

extern char** environ;

namespace muster::agent {

std::map<std::string, std::string> current_environment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq == std::string::npos) continue;
    env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return env;
}

std::map<std::string, std::string> build_worker_env(const std::map<std::string, std::string>& base,
                                                    const WorkerEnvSpec& s) {
  std::map<std::string, std::string> env = base;
  const int rank = s.rank_offset + s.local_rank;
  auto set = [&env](const char* k, const std::string& v) { env[k] = v; };
  auto set_if_unset = [&env](const char* k, const std::string& v) { env.emplace(k, v); };
  set(env::kRank, std::to_string(rank));
  set(env::kLocalRank, std::to_string(s.virtual_local_rank ? 0 : s.local_rank));
  if (s.virtual_local_rank) {
    auto it = base.find("CUDA_VISIBLE_DEVICES");
    auto device = virtual_visible_device(it == base.end() ? nullptr : &it->second, s.local_rank);
    set("CUDA_VISIBLE_DEVICES", device.ok() ? *device : std::string());
  }
  set(env::kWorldSize, std::to_string(s.world_size));
  set(env::kLocalWorldSize, std::to_string(s.local_world_size));
  set(env::kGroupRank, std::to_string(s.group_rank));
  set(env::kGroupWorldSize, std::to_string(s.group_world_size));
  // One role per job: role ranks are the global ranks.
  set(env::kRoleRank, std::to_string(rank));
  set(env::kRoleName, s.role);
  set(env::kRoleWorldSize, std::to_string(s.world_size));
  set(env::kMasterAddr, s.master_addr);
  set(env::kMasterPort, std::to_string(s.master_port));
  set(env::kRestartCount, std::to_string(s.restart_count));
  set(env::kMaxRestarts, std::to_string(s.max_restarts));
  set(env::kRunId, s.run_id);
  // True: MASTER_ADDR:MASTER_PORT is the run's store, in c10d's TCPStore protocol, on the
  // rendezvous server (every rank is a client, torch prefixes its keys with the attempt).
  // False: rank 0 hosts a TCPStore of its own there.
  set(env::kUseAgentStore, s.use_agent_store ? "True" : "False");
  set(env::kErrorFile, s.error_file);
  set(env::kSignalsToHandle, s.signals_to_handle);
  set_if_unset("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1");
  if (s.local_world_size > 1) set_if_unset("OMP_NUM_THREADS", "1");
  set(env::kStoreAddr, s.store_addr);
  set(env::kStoreRunId, s.run_id);
  set(env::kRound, std::to_string(s.round));
  set(env::kNodeAddr, s.node_addr);
  if (!s.token.empty()) set(env::kRdzvToken, s.token);
  // Exactly the agent's TLS settings, none inherited beside them.
  for (const char* k : {rendezvous::kTlsCaVar, rendezvous::kTlsCertVar, rendezvous::kTlsKeyVar,
                        rendezvous::kTlsServerNameVar}) {
    env.erase(k);
  }
  for (auto& [k, v] : rendezvous::client_tls_env(s.tls)) env[k] = v;
  return env;
}

absl::StatusOr<std::string> virtual_visible_device(const std::string* parent, int local_rank) {
  if (parent == nullptr) return std::to_string(local_rank);
  std::vector<std::string> devices = absl::StrSplit(*parent, ',');
  if (local_rank < 0 || local_rank >= static_cast<int>(devices.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("--virtual_local_rank: local rank ", local_rank,
                     " has no device in CUDA_VISIBLE_DEVICES=", *parent));
  }
  return std::string(absl::StripAsciiWhitespace(devices[local_rank]));
}

std::vector<std::string> to_envp(const std::map<std::string, std::string>& env) {
  std::vector<std::string> out;
  out.reserve(env.size());
  for (const auto& [k, v] : env) out.push_back(k + "=" + v);
  return out;
}

std::string store_target_for_workers(const std::string& local_target,
                                     const std::string& server_identity,
                                     const std::string& my_identity, const std::string& tcp_target) {
  const bool local = !local_target.empty() && !my_identity.empty() && server_identity == my_identity;
  return local ? local_target : tcp_target;
}

std::string substitute_local_rank(const std::string& arg, int local_rank) {
  if (arg.find('$') == std::string::npos) return arg;
  const std::string value = std::to_string(local_rank);
  auto ident_char = [](char c, bool first) {
    return c == '_' || std::isalpha(static_cast<unsigned char>(c)) ||
           (!first && std::isdigit(static_cast<unsigned char>(c)));
  };
  std::string out;
  for (std::size_t i = 0; i < arg.size(); ++i) {
    if (arg[i] != '$' || i + 1 == arg.size()) {
      out += arg[i];
      continue;
    }
    if (arg[i + 1] == '$') {
      out += '$';
      ++i;
      continue;
    }
    if (arg[i + 1] == '{') {
      const std::size_t close = arg.find('}', i + 2);
      if (close != std::string::npos && arg.compare(i + 2, close - i - 2, "local_rank") == 0) {
        out += value;
        i = close;
        continue;
      }
      out += '$';
      continue;
    }
    std::size_t end = i + 1;
    while (end < arg.size() && ident_char(arg[end], end == i + 1)) ++end;
    if (arg.compare(i + 1, end - i - 1, "local_rank") == 0) {
      out += value;
      i = end - 1;
      continue;
    }
    out += '$';
  }
  return out;
}

}  // namespace muster::agent
