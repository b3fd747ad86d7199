// examples/train's CUDA engine against its CPU reference, on one GPU: the loss, every gradient
// and the parameters after AdamW steps, in fp32 (tight) and bf16/fp16 (loose: the two sum in
// different orders, and a 16-bit rounding can flip). Exits 77 (ctest: Skipped) without a GPU.
#include <cmath>
#include <cstdio>
#include <vector>

#include "engine.h"

using namespace muster::train;

namespace {

int failures = 0;

void expect_close(const char* what, const std::vector<float>& got, const std::vector<float>& want,
                  double rel_tol) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    diff += std::pow(static_cast<double>(got[i]) - want[i], 2);
    norm += std::pow(static_cast<double>(want[i]), 2);
  }
  const double rel = std::sqrt(diff / std::max(norm, 1e-30));
  std::printf("%-34s relative L2 difference %.2e (tolerance %.0e)\n", what, rel, rel_tol);
  if (!(rel <= rel_tol)) ++failures;
}

}  // namespace

int main() {
  if (!cuda_available()) {
    std::printf("no CUDA device (or no CUDA engine in this build): skipped\n");
    return 77;
  }
  const Shape shape;
  const int batch = 64;
  const std::size_t n = shape.num_params();
  for (Precision p : {Precision::kF32, Precision::kBF16, Precision::kF16}) {
    const double tol = p == Precision::kF32 ? 1e-5 : 2e-2;
    auto gpu = make_cuda_engine(shape, p, 5, batch, 0);
    if (!gpu.ok()) {
      std::printf("cuda engine: %s\n", std::string(gpu.status().message()).c_str());
      return 1;
    }
    auto cpu = make_cpu_engine(shape, p, 5, batch);
    const std::vector<float> init = initial_params(shape, 5), zero(n, 0.0f);
    for (Engine* e : {gpu->get(), cpu.get()}) e->set_state(init, zero, zero);
    std::printf("%s on %s\n", precision_name(p), (*gpu)->device().c_str());
    for (int step = 1; step <= 3; ++step) {
      std::vector<float> g[2];
      float loss[2];
      int k = 0;
      for (Engine* e : {gpu->get(), cpu.get()}) {
        e->forward_backward((step - 1) * batch, batch, p == Precision::kF32 ? 1.0f : 1024.0f);
        loss[k] = e->loss_slot();
        if (!e->unscale_and_check(p == Precision::kF32 ? 1.0f : 1.0f / 1024.0f)) ++failures;
        // The GPU's gradients are in device memory; after the first AdamW step from zero
        // moments Adam's m is (1 - beta1) g, so m shows them. Later steps compare parameters.
        e->adam_step(AdamConfig{}, 1e-3f, step);
        std::vector<float> params, m, v;
        e->get_state(params, m, v);
        g[k] = step == 1 ? m : params;
        ++k;
      }
      std::printf("step %d: loss gpu %.7f cpu %.7f\n", step, loss[0], loss[1]);
      if (!(std::abs(loss[0] - loss[1]) <= tol * std::abs(loss[1]) + 1e-7)) ++failures;
      expect_close(step == 1 ? "  gradients (Adam's first moment)" : "  parameters", g[0], g[1], tol);
    }
    // Fault injection is seen by the scaler's check on the GPU too.
    (*gpu)->forward_backward(0, batch, 1.0f);
    (*gpu)->poison_gradient();
    if ((*gpu)->unscale_and_check(1.0f)) {
      std::printf("poisoned gradient not detected\n");
      ++failures;
    }
    std::printf("  %s\n", (*gpu)->perf_summary().c_str());
  }
  std::printf(failures == 0 ? "cuda engine matches the cpu reference\n" : "%d check(s) failed\n", failures);
  return failures == 0 ? 0 : 1;
}
