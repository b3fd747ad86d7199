// The CPU engine: plain loops (written so that the compiler vectorises the inner ones), bf16
// and fp16 emulated by rounding to nearest even after every operation the GPU would store in
// 16 bits (see engine.h). This file is also the reference the CUDA engine follows.
#include <algorithm>
#include <cmath>

#include "engine.h"
#include "muster/worker/half.h"

namespace muster::train {
namespace {

using worker::bf16_to_f32;
using worker::f16_to_f32;
using worker::f32_to_bf16;
using worker::f32_to_f16;

class CpuEngine final : public Engine {
 public:
  CpuEngine(const Shape& s, Precision p, std::uint64_t seed, int max_batch)
      : s_(s), p_(p), seed_(seed), n_(s.num_params()), params_(n_), m_(n_), v_(n_),
        grad_(n_ + 1), wq_(n_), t1_(teacher_w1(s, seed)), t2_(teacher_w2(s, seed)) {
    a_.resize(s.layers() + 1);
    z_.resize(s.layers());
    for (int l = 0; l < s.layers(); ++l) {
      a_[l].resize(static_cast<std::size_t>(max_batch) * s.fan_in(l));
      z_[l].resize(static_cast<std::size_t>(max_batch) * s.fan_out(l));
    }
    y_.resize(static_cast<std::size_t>(max_batch) * s.out);
    dz_.resize(static_cast<std::size_t>(max_batch) * std::max(s.hidden, s.out));
    dz_prev_.resize(dz_.size());
  }

  std::string device() const override { return "cpu"; }
  std::size_t num_params() const override { return n_; }

  void set_state(const std::vector<float>& params, const std::vector<float>& m,
                 const std::vector<float>& v) override {
    params_ = params;
    m_ = m;
    v_ = v;
  }
  void get_state(std::vector<float>& params, std::vector<float>& m,
                 std::vector<float>& v) override {
    params = params_;
    m = m_;
    v = v_;
  }

  void forward_backward(std::int64_t first, int count, float loss_scale) override;
  float* grad_buffer() override { return grad_.data(); }
  void* stream() override { return nullptr; }
  float loss_slot() override { return grad_[n_]; }

  bool unscale_and_check(float inv_scale) override {
    bool finite = true;
    for (std::size_t i = 0; i < n_; ++i) {
      grad_[i] *= inv_scale;
      finite &= std::isfinite(grad_[i]);
    }
    return finite;
  }

  void adam_step(const AdamConfig& c, float lr, std::int64_t t) override {
    const float bc1 = 1.0f - std::pow(c.beta1, static_cast<float>(t));
    const float bc2_sqrt = std::sqrt(1.0f - std::pow(c.beta2, static_cast<float>(t)));
    const float step = lr / bc1;
    for (std::size_t i = 0; i < n_; ++i) {
      const float g = grad_[i];
      params_[i] *= 1.0f - lr * c.weight_decay;
      m_[i] = c.beta1 * m_[i] + (1.0f - c.beta1) * g;
      v_[i] = c.beta2 * v_[i] + (1.0f - c.beta2) * g * g;
      params_[i] -= step * m_[i] / (std::sqrt(v_[i]) / bc2_sqrt + c.eps);
    }
  }

  void poison_gradient() override { grad_[0] = INFINITY; }

 private:
  float q(float x) const {
    switch (p_) {
      case Precision::kF32: return x;
      case Precision::kBF16: return bf16_to_f32(f32_to_bf16(x));
      case Precision::kF16: return f16_to_f32(f32_to_f16(x));
    }
    return x;
  }

  const Shape s_;
  const Precision p_;
  const std::uint64_t seed_;
  const std::size_t n_;
  std::vector<float> params_, m_, v_, grad_, wq_;
  const std::vector<float> t1_, t2_;
  std::vector<std::vector<float>> a_, z_;  // a_[l]: layer l's input; z_[l]: its pre-activation
  std::vector<float> y_, dz_, dz_prev_, wt_;
};

// C[rows x cols] = A[rows x inner] B[inner x cols], all row-major, fp32 accumulation.
void gemm_nn(const float* a, const float* b, float* c, int rows, int inner, int cols) {
  for (int r = 0; r < rows; ++r) {
    float* cr = c + static_cast<std::size_t>(r) * cols;
    std::fill(cr, cr + cols, 0.0f);
    for (int k = 0; k < inner; ++k) {
      const float av = a[static_cast<std::size_t>(r) * inner + k];
      const float* bk = b + static_cast<std::size_t>(k) * cols;
      for (int j = 0; j < cols; ++j) cr[j] += av * bk[j];
    }
  }
}

void CpuEngine::forward_backward(std::int64_t first, int count, float loss_scale) {
  const int L = s_.layers();
  const int th = s_.teacher_hidden;
  // The batch and its targets (the teacher in fp32, on the exact inputs).
  std::vector<float> x(static_cast<std::size_t>(count) * s_.in), h(static_cast<std::size_t>(count) * th);
  for (int b = 0; b < count; ++b) {
    for (int j = 0; j < s_.in; ++j) x[static_cast<std::size_t>(b) * s_.in + j] = input_value(seed_, first + b, j, s_.in);
  }
  gemm_nn(x.data(), t1_.data(), h.data(), count, s_.in, th);
  for (float& v : h) v = std::tanh(v);
  gemm_nn(h.data(), t2_.data(), y_.data(), count, th, s_.out);
  for (std::size_t i = 0; i < x.size(); ++i) a_[0][i] = q(x[i]);
  for (std::size_t i = 0; i < n_; ++i) wq_[i] = q(params_[i]);

  // Forward: g = q(A Wq); z = q(g + b); next A = q(gelu(z)).
  for (int l = 0; l < L; ++l) {
    const int fi = s_.fan_in(l), fo = s_.fan_out(l);
    float* z = z_[l].data();
    gemm_nn(a_[l].data(), wq_.data() + s_.w_offset(l), z, count, fi, fo);
    const float* bias = params_.data() + s_.b_offset(l);
    for (int b = 0; b < count; ++b) {
      for (int j = 0; j < fo; ++j) {
        float& v = z[static_cast<std::size_t>(b) * fo + j];
        v = q(q(v) + bias[j]);
      }
    }
    if (l + 1 < L) {
      float* next = a_[l + 1].data();
      for (std::size_t i = 0; i < static_cast<std::size_t>(count) * fo; ++i) next[i] = q(gelu(z[i]));
    }
  }

  // Loss and its gradient: dz = q(scale * 2 (pred - y) / (count * out)).
  const std::size_t outs = static_cast<std::size_t>(count) * s_.out;
  const float* pred = z_[L - 1].data();
  double loss = 0;
  const float k = 2.0f * loss_scale / static_cast<float>(outs);
  for (std::size_t i = 0; i < outs; ++i) {
    const float d = pred[i] - y_[i];
    loss += static_cast<double>(d) * d;
    dz_[i] = q(k * d);
  }
  grad_[n_] = static_cast<float>(loss / static_cast<double>(outs));

  // Backward: dW = A^T dz, db = sum dz, dA = q(dz Wq^T), dz_prev = q(dA * gelu'(z_prev)).
  for (int l = L - 1; l >= 0; --l) {
    const int fi = s_.fan_in(l), fo = s_.fan_out(l);
    float* dw = grad_.data() + s_.w_offset(l);
    float* db = grad_.data() + s_.b_offset(l);
    std::fill(dw, dw + static_cast<std::size_t>(fi) * fo, 0.0f);
    std::fill(db, db + fo, 0.0f);
    const float* a = a_[l].data();
    for (int b = 0; b < count; ++b) {
      const float* dzb = dz_.data() + static_cast<std::size_t>(b) * fo;
      for (int j = 0; j < fo; ++j) db[j] += dzb[j];
      for (int i = 0; i < fi; ++i) {
        const float av = a[static_cast<std::size_t>(b) * fi + i];
        float* row = dw + static_cast<std::size_t>(i) * fo;
        for (int j = 0; j < fo; ++j) row[j] += av * dzb[j];
      }
    }
    if (l == 0) break;
    // dA = dz Wq^T through Wq^T [fo x fi], so the inner loop runs over i and vectorises; each
    // dA[b][i] still sums j = 0, 1, ... in order.
    const float* w = wq_.data() + s_.w_offset(l);
    wt_.resize(static_cast<std::size_t>(fi) * fo);
    for (int i = 0; i < fi; ++i) {
      for (int j = 0; j < fo; ++j) wt_[static_cast<std::size_t>(j) * fi + i] = w[static_cast<std::size_t>(i) * fo + j];
    }
    gemm_nn(dz_.data(), wt_.data(), dz_prev_.data(), count, fo, fi);
    const float* zp = z_[l - 1].data();
    for (std::size_t i = 0; i < static_cast<std::size_t>(count) * fi; ++i) {
      dz_prev_[i] = q(q(dz_prev_[i]) * gelu_grad(zp[i]));
    }
    std::swap(dz_, dz_prev_);
  }
}

}  // namespace

std::unique_ptr<Engine> make_cpu_engine(const Shape& shape, Precision p, std::uint64_t seed,
                                        int max_batch) {
  return std::make_unique<CpuEngine>(shape, p, seed, max_batch);
}

}  // namespace muster::train
