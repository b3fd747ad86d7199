// The example's task and model: a student MLP learns a fixed random teacher MLP.
//
// Everything random is a pure function of (seed, stream, index) (counter-based, no state), so
// the same numbers come out on the CPU and the GPU, on any rank, after any restart:
// - sample i of the data: x_i ~ N(0, 1)^in, y_i = teacher(x_i);
// - the teacher: in -> teacher_hidden (tanh) -> out, weights N(0, 1/fan_in), no biases;
// - the student's initial weights: N(0, 2/fan_in) (GELU), biases 0.
// Step s's global batch is samples [s * G, (s + 1) * G) with G = per-rank batch * world size;
// rank r takes the r-th slice of it, so k ranks with batch B see what 1 rank with batch kB sees.
//
// The student: in -> hidden (GELU) -> ... -> hidden (GELU) -> out, `depth` hidden layers;
// loss = mean over the batch and the outputs of (prediction - y)^2.
// Parameters live in one flat fp32 vector: for each layer l, W_l [fan_in x fan_out] row-major,
// then b_l [fan_out]. Activations are row-major [batch x features]; a layer is Z = A W + b.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#if defined(__CUDACC__)
#define MUSTER_HD __host__ __device__ inline
#else
#define MUSTER_HD inline
#endif

namespace muster::train {

enum class Precision { kF32, kBF16, kF16 };
const char* precision_name(Precision p);

struct Shape {
  int in = 64;
  int hidden = 256;
  int depth = 2;  // hidden layers
  int out = 16;
  int teacher_hidden = 64;

  int layers() const { return depth + 1; }
  int fan_in(int l) const { return l == 0 ? in : hidden; }
  int fan_out(int l) const { return l == depth ? out : hidden; }
  std::size_t w_offset(int l) const {
    std::size_t off = 0;
    for (int i = 0; i < l; ++i) off += static_cast<std::size_t>(fan_in(i)) * fan_out(i) + fan_out(i);
    return off;
  }
  std::size_t b_offset(int l) const {
    return w_offset(l) + static_cast<std::size_t>(fan_in(l)) * fan_out(l);
  }
  std::size_t num_params() const { return w_offset(layers()); }
};

// Random streams.
enum Stream : std::uint64_t { kInput = 1, kTeacher1 = 2, kTeacher2 = 3, kInit = 4 };

MUSTER_HD std::uint64_t mix64(std::uint64_t z) {  // splitmix64's finaliser
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// N(0, 1) number `index` of stream `stream` (Box-Muller on two hashed uniforms).
MUSTER_HD float normal(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  const std::uint64_t h1 = mix64(seed ^ mix64(stream * 0x100000001b3ull + mix64(2 * index)));
  const std::uint64_t h2 = mix64(seed ^ mix64(stream * 0x100000001b3ull + mix64(2 * index + 1)));
  const float u1 = (static_cast<float>(h1 >> 40) + 1.0f) * (1.0f / 16777217.0f);  // (0, 1)
  const float u2 = static_cast<float>(h2 >> 40) * (1.0f / 16777216.0f);            // [0, 1)
  return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853071795864f * u2);
}

// x of global sample `sample`, feature `j`.
MUSTER_HD float input_value(std::uint64_t seed, std::int64_t sample, int j, int in) {
  return normal(seed, kInput, static_cast<std::uint64_t>(sample) * in + j);
}

MUSTER_HD float gelu(float z) {  // tanh approximation, as PyTorch's approximate="tanh"
  const float k = 0.7978845608028654f;  // sqrt(2/pi)
  return 0.5f * z * (1.0f + tanhf(k * (z + 0.044715f * z * z * z)));
}

MUSTER_HD float gelu_grad(float z) {
  const float k = 0.7978845608028654f;
  const float t = tanhf(k * (z + 0.044715f * z * z * z));
  return 0.5f * (1.0f + t) + 0.5f * z * (1.0f - t * t) * k * (1.0f + 3.0f * 0.044715f * z * z);
}

// The teacher's weights: W1 [in x th], W2 [th x out], row-major.
std::vector<float> teacher_w1(const Shape& s, std::uint64_t seed);
std::vector<float> teacher_w2(const Shape& s, std::uint64_t seed);
// The student's initial parameters (flat layout above).
std::vector<float> initial_params(const Shape& s, std::uint64_t seed);

}  // namespace muster::train
