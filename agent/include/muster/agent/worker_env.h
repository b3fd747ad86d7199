// The worker environment: the contract with user programs (DESIGN.md "Worker environment").
// Values are exactly what torchrun computes.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "muster/rendezvous/tls.h"

namespace muster::agent {

// Everything that varies between workers and rounds.
struct WorkerEnvSpec {
  int local_rank = 0;
  int local_world_size = 1;
  int rank_offset = 0;  // global rank of local rank 0 on this node
  int world_size = 1;
  int group_rank = 0;
  int group_world_size = 1;
  std::string role = "default";
  std::string master_addr;
  int master_port = 0;
  bool use_agent_store = false;  // TORCHELASTIC_USE_AGENT_STORE: MASTER_PORT is the run's store
  int restart_count = 0;
  int max_restarts = 0;
  std::string run_id;
  std::string error_file;
  std::string store_addr;  // the store's gRPC target (see store_target_for_workers)
  int round = 0;
  std::string node_addr;  // how other nodes reach this one (MUSTER_NODE_ADDR)
  std::string token;      // the run's credential, when it has one (MUSTER_RDZV_TOKEN)
  // The agent's own TLS files for the server (MUSTER_TLS_*; none: plaintext), so that the
  // worker's store client verifies the server as the agent does.
  rendezvous::ClientTlsFiles tls;
  // --signals_to_handle as given (TORCHELASTIC_SIGNALS_TO_HANDLE, torchrun 2.x: the signals
  // torch's own process contexts in a worker then handle).
  std::string signals_to_handle = "SIGTERM,SIGINT,SIGHUP,SIGQUIT";
  // --virtual_local_rank (torchrun 2.x): LOCAL_RANK is 0 and CUDA_VISIBLE_DEVICES holds only
  // this worker's device (see virtual_visible_device).
  bool virtual_local_rank = false;
};

// The one device a worker sees under --virtual_local_rank, as torchrun picks it: entry
// `local_rank` of launch's CUDA_VISIBLE_DEVICES (trimmed) when launch has that variable,
// else the local rank itself. An error when the list has no entry at that position.
// `parent` is nullptr when launch's environment lacks the variable.
absl::StatusOr<std::string> virtual_visible_device(const std::string* parent, int local_rank);

// Where workers reach the store: the server's Unix-domain target when the server runs with this
// agent's host identity (same boot, same network namespace), else `tcp_target`.
std::string store_target_for_workers(const std::string& local_target,
                                     const std::string& server_identity,
                                     const std::string& my_identity, const std::string& tcp_target);

// The launcher's own environment as a map (from `environ`).
std::map<std::string, std::string> current_environment();

// Returns the worker's environment: `base` with the contract's variables set (they replace
// any inherited value), plus the variables torchrun only sets when they are unset
// (OMP_NUM_THREADS=1 when local_world_size > 1, TORCH_NCCL_ASYNC_ERROR_HANDLING=1; not
// torch 1.x's NCCL_ASYNC_ERROR_HANDLING, which torchrun 2.x no longer sets). With spec.virtual_local_rank, LOCAL_RANK is 0
// and CUDA_VISIBLE_DEVICES is virtual_visible_device(base's, local_rank); the caller has
// checked that it exists (an impossible entry leaves the worker no device: "").
std::map<std::string, std::string> build_worker_env(const std::map<std::string, std::string>& base,
                                                    const WorkerEnvSpec& spec);

// "KEY=VALUE" strings, for execve.
std::vector<std::string> to_envp(const std::map<std::string, std::string>& env);

// torchrun's macro in the program's arguments (torch's `macros.substitute`, a Python
// string.Template safe_substitute): `${local_rank}` and `$local_rank` become the worker's
// local rank, `$$` becomes `$`, anything else (other names, a lone `$`) is left as it is.
std::string substitute_local_rank(const std::string& arg, int local_rank);

}  // namespace muster::agent
