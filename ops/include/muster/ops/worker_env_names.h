// The worker environment's names (DESIGN.md "Worker environment"): one table, used by the agent
// that writes them (agent/worker_env.cc) and the worker runtime that reads them
// (worker_runtime/runtime.cc). The values are torchrun's where torchrun has the variable.
#pragma once

namespace muster::env {

// torchrun's
inline constexpr char kRank[] = "RANK";
inline constexpr char kLocalRank[] = "LOCAL_RANK";
inline constexpr char kWorldSize[] = "WORLD_SIZE";
inline constexpr char kLocalWorldSize[] = "LOCAL_WORLD_SIZE";
inline constexpr char kGroupRank[] = "GROUP_RANK";
inline constexpr char kGroupWorldSize[] = "GROUP_WORLD_SIZE";
inline constexpr char kRoleRank[] = "ROLE_RANK";
inline constexpr char kRoleName[] = "ROLE_NAME";
inline constexpr char kRoleWorldSize[] = "ROLE_WORLD_SIZE";
inline constexpr char kMasterAddr[] = "MASTER_ADDR";
inline constexpr char kMasterPort[] = "MASTER_PORT";
inline constexpr char kRestartCount[] = "TORCHELASTIC_RESTART_COUNT";
inline constexpr char kMaxRestarts[] = "TORCHELASTIC_MAX_RESTARTS";
inline constexpr char kRunId[] = "TORCHELASTIC_RUN_ID";
inline constexpr char kUseAgentStore[] = "TORCHELASTIC_USE_AGENT_STORE";
inline constexpr char kErrorFile[] = "TORCHELASTIC_ERROR_FILE";
inline constexpr char kSignalsToHandle[] = "TORCHELASTIC_SIGNALS_TO_HANDLE";

// muster's own
inline constexpr char kStoreAddr[] = "MUSTER_STORE_ADDR";
inline constexpr char kStoreRunId[] = "MUSTER_RUN_ID";
inline constexpr char kRound[] = "MUSTER_ROUND";
inline constexpr char kNodeAddr[] = "MUSTER_NODE_ADDR";
inline constexpr char kRdzvToken[] = "MUSTER_RDZV_TOKEN";
// In-place recovery (docs/in_place.md): the worker's end of its control channel
// (ops/control_channel.h), set only when the agent runs with --in_place.
inline constexpr char kControlFd[] = "MUSTER_CONTROL_FD";
// "1" in a warm spare (launch --spares): it waits in muster_inplace.await_rank() for the
// agent's `take`, which gives it a rank's variables (ops/control_channel.h).
inline constexpr char kSpare[] = "MUSTER_SPARE";

}  // namespace muster::env
