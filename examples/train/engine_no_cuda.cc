// The CUDA engine's entry points in a build without the CUDA toolkit.
#include "engine.h"

namespace muster::train {

bool cuda_available() { return false; }

absl::StatusOr<std::unique_ptr<Engine>> make_cuda_engine(const Shape&, Precision, std::uint64_t, int,
                                                         int) {
  return absl::UnavailableError("this build has no CUDA engine (the CUDA toolkit was not found)");
}

}  // namespace muster::train
