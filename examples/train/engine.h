// Where the arithmetic of a training step happens: plain C++ on the CPU (engine_cpu.cc, bf16
// and fp16 emulated by rounding to nearest even) or CUDA (engine_cuda.cu: cuBLAS GEMMs with
// 16-bit inputs and fp32 accumulation, small kernels for the rest). The trainer drives either
// through this interface and never touches the numbers itself.
//
// Mixed precision, identical on both: the master weights, the gradients and Adam's moments are
// fp32. A forward/backward pass rounds the weights and every activation and activation
// gradient to the compute precision (kF32: no rounding); GEMMs accumulate in fp32. The loss
// gradient is multiplied by the loss scale before it is rounded, as GradScaler does.
//
// Gradient buffer: num_params() fp32 gradients followed by one slot holding this rank's loss,
// in the engine's memory (host for the CPU, device for CUDA), so that one all_reduce averages
// both.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model.h"

namespace muster::train {

struct AdamConfig {
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // decoupled (AdamW)
};

class Engine {
 public:
  virtual ~Engine() = default;

  virtual std::string device() const = 0;         // "cpu" or "cuda:<n> (<name>)"
  virtual std::size_t num_params() const = 0;

  // Master weights and Adam's moments, as host vectors of num_params() each.
  virtual void set_state(const std::vector<float>& params, const std::vector<float>& m,
                         const std::vector<float>& v) = 0;
  virtual void get_state(std::vector<float>& params, std::vector<float>& m,
                         std::vector<float>& v) = 0;

  // Forward and backward over global samples [first, first + count): writes the gradients of
  // the mean loss, times loss_scale, into the gradient buffer, and the (unscaled) mean loss
  // into its last slot.
  virtual void forward_backward(std::int64_t first, int count, float loss_scale) = 0;
  virtual float* grad_buffer() = 0;          // num_params() + 1 floats
  virtual void* stream() = 0;                // cudaStream_t for the communicator, or nullptr
  virtual float loss_slot() = 0;             // the buffer's last slot (after the all_reduce)

  // Gradients *= inv_scale; true when every gradient is finite.
  virtual bool unscale_and_check(float inv_scale) = 0;
  // One AdamW step (t counts from 1) on the master weights with the buffer's gradients.
  virtual void adam_step(const AdamConfig& cfg, float lr, std::int64_t t) = 0;
  // Fault injection for tests: makes one gradient +inf (after forward_backward).
  virtual void poison_gradient() = 0;
  // Measurements for the final report (the CUDA engine: the GEMMs' achieved TFLOP/s, timed
  // with CUDA events); empty when there is nothing to say.
  virtual std::string perf_summary() { return {}; }
};

// A CPU engine (always available).
std::unique_ptr<Engine> make_cpu_engine(const Shape& shape, Precision p, std::uint64_t seed,
                                        int max_batch);
// Whether a CUDA device is visible, and a CUDA engine on device `device` (UNAVAILABLE when
// this build has no CUDA path or no device is visible).
bool cuda_available();
absl::StatusOr<std::unique_ptr<Engine>> make_cuda_engine(const Shape& shape, Precision p,
                                                         std::uint64_t seed, int max_batch,
                                                         int device);

}  // namespace muster::train
