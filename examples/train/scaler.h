// Dynamic loss scaling with torch.cuda.amp.GradScaler's defaults: start at 2^16; a step whose
// gradients hold an inf or NaN is skipped and the scale halves; after `growth_interval`
// finite steps in a row the scale doubles. The decision is the same on every rank because it
// is taken on the all-reduced gradients (an inf on one rank is an inf in the sum everywhere).
#pragma once

#include <cmath>
#include <cstdint>

namespace muster::train {

class LossScaler {
 public:
  struct Options {
    bool enabled = true;  // disabled: the scale stays 1 (fp32 training)
    float init_scale = 65536.0f;
    float growth_factor = 2.0f;
    float backoff_factor = 0.5f;
    std::int64_t growth_interval = 2000;
  };

  explicit LossScaler(Options o) : o_(o), scale_(o.enabled ? o.init_scale : 1.0f) {}

  float scale() const { return scale_; }
  std::int64_t growth_tracker() const { return tracker_; }
  void restore(float scale, std::int64_t tracker) {
    scale_ = scale;
    tracker_ = tracker;
  }

  // After each step: whether its gradients were all finite.
  void update(bool finite) {
    if (!o_.enabled) return;
    if (!finite) {
      scale_ *= o_.backoff_factor;
      tracker_ = 0;
    } else if (++tracker_ == o_.growth_interval) {
      scale_ *= o_.growth_factor;
      tracker_ = 0;
    }
  }

 private:
  Options o_;
  float scale_;
  std::int64_t tracker_ = 0;
};

// Linear warm-up from 0 to `peak` over `warmup` steps, then cosine decay to `floor` at `total`.
// Steps count from 1.
inline float learning_rate(std::int64_t step, std::int64_t warmup, std::int64_t total, float peak,
                           float floor) {
  if (step <= warmup) return peak * static_cast<float>(step) / static_cast<float>(warmup);
  if (step >= total) return floor;
  const double progress = static_cast<double>(step - warmup) / static_cast<double>(total - warmup);
  return floor + 0.5f * (peak - floor) * static_cast<float>(1.0 + std::cos(3.141592653589793 * progress));
}

}  // namespace muster::train
