// Worker for the collective tests: joins the job through Runtime::from_env() and a TCP
// communicator, then
//   check            runs every op x dtype x size (1, 7, 1000, 1M elements) against values
//                    computed locally; prints "rank R: all collectives correct" or the first
//                    mismatch, and exits 0 or 1.
//   sum              one small f32 all_reduce (sum) and a barrier, checked: a quick job that
//                    uses the store and the ring; prints "rank R: sum correct".
//   die RANK         every rank enters an all_reduce of 4M floats, except RANK, which kills
//                    itself first; the others print the error they get and exit 3.
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "muster/worker/half.h"
#include "muster/worker/runtime.h"

using namespace muster::worker;

namespace {

int rank_, world_;

// Input of rank r at index i: small integers, so sums are exact even in bf16.
double input(int r, std::size_t i) { return (r + 1) * static_cast<double>(i % 5 + 1); }

double expected_reduce(std::size_t i, ReduceOp op, bool integer) {
  const double k = static_cast<double>(i % 5 + 1);
  const double sum = k * world_ * (world_ + 1) / 2;
  switch (op) {
    case ReduceOp::kSum: return sum;
    case ReduceOp::kAvg: return integer ? std::floor(sum / world_) : sum / world_;
    case ReduceOp::kMin: return k;
    case ReduceOp::kMax: return k * world_;
  }
  return 0;
}

template <typename T>
struct Codec {
  static T put(double v) { return static_cast<T>(v); }
  static double get(T v) { return static_cast<double>(v); }
};
struct Bf16 {};
struct F16 {};
template <>
struct Codec<Bf16> {
  static std::uint16_t put(double v) { return f32_to_bf16(static_cast<float>(v)); }
  static double get(std::uint16_t v) { return bf16_to_f32(v); }
};
template <>
struct Codec<F16> {
  static std::uint16_t put(double v) { return f32_to_f16(static_cast<float>(v)); }
  static double get(std::uint16_t v) { return f16_to_f32(v); }
};

template <typename Tag>
using Storage = std::conditional_t<std::is_same_v<Tag, Bf16> || std::is_same_v<Tag, F16>,
                                   std::uint16_t, Tag>;

int failures = 0;
void expect(bool ok, const std::string& what) {
  if (!ok && failures++ < 5) std::fprintf(stderr, "rank %d: MISMATCH %s\n", rank_, what.c_str());
}

bool close(double got, double want, double rel) {
  return std::fabs(got - want) <= rel * std::max(1.0, std::fabs(want));
}

template <typename Tag>
void check_dtype(Communicator& c, DType dt, double tol) {
  using S = Storage<Tag>;
  using C = Codec<Tag>;
  const bool integer = dt == DType::kI32 || dt == DType::kI64;
  for (std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{1000}, std::size_t{1} << 20}) {
    const std::string tag = std::string(dtype_name(dt)) + " n=" + std::to_string(n);
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax}) {
      std::vector<S> buf(n);
      for (std::size_t i = 0; i < n; ++i) buf[i] = C::put(input(rank_, i));
      absl::Status s = c.all_reduce(buf.data(), n, dt, op);
      expect(s.ok(), "all_reduce " + tag + ": " + std::string(s.message()));
      for (std::size_t i = 0; i < n && s.ok(); ++i) {
        if (!close(C::get(buf[i]), expected_reduce(i, op, integer), tol)) {
          expect(false, "all_reduce " + tag + " op " + std::to_string(static_cast<int>(op)) +
                            " at " + std::to_string(i) + ": " + std::to_string(C::get(buf[i])));
          break;
        }
      }
      // reduce_scatter: each rank gets its block of the reduction of world_ * n elements.
      std::vector<S> send(n * world_), recv(n);
      for (std::size_t i = 0; i < send.size(); ++i) send[i] = C::put(input(rank_, i));
      s = c.reduce_scatter(send.data(), recv.data(), n, dt, op);
      expect(s.ok(), "reduce_scatter " + tag);
      for (std::size_t i = 0; i < n && s.ok(); ++i) {
        if (!close(C::get(recv[i]), expected_reduce(rank_ * n + i, op, integer), tol)) {
          expect(false, "reduce_scatter " + tag + " at " + std::to_string(i));
          break;
        }
      }
    }
    for (int root = 0; root < world_; ++root) {
      std::vector<S> buf(n);
      for (std::size_t i = 0; i < n; ++i) buf[i] = C::put(rank_ == root ? input(root, i) : -1);
      absl::Status s = c.broadcast(buf.data(), n, dt, root);
      expect(s.ok(), "broadcast " + tag);
      for (std::size_t i = 0; i < n && s.ok(); ++i) {
        if (C::get(buf[i]) != input(root, i)) {
          expect(false, "broadcast " + tag + " root " + std::to_string(root));
          break;
        }
      }
    }
    std::vector<S> mine(n), all(n * world_);
    for (std::size_t i = 0; i < n; ++i) mine[i] = C::put(input(rank_, i));
    absl::Status s = c.all_gather(mine.data(), all.data(), n, dt);
    expect(s.ok(), "all_gather " + tag);
    for (int r = 0; r < world_ && s.ok(); ++r) {
      for (std::size_t i = 0; i < n; ++i) {
        if (C::get(all[r * n + i]) != input(r, i)) {
          expect(false, "all_gather " + tag + " block " + std::to_string(r));
          break;
        }
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "check";
  auto rt = Runtime::from_env();
  if (!rt.ok()) {
    std::fprintf(stderr, "%s\n", std::string(rt.status().message()).c_str());
    return 2;
  }
  rank_ = (*rt)->info().rank;
  world_ = (*rt)->info().world_size;
  auto comm = (*rt)->communicator(Backend::kTcp);
  if (!comm.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank_, std::string(comm.status().message()).c_str());
    return 2;
  }
  Communicator& c = **comm;
  if (mode == "die" && argc == 3) {
    if (rank_ == std::atoi(argv[2])) ::kill(::getpid(), SIGKILL);
    std::vector<float> big(4 << 20, 1.0f);
    absl::Status s = c.all_reduce(big.data(), big.size(), DType::kF32, ReduceOp::kSum);
    std::printf("rank %d: %s\n", rank_, s.ok() ? "no error" : std::string(s.message()).c_str());
    return s.ok() ? 0 : 3;
  }
  if (mode == "sum") {
    std::vector<float> v(1024, static_cast<float>(rank_ + 1));
    absl::Status s = c.all_reduce(v.data(), v.size(), DType::kF32, ReduceOp::kSum);
    const float want = static_cast<float>(world_ * (world_ + 1) / 2);
    const bool ok = s.ok() && v.front() == want && v.back() == want && c.barrier().ok();
    std::printf("rank %d: %s\n", rank_, ok ? "sum correct" : "sum wrong");
    return ok ? 0 : 1;
  }
  check_dtype<float>(c, DType::kF32, 1e-6);
  check_dtype<double>(c, DType::kF64, 1e-12);
  check_dtype<std::int32_t>(c, DType::kI32, 0);
  check_dtype<std::int64_t>(c, DType::kI64, 0);
  check_dtype<Bf16>(c, DType::kBF16, 1e-2);
  check_dtype<F16>(c, DType::kF16, 1e-3);
  absl::Status b = c.barrier();
  expect(b.ok(), "barrier");
  if (failures == 0) std::printf("rank %d: all collectives correct\n", rank_);
  return failures == 0 ? 0 : 1;
}
