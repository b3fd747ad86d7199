#include "model.h"

namespace muster::train {

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::kF32: return "fp32";
    case Precision::kBF16: return "bf16";
    case Precision::kF16: return "fp16";
  }
  return "?";
}

std::vector<float> teacher_w1(const Shape& s, std::uint64_t seed) {
  std::vector<float> w(static_cast<std::size_t>(s.in) * s.teacher_hidden);
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.in));
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = scale * normal(seed, kTeacher1, i);
  return w;
}

std::vector<float> teacher_w2(const Shape& s, std::uint64_t seed) {
  std::vector<float> w(static_cast<std::size_t>(s.teacher_hidden) * s.out);
  // tanh's outputs have a variance well under 1: scale up so that y has a variance near 1.
  const float scale = 2.0f / std::sqrt(static_cast<float>(s.teacher_hidden));
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = scale * normal(seed, kTeacher2, i);
  return w;
}

std::vector<float> initial_params(const Shape& s, std::uint64_t seed) {
  std::vector<float> p(s.num_params(), 0.0f);
  for (int l = 0; l < s.layers(); ++l) {
    const std::size_t n = static_cast<std::size_t>(s.fan_in(l)) * s.fan_out(l);
    const float scale = std::sqrt((l == s.depth ? 1.0f : 2.0f) / static_cast<float>(s.fan_in(l)));
    const std::size_t off = s.w_offset(l);
    for (std::size_t i = 0; i < n; ++i) p[off + i] = scale * normal(seed, kInit, off + i);
  }
  return p;
}

}  // namespace muster::train
