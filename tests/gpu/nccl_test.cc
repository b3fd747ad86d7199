// The NCCL backend at world size 1 on a real GPU. Exits 77 (ctest: Skipped) when this build
// has no NCCL or no GPU is visible, so a machine without one never reports it as passed.
#include <cstdio>
#include <vector>

#include "muster/rendezvous/memory_store.h"
#include "muster/worker/comm/nccl_communicator.h"

#ifdef MUSTER_HAVE_NCCL
#include <cuda_runtime.h>
#endif

int main() {
  using namespace muster::worker;
  if (!nccl_available() || cuda_device_count() == 0) {
    std::printf("SKIPPED: %s\n", nccl_available() ? "no CUDA device visible" : "built without NCCL");
    return 77;
  }
#ifdef MUSTER_HAVE_NCCL
  muster::rendezvous::MemoryStore store;
  auto comm = make_nccl_communicator(store, 0, 1, 0);
  if (!comm.ok()) {
    std::printf("FAILED: %s\n", std::string(comm.status().message()).c_str());
    return 1;
  }
  const std::size_t n = 1 << 20;
  std::vector<float> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i % 7);
  float* dev = nullptr;
  cudaMalloc(&dev, n * sizeof(float));
  cudaMemcpy(dev, host.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  int bad = 0;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
    auto s = (*comm)->all_reduce(dev, n, DType::kF32, op, stream);
    if (!s.ok()) {
      std::printf("FAILED: all_reduce: %s\n", std::string(s.message()).c_str());
      return 1;
    }
  }
  auto b = (*comm)->broadcast(dev, n, DType::kF32, 0, stream);
  auto bar = (*comm)->barrier();
  std::vector<float> back(n);
  cudaMemcpy(back.data(), dev, n * sizeof(float), cudaMemcpyDeviceToHost);
  for (std::size_t i = 0; i < n; ++i) bad += back[i] != host[i];  // world size 1: unchanged
  std::printf("%s: nccl world size 1, %d mismatches, broadcast %s, barrier %s\n",
              bad == 0 && b.ok() && bar.ok() ? "PASSED" : "FAILED", bad,
              b.ok() ? "ok" : "failed", bar.ok() ? "ok" : "failed");
  cudaFree(dev);
  return bad == 0 && b.ok() && bar.ok() ? 0 : 1;
#endif
}
