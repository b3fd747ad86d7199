// examples/train's pieces without processes: gradients against finite differences, the loss
// scaler, the learning-rate schedule, checkpoints, and the 16-bit emulation.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <fstream>

#include <catch2/catch.hpp>

#include "checkpoint.h"
#include "engine.h"
#include "scaler.h"

using namespace muster::train;

namespace {

Shape tiny() {
  Shape s;
  s.in = 3;
  s.hidden = 5;
  s.depth = 2;
  s.out = 2;
  s.teacher_hidden = 4;
  return s;
}

float loss_at(Engine& e, const std::vector<float>& p, int batch) {
  std::vector<float> zero(p.size(), 0.0f);
  e.set_state(p, zero, zero);
  e.forward_backward(0, batch, 1.0f);
  return e.grad_buffer()[p.size()];
}

}  // namespace

TEST_CASE("train: gradients match central finite differences (fp32, tiny model)", "[train]") {
  const Shape s = tiny();
  const int batch = 4;
  auto e = make_cpu_engine(s, Precision::kF32, 7, batch);
  std::vector<float> p = initial_params(s, 7);
  for (std::size_t i = 0; i < p.size(); ++i) p[i] += 0.05f * std::sin(static_cast<float>(i));  // non-zero biases
  std::vector<float> zero(p.size(), 0.0f);
  e->set_state(p, zero, zero);
  e->forward_backward(0, batch, 1.0f);
  const std::vector<float> grad(e->grad_buffer(), e->grad_buffer() + p.size());
  const float eps = 1e-2f;
  int checked = 0;
  for (std::size_t i = 0; i < p.size(); ++i) {
    std::vector<float> plus = p, minus = p;
    plus[i] += eps;
    minus[i] -= eps;
    const float fd = (loss_at(*e, plus, batch) - loss_at(*e, minus, batch)) / (2 * eps);
    INFO("parameter " << i << ": analytic " << grad[i] << ", finite difference " << fd);
    CHECK(std::abs(grad[i] - fd) <= 2e-3f + 2e-2f * std::abs(fd));
    ++checked;
  }
  CHECK(checked == static_cast<int>(s.num_params()));
  // The loss scale multiplies the gradients and leaves the loss alone.
  e->set_state(p, zero, zero);
  e->forward_backward(0, batch, 1024.0f);
  CHECK(e->grad_buffer()[p.size()] == Approx(loss_at(*e, p, batch)));
  e->set_state(p, zero, zero);
  e->forward_backward(0, batch, 1024.0f);
  CHECK(e->grad_buffer()[3] == Approx(1024.0f * grad[3]).epsilon(1e-5));
}

TEST_CASE("train: bf16 and fp16 compute stay close to fp32 and round differently", "[train]") {
  const Shape s;
  const std::vector<float> p = initial_params(s, 3), zero(s.num_params(), 0.0f);
  std::map<Precision, std::vector<float>> g;
  std::map<Precision, float> loss;
  for (Precision pr : {Precision::kF32, Precision::kBF16, Precision::kF16}) {
    auto e = make_cpu_engine(s, pr, 3, 16);
    e->set_state(p, zero, zero);
    e->forward_backward(0, 16, 1.0f);
    g[pr].assign(e->grad_buffer(), e->grad_buffer() + s.num_params());
    loss[pr] = e->grad_buffer()[s.num_params()];
  }
  CHECK(loss[Precision::kBF16] == Approx(loss[Precision::kF32]).epsilon(0.02));
  CHECK(loss[Precision::kF16] == Approx(loss[Precision::kF32]).epsilon(0.005));
  double diff_bf16 = 0, diff_f16 = 0, norm = 0;
  for (std::size_t i = 0; i < s.num_params(); ++i) {
    const double r = g[Precision::kF32][i];
    norm += r * r;
    diff_bf16 += std::pow(g[Precision::kBF16][i] - r, 2);
    diff_f16 += std::pow(g[Precision::kF16][i] - r, 2);
  }
  CHECK(diff_bf16 > 0);  // rounding happened
  CHECK(diff_f16 > 0);
  CHECK(diff_f16 < diff_bf16);  // fp16 keeps 3 more mantissa bits than bf16
  CHECK(std::sqrt(diff_bf16 / norm) < 0.05);
}

TEST_CASE("train: fp16 overflows where the loss scale is too big, bf16 does not", "[train]") {
  const Shape s;
  const std::vector<float> p = initial_params(s, 3), zero(s.num_params(), 0.0f);
  auto f16 = make_cpu_engine(s, Precision::kF16, 3, 16);
  f16->set_state(p, zero, zero);
  f16->forward_backward(0, 16, 1e9f);
  CHECK_FALSE(f16->unscale_and_check(1e-9f));
  auto bf16 = make_cpu_engine(s, Precision::kBF16, 3, 16);
  bf16->set_state(p, zero, zero);
  bf16->forward_backward(0, 16, 1e9f);
  CHECK(bf16->unscale_and_check(1e-9f));
  bf16->forward_backward(0, 16, 1.0f);
  bf16->poison_gradient();
  CHECK_FALSE(bf16->unscale_and_check(1.0f));
}

TEST_CASE("train: the loss scaler has GradScaler's defaults, halves on inf, grows after the interval",
          "[train]") {
  LossScaler d({});
  CHECK(d.scale() == 65536.0f);
  LossScaler s({true, 65536.0f, 2.0f, 0.5f, 3});
  s.update(false);
  CHECK(s.scale() == 32768.0f);
  s.update(true);
  s.update(true);
  CHECK(s.scale() == 32768.0f);
  s.update(true);  // third finite step in a row
  CHECK(s.scale() == 65536.0f);
  s.update(true);
  s.update(false);  // an inf resets the count
  s.update(true);
  s.update(true);
  CHECK(s.scale() == 32768.0f);
  s.update(true);
  CHECK(s.scale() == 65536.0f);
  LossScaler off({false});
  off.update(false);
  CHECK(off.scale() == 1.0f);
}

TEST_CASE("train: warm-up then cosine decay", "[train]") {
  CHECK(learning_rate(1, 10, 110, 1.0f, 0.1f) == Approx(0.1f));
  CHECK(learning_rate(10, 10, 110, 1.0f, 0.1f) == Approx(1.0f));
  CHECK(learning_rate(60, 10, 110, 1.0f, 0.1f) == Approx(0.55f));  // half way: the mean
  CHECK(learning_rate(110, 10, 110, 1.0f, 0.1f) == Approx(0.1f));
  for (int t = 11; t < 110; ++t) {
    CHECK(learning_rate(t + 1, 10, 110, 1.0f, 0.1f) < learning_rate(t, 10, 110, 1.0f, 0.1f));
  }
}

TEST_CASE("train: a checkpoint round-trips, replaces the last atomically, and damage is caught",
          "[train]") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("muster-ck-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  CHECK(load_checkpoint(dir.string()).status().code() == absl::StatusCode::kNotFound);
  Checkpoint c{"model a", 40, 39, 32768.0f, 7, {1.5f, -2.0f, 3.25f}, {0.1f, 0.2f, 0.3f}, {1, 2, 3}};
  REQUIRE(save_checkpoint(dir.string(), c).ok());
  c.step = 50;
  c.params[0] = 9.0f;
  REQUIRE(save_checkpoint(dir.string(), c).ok());
  int files = 0;
  for (auto& e : fs::directory_iterator(dir)) {
    ++files;
    CHECK(e.path().filename() == "checkpoint.bin");  // no temporary file left behind
  }
  CHECK(files == 1);
  auto back = load_checkpoint(dir.string());
  REQUIRE(back.ok());
  CHECK(back->fingerprint == "model a");
  CHECK(back->step == 50);
  CHECK(back->adam_steps == 39);
  CHECK(back->scale == 32768.0f);
  CHECK(back->growth_tracker == 7);
  CHECK(back->params == std::vector<float>{9.0f, -2.0f, 3.25f});
  CHECK(back->v == std::vector<float>{1, 2, 3});
  {
    std::fstream f(dir / "checkpoint.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(60);
    f.put('\x7f');
  }
  CHECK(load_checkpoint(dir.string()).status().code() == absl::StatusCode::kDataLoss);
  fs::resize_file(dir / "checkpoint.bin", 20);
  CHECK(load_checkpoint(dir.string()).status().code() == absl::StatusCode::kDataLoss);
  fs::remove_all(dir);
}
