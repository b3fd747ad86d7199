#include "muster/worker/comm/nccl_communicator.h"

#include "absl/strings/str_cat.h"

#ifdef MUSTER_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <cstring>
#include <thread>
#endif

namespace muster::worker {

#ifndef MUSTER_HAVE_NCCL

bool nccl_available() { return false; }
int cuda_device_count() { return 0; }

absl::StatusOr<std::unique_ptr<Communicator>> make_nccl_communicator(rendezvous::Store&, int, int,
                                                                     int,
                                                                     std::chrono::milliseconds) {
  return absl::UnimplementedError("this build of muster has no NCCL backend");
}

#else

namespace {

absl::Status from_cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

absl::Status from_nccl(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", ncclGetErrorString(r)));
}

ncclDataType_t to_nccl(DType t) {
  switch (t) {
    case DType::kF32: return ncclFloat32;
    case DType::kF64: return ncclFloat64;
    case DType::kF16: return ncclFloat16;
    case DType::kBF16: return ncclBfloat16;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
  }
  return ncclFloat32;
}

ncclRedOp_t to_nccl(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
  }
  return ncclSum;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(int rank, int size, int device, std::chrono::milliseconds timeout)
      : rank_(rank), size_(size), device_(device), timeout_(timeout) {}
  ~NcclCommunicator() override {
    if (comm_ != nullptr) {
      if (aborted_) return;  // ncclCommAbort already released it
      ncclCommDestroy(comm_);
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }

  absl::Status init(rendezvous::Store& store) {
    if (absl::Status s = from_cuda(cudaSetDevice(device_), "cudaSetDevice"); !s.ok()) return s;
    ncclUniqueId id;
    if (rank_ == 0) {
      if (absl::Status s = from_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId"); !s.ok()) return s;
      if (absl::Status s = store.set("nccl/id", std::string(id.internal, sizeof id.internal));
          !s.ok()) {
        return s;
      }
    } else {
      auto v = store.get("nccl/id", timeout_);
      if (!v.ok()) return v.status();
      if (v->size() != sizeof id.internal) return absl::DataLossError("nccl: bad unique id");
      std::memcpy(id.internal, v->data(), sizeof id.internal);
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&comm_, size_, id, rank_, &config);
    if (r != ncclSuccess && r != ncclInProgress) return from_nccl(r, "ncclCommInitRankConfig");
    return settle("ncclCommInitRankConfig");
  }

  absl::Status all_reduce(void* data, std::size_t count, DType t, ReduceOp op,
                          void* stream) override {
    return run(ncclAllReduce(data, data, count, to_nccl(t), to_nccl(op), comm_, s(stream)),
               stream, "ncclAllReduce");
  }
  absl::Status broadcast(void* data, std::size_t count, DType t, int root, void* stream) override {
    return run(ncclBroadcast(data, data, count, to_nccl(t), root, comm_, s(stream)), stream,
               "ncclBroadcast");
  }
  absl::Status all_gather(const void* send, void* recv, std::size_t count, DType t,
                          void* stream) override {
    return run(ncclAllGather(send, recv, count, to_nccl(t), comm_, s(stream)), stream,
               "ncclAllGather");
  }
  absl::Status reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType t,
                              ReduceOp op, void* stream) override {
    return run(ncclReduceScatter(send, recv, recv_count, to_nccl(t), to_nccl(op), comm_,
                                 s(stream)),
               stream, "ncclReduceScatter");
  }
  absl::Status barrier() override {
    void* one = nullptr;
    if (absl::Status st = from_cuda(cudaMalloc(&one, sizeof(float)), "cudaMalloc"); !st.ok()) {
      return st;
    }
    absl::Status st = all_reduce(one, 1, DType::kF32, ReduceOp::kSum, nullptr);
    cudaFree(one);
    return st;
  }
  void abort() override {
    if (comm_ != nullptr && !aborted_.exchange(true)) ncclCommAbort(comm_);
  }

 private:
  static cudaStream_t s(void* stream) { return static_cast<cudaStream_t>(stream); }

  // Waits for a non-blocking communicator to leave ncclInProgress, bounded by the timeout.
  absl::Status settle(const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    ncclResult_t state = ncclInProgress;
    while (true) {
      if (aborted_) return absl::CancelledError("nccl: aborted");
      if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) break;
      if (state != ncclInProgress) break;
      if (std::chrono::steady_clock::now() > deadline) {
        abort();
        return absl::DeadlineExceededError(absl::StrCat(what, " timed out"));
      }
      std::this_thread::yield();  // NCCL offers no event to wait on here
    }
    return from_nccl(state, what);
  }

  absl::Status run(ncclResult_t r, void* stream, const char* what) {
    if (aborted_) return absl::CancelledError("nccl: aborted");
    if (r != ncclSuccess && r != ncclInProgress) return from_nccl(r, what);
    if (absl::Status st = settle(what); !st.ok()) return st;
    return from_cuda(cudaStreamSynchronize(s(stream)), "cudaStreamSynchronize");
  }

  const int rank_, size_, device_;
  const std::chrono::milliseconds timeout_;
  ncclComm_t comm_ = nullptr;
  std::atomic<bool> aborted_{false};
};

}  // namespace

bool nccl_available() { return true; }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

absl::StatusOr<std::unique_ptr<Communicator>> make_nccl_communicator(
    rendezvous::Store& store, int rank, int size, int device, std::chrono::milliseconds timeout) {
  if (cuda_device_count() <= device) {
    return absl::FailedPreconditionError(
        absl::StrCat("nccl: no CUDA device ", device, " (", cuda_device_count(), " visible)"));
  }
  auto comm = std::make_unique<NcclCommunicator>(rank, size, device, timeout);
  if (absl::Status s = comm->init(store); !s.ok()) return s;
  return std::unique_ptr<Communicator>(std::move(comm));
}

#endif

}  // namespace muster::worker
