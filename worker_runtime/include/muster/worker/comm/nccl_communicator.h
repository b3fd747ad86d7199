// The NCCL backend. Rank 0 creates the unique id and publishes it through the store under
// "nccl/id"; the others wait for it; ncclCommInitRankConfig runs non-blocking on device
// `device` and is bounded by `timeout` (ncclCommAbort when it passes). Collectives run on the
// caller's CUDA stream; abort() calls ncclCommAbort so a restarting group never hangs.
#pragma once

#include <chrono>
#include <memory>

#include "absl/status/statusor.h"
#include "muster/rendezvous/store.h"
#include "muster/worker/comm/communicator.h"

namespace muster::worker {

// Whether this build has the NCCL backend, and how many CUDA devices are visible (0 when the
// build has none or there is no driver or GPU).
bool nccl_available();
int cuda_device_count();

absl::StatusOr<std::unique_ptr<Communicator>> make_nccl_communicator(
    rendezvous::Store& store, int rank, int size, int device,
    std::chrono::milliseconds timeout = std::chrono::seconds(300));

}  // namespace muster::worker
