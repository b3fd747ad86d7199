#include "muster/worker/comm/communicator.h"

namespace muster::worker {

std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32: case DType::kI32: return 4;
    case DType::kF64: case DType::kI64: return 8;
    case DType::kF16: case DType::kBF16: return 2;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kF64: return "f64";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
  }
  return "?";
}

}  // namespace muster::worker
