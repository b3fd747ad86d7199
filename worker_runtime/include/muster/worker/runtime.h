// What a training program links to join the job `launch` started:
//
//   auto rt = muster::worker::Runtime::from_env();      // ranks, store, restart count
//   if (!rt.ok()) { fprintf(stderr, "%s\n", rt.status().ToString().c_str()); return 1; }
//   auto comm = (*rt)->communicator(Backend::kAuto);    // NCCL if a GPU is visible, else TCP
//   (*comm)->all_reduce(grads, n, DType::kF32, ReduceOp::kAvg);
//   (*rt)->progress(step, "optimizer");                 // for the agent's hang detection
//
// Thread safety: a Runtime may be shared; its store may be called from several threads.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "muster/rendezvous/store.h"
#include "muster/rendezvous/tls.h"
#include "muster/worker/comm/communicator.h"
#include "muster/worker/control.h"
#include "muster/worker/progress.h"

namespace muster::worker {

// The worker environment (DESIGN.md "Worker environment"), parsed and checked.
struct WorkerInfo {
  int rank = 0;
  int local_rank = 0;
  int world_size = 1;
  int local_world_size = 1;
  int group_rank = 0;
  int group_world_size = 1;
  int role_rank = 0;
  int role_world_size = 1;
  std::string role_name;
  std::string master_addr;
  int master_port = 0;
  int restart_count = 0;
  int max_restarts = 0;
  std::string run_id;         // TORCHELASTIC_RUN_ID
  std::string error_file;     // TORCHELASTIC_ERROR_FILE (may be empty)
  std::string store_addr;     // MUSTER_STORE_ADDR
  std::string store_run_id;   // MUSTER_RUN_ID
  int round = 0;              // MUSTER_ROUND
  std::string token;          // MUSTER_RDZV_TOKEN (may be empty)
  std::string node_addr;      // MUSTER_NODE_ADDR: how other nodes reach this one
  // MUSTER_TLS_CA, MUSTER_TLS_CERT, MUSTER_TLS_KEY, MUSTER_TLS_SERVER_NAME: the store is
  // reached over TLS when the CA is set (the agent passes on its own settings).
  rendezvous::ClientTlsFiles tls;
  int control_fd = -1;        // MUSTER_CONTROL_FD (control.h); -1: none (no --in_place)
  // After an in-place re-form (Runtime::await_world): the global ranks of the round before
  // whose nodes left it (empty: none, or not known).
  std::vector<int> lost;
};

// Parses `env`; a missing or malformed variable gives INVALID_ARGUMENT naming it.
absl::StatusOr<WorkerInfo> parse_worker_env(const std::map<std::string, std::string>& env);

class Runtime {
 public:
  // From this process's environment.
  static absl::StatusOr<std::unique_ptr<Runtime>> from_env();
  static absl::StatusOr<std::unique_ptr<Runtime>> from_env(
      const std::map<std::string, std::string>& env);
  ~Runtime();

  const WorkerInfo& info() const { return info_; }

  // The run's store, namespaced to this round ("r<round>/"): keys from an earlier attempt
  // never leak into this one.
  rendezvous::Store& store() { return *round_store_; }

  // A communicator over all WORLD_SIZE ranks. kAuto: NCCL on device LOCAL_RANK when this
  // build has NCCL and a GPU is visible, else TCP. Collective: every rank calls it.
  absl::StatusOr<std::unique_ptr<Communicator>> communicator(Backend backend = Backend::kAuto);

  // Tells the agent this rank is alive at `step`, doing `phase` (progress.h; docs/hangs.md):
  // a few stores into the page named by MUSTER_PROGRESS_FILE, a no-op without one (torchrun).
  // One thread at a time.
  void progress(std::int64_t step, std::string_view phase = "") { progress_.report(step, phase); }
  // The same page, for code that is handed a reporter rather than the Runtime.
  ProgressReporter& progress_reporter() { return progress_; }

  // In-place recovery (control.h has the contract; docs/in_place.md). enable_in_place()
  // declares that this program re-forms in place; FAILED_PRECONDITION when the agent gave no
  // control channel (not launch --in_place, or torchrun): then nothing changes.
  absl::Status enable_in_place();
  bool in_place() const { return in_place_; }
  // After a collective failed: waits for the next world (at most `timeout`), then info(),
  // store() and communicator() are the new round's. The communicators made before stay
  // aborted; destroy them.
  absl::StatusOr<WorkerInfo> await_world(std::chrono::milliseconds timeout);
  // Once per round, after its first completed step (a no-op without enable_in_place()).
  absl::Status resumed();

 private:
  Runtime(WorkerInfo info, ProgressReporter progress, rendezvous::ClientTls tls);
  WorkerInfo info_;
  ProgressReporter progress_;
  std::unique_ptr<rendezvous::Store> run_store_;
  std::unique_ptr<rendezvous::Store> round_store_;
  int communicators_made_ = 0;
  // The control channel's epoch with the world this process is in (0: the one it started in).
  std::uint64_t world_epoch_ = 0;
  std::unique_ptr<ControlChannel> control_;
  bool in_place_ = false;
  int resumed_round_ = 0;
};

}  // namespace muster::worker
