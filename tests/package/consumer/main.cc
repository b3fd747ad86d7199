// Every rank sums its rank+1 over the TCP ring and writes a key to the run's store; rank 0
// checks what the others wrote. Prints one line per rank; exits 1 on any error.
#include <cstdio>
#include <string>

#include "muster/worker/runtime.h"

using muster::worker::Backend;
using muster::worker::DType;
using muster::worker::ReduceOp;

int main() {
  auto rt = muster::worker::Runtime::from_env();
  if (!rt.ok()) {
    std::fprintf(stderr, "consumer: %s\n", std::string(rt.status().message()).c_str());
    return 1;
  }
  const auto& info = (*rt)->info();
  auto comm = (*rt)->communicator(Backend::kTcp);
  if (!comm.ok()) {
    std::fprintf(stderr, "consumer: %s\n", std::string(comm.status().message()).c_str());
    return 1;
  }
  double v = info.rank + 1;
  if (auto s = (*comm)->all_reduce(&v, 1, DType::kF64, ReduceOp::kSum); !s.ok()) {
    std::fprintf(stderr, "consumer: all_reduce: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  auto& store = (*rt)->store();
  const std::string key = "from/" + std::to_string(info.rank);
  if (auto s = store.set(key, std::to_string(info.rank * 10)); !s.ok()) return 1;
  int others = 0;
  if (info.rank == 0) {
    for (int r = 1; r < info.world_size; ++r) {
      auto got = store.get("from/" + std::to_string(r), std::chrono::seconds(30));
      if (got.ok() && *got == std::to_string(r * 10)) ++others;
    }
  }
  std::printf("consumer rank %d/%d sum=%g others=%d\n", info.rank, info.world_size, v, others);
  return 0;
}
