// A communicator: the collectives a data-parallel training program needs, over one group of
// ranks. Backends side by side: TCP ring (tcp_communicator.h, CPUs) and NCCL
// (nccl_communicator.h, GPUs).
//
// Every call is collective: all ranks call it with the same count, dtype, op and root, in the
// same order. Buffers are host memory for TCP and device memory for NCCL (with `stream` a
// cudaStream_t; TCP ignores it). Calls block until the operation is complete on this rank
// (NCCL: enqueued and finished on `stream`) or fail with a Status: a peer that dies makes every
// other rank's call fail within the communicator's timeout, never hang. After a failure the
// communicator is unusable; abort() it and build a new one in the next round.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace muster::worker {

enum class DType { kF32, kF64, kF16, kBF16, kI32, kI64 };
enum class ReduceOp { kSum, kAvg, kMin, kMax };
enum class Backend { kAuto, kNccl, kTcp };

std::size_t dtype_size(DType t);
const char* dtype_name(DType t);

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;

  // In place: data[i] = op over ranks of data[i]. kAvg divides the sum by size() (integer
  // division for integer types). f16/bf16 are accumulated in f32.
  virtual absl::Status all_reduce(void* data, std::size_t count, DType dtype, ReduceOp op,
                                  void* stream = nullptr) = 0;
  // data (count elements) on every rank becomes root's.
  virtual absl::Status broadcast(void* data, std::size_t count, DType dtype, int root,
                                 void* stream = nullptr) = 0;
  // recv (size() * count elements) holds every rank's send (count elements), in rank order.
  virtual absl::Status all_gather(const void* send, void* recv, std::size_t count, DType dtype,
                                  void* stream = nullptr) = 0;
  // send holds size() * recv_count elements; recv gets this rank's block of the reduction.
  virtual absl::Status reduce_scatter(const void* send, void* recv, std::size_t recv_count,
                                      DType dtype, ReduceOp op, void* stream = nullptr) = 0;
  virtual absl::Status barrier() = 0;
  // Ends every pending and future call with an error, from any thread (the agent is
  // restarting the group). Idempotent.
  virtual void abort() = 0;
};

}  // namespace muster::worker
