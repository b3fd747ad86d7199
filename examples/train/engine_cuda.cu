// The CUDA engine: the same arithmetic as engine_cpu.cc (the reference), on one GPU. GEMMs run
// in cuBLAS with compute-precision inputs (bf16, fp16 or fp32) and fp32 accumulation; small
// grid-stride kernels do the rest, rounding to the compute precision at the same points as the
// CPU engine. Everything is enqueued on the engine's own non-blocking stream, which the trainer
// also hands to the communicator (the gradient all_reduce follows forward_backward on it).
//
// cuBLAS is column-major and our matrices are row-major: a row-major [r x c] matrix with
// leading dimension c is, to cuBLAS, the column-major [c x r] matrix (its transpose). So the
// row-major product C[r x c] = A[r x k] B[k x c] is computed as the column-major
// C^T = B^T A^T:  gemm(N, N, m = c, n = r, k, B, ldb = c, A, lda = k, C, ldc = c).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "engine.h"

namespace muster::train {
namespace {

const char* err_str(cudaError_t e) { return cudaGetErrorString(e); }
const char* err_str(cublasStatus_t s) { return cublasGetStatusString(s); }
bool failed(cudaError_t e) { return e != cudaSuccess; }
bool failed(cublasStatus_t s) { return s != CUBLAS_STATUS_SUCCESS; }

// After creation: a failed call is fatal (the virtual methods have no way to report it).
#define CUDA_CHECK(call)                                                                  \
  do {                                                                                    \
    const auto e_ = (call);                                                               \
    if (failed(e_)) {                                                                     \
      std::fprintf(stderr, "engine_cuda: %s failed: %s (%s:%d)\n", #call, err_str(e_),    \
                   __FILE__, __LINE__);                                                   \
      std::abort();                                                                       \
    }                                                                                     \
  } while (0)
#define LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())
// During creation: a failed call becomes an INTERNAL status.
#define CUDA_RETURN_IF_ERROR(call)                                                             \
  do {                                                                                         \
    const auto e_ = (call);                                                                    \
    if (failed(e_)) return absl::InternalError(std::string(#call) + " failed: " + err_str(e_)); \
  } while (0)

// The compute precision: its cuBLAS type and rounding to it (kF32: none).
template <class T> struct Num;
template <> struct Num<float> {
  static constexpr cudaDataType kType = CUDA_R_32F;
  __device__ static float to(float x) { return x; }
  __device__ static float from(float x) { return x; }
};
template <> struct Num<__nv_bfloat16> {
  static constexpr cudaDataType kType = CUDA_R_16BF;
  __device__ static __nv_bfloat16 to(float x) { return __float2bfloat16_rn(x); }
  __device__ static float from(__nv_bfloat16 x) { return __bfloat162float(x); }
};
template <> struct Num<__half> {
  static constexpr cudaDataType kType = CUDA_R_16F;
  __device__ static __half to(float x) { return __float2half_rn(x); }
  __device__ static float from(__half x) { return __half2float(x); }
};

constexpr int kThreads = 256;
int blocks_for(std::size_t n) {
  return static_cast<int>(std::clamp<std::size_t>((n + kThreads - 1) / kThreads, 1, 4096));
}
#define GRID_STRIDE(i, n)                                                               \
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; \
       i < (n); i += static_cast<std::size_t>(gridDim.x) * blockDim.x)

// Explicit _rn intrinsics where the CPU rounds after each operation: they keep nvcc from
// contracting a multiply and an add into one FMA (one rounding instead of two).

// x[b, j] = input (fp32, for the teacher); a0 = q(x).
template <class T>
__global__ void inputs_kernel(std::uint64_t seed, std::int64_t first, int count, int in, float* x,
                              T* a0) {
  GRID_STRIDE(i, static_cast<std::size_t>(count) * in) {
    const std::int64_t b = static_cast<std::int64_t>(i / in);
    const float v = input_value(seed, first + b, static_cast<int>(i % in), in);
    x[i] = v;
    a0[i] = Num<T>::to(v);
  }
}

__global__ void tanh_kernel(float* h, std::size_t n) {
  GRID_STRIDE(i, n) h[i] = tanhf(h[i]);
}

template <class T>
__global__ void cast_kernel(const float* p, T* q, std::size_t n) {
  GRID_STRIDE(i, n) q[i] = Num<T>::to(p[i]);
}

// z holds q(A W); z = q(z + b); next (hidden layers) = q(gelu(z)).
template <class T>
__global__ void bias_act_kernel(T* z, T* next, const float* bias, int rows, int cols) {
  GRID_STRIDE(i, static_cast<std::size_t>(rows) * cols) {
    const T v = Num<T>::to(__fadd_rn(Num<T>::from(z[i]), bias[i % cols]));
    z[i] = v;
    if (next != nullptr) next[i] = Num<T>::to(gelu(Num<T>::from(v)));
  }
}

// One block: d = pred - y; dz = q(k d); loss = mean(d^2), summed in double in a fixed order
// (per-thread strided sums, then a tree), so repeated runs give the same bits.
template <class T>
__global__ void loss_kernel(const T* pred, const float* y, std::size_t n, float k, T* dz,
                            float* loss) {
  __shared__ double part[kThreads];
  double s = 0;
  for (std::size_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float d = __fsub_rn(Num<T>::from(pred[i]), y[i]);
    s += static_cast<double>(d) * d;  // exact product: an FMA here changes nothing
    dz[i] = Num<T>::to(__fmul_rn(k, d));
  }
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) *loss = static_cast<float>(part[0] / static_cast<double>(n));
}

// db[j] = sum over b of dz[b, j], in fp32, b in order (as the CPU does).
template <class T>
__global__ void bias_grad_kernel(const T* dz, int rows, int cols, float* db) {
  GRID_STRIDE(j, static_cast<std::size_t>(cols)) {
    float s = 0.0f;
#pragma unroll 8
    for (int b = 0; b < rows; ++b) {
      s = __fadd_rn(s, Num<T>::from(dz[static_cast<std::size_t>(b) * cols + j]));
    }
    db[j] = s;
  }
}

// In place: d holds q(dz W^T); d = q(d * gelu'(z_prev)).
template <class T>
__global__ void gelu_back_kernel(T* d, const T* z, std::size_t n) {
  GRID_STRIDE(i, n) d[i] = Num<T>::to(__fmul_rn(Num<T>::from(d[i]), gelu_grad(Num<T>::from(z[i]))));
}

__global__ void unscale_kernel(float* g, std::size_t n, float s, int* bad) {
  GRID_STRIDE(i, n) {
    const float v = __fmul_rn(g[i], s);
    g[i] = v;
    if (!isfinite(v)) *bad = 1;
  }
}

__global__ void adam_kernel(float* p, float* m, float* v, const float* g, std::size_t n, float b1,
                            float b2, float eps, float decay, float step, float bc2_sqrt) {
  const float c1 = 1.0f - b1, c2 = 1.0f - b2;
  GRID_STRIDE(i, n) {
    const float gi = g[i];
    const float mi = __fadd_rn(__fmul_rn(b1, m[i]), __fmul_rn(c1, gi));
    const float vi = __fadd_rn(__fmul_rn(b2, v[i]), __fmul_rn(__fmul_rn(c2, gi), gi));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
    p[i] = __fsub_rn(__fmul_rn(p[i], decay), __fdiv_rn(__fmul_rn(step, mi), denom));
    m[i] = mi;
    v[i] = vi;
  }
}

__global__ void poison_kernel(float* g) { g[0] = INFINITY; }

template <class T>
class CudaEngine final : public Engine {
 public:
  CudaEngine(const Shape& s, Precision p, std::uint64_t seed, int max_batch, int device)
      : s_(s), p_(p), seed_(seed), max_batch_(max_batch), dev_(device), n_(s.num_params()) {}

  ~CudaEngine() override {  // best effort, errors ignored
    cudaSetDevice(dev_);
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    for (const Events& step : pending_) {
      for (cudaEvent_t e : step) cudaEventDestroy(e);
    }
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
    if (blas_ != nullptr) cublasDestroy(blas_);
    for (void* ptr : allocs_) cudaFree(ptr);
    if (host_ != nullptr) cudaFreeHost(host_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status init() {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(dev_));
    cudaDeviceProp prop;
    CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, dev_));
    name_ = prop.name;
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CUDA_RETURN_IF_ERROR(cublasCreate(&blas_));
    CUDA_RETURN_IF_ERROR(cublasSetStream(blas_, stream_));
    // Split-K partial sums in fp32 too, never in the 16-bit output type (an extra rounding the
    // CPU reference does not have).
    CUDA_RETURN_IF_ERROR(cublasSetMathMode(
        blas_, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                         CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
    const std::size_t B = static_cast<std::size_t>(max_batch_);
    for (float** f : {&params_, &m_, &v_}) CUDA_RETURN_IF_ERROR(alloc(f, n_));
    CUDA_RETURN_IF_ERROR(alloc(&grad_, n_ + 1));
    CUDA_RETURN_IF_ERROR(alloc(&wq_, n_));
    CUDA_RETURN_IF_ERROR(alloc(&x_, B * s_.in));
    CUDA_RETURN_IF_ERROR(alloc(&h_, B * s_.teacher_hidden));
    CUDA_RETURN_IF_ERROR(alloc(&y_, B * s_.out));
    CUDA_RETURN_IF_ERROR(alloc(&t1_, static_cast<std::size_t>(s_.in) * s_.teacher_hidden));
    CUDA_RETURN_IF_ERROR(alloc(&t2_, static_cast<std::size_t>(s_.teacher_hidden) * s_.out));
    a_.assign(s_.layers(), nullptr);
    z_.assign(s_.layers(), nullptr);
    for (int l = 0; l < s_.layers(); ++l) {
      CUDA_RETURN_IF_ERROR(alloc(&a_[l], B * s_.fan_in(l)));
      CUDA_RETURN_IF_ERROR(alloc(&z_[l], B * s_.fan_out(l)));
    }
    const std::size_t dz_size = B * std::max(s_.hidden, s_.out);
    CUDA_RETURN_IF_ERROR(alloc(&dz_, dz_size));
    CUDA_RETURN_IF_ERROR(alloc(&dz_prev_, dz_size));
    CUDA_RETURN_IF_ERROR(alloc(&flag_, 1));
    CUDA_RETURN_IF_ERROR(cudaMallocHost(&host_, 2 * sizeof(float)));
    const std::vector<float> t1 = teacher_w1(s_, seed_), t2 = teacher_w2(s_, seed_);
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(t1_, t1.data(), t1.size() * sizeof(float),
                                         cudaMemcpyHostToDevice, stream_));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(t2_, t2.data(), t2.size() * sizeof(float),
                                         cudaMemcpyHostToDevice, stream_));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  std::string device() const override {
    return "cuda:" + std::to_string(dev_) + " (" + name_ + ")";
  }
  std::size_t num_params() const override { return n_; }

  void set_state(const std::vector<float>& params, const std::vector<float>& m,
                 const std::vector<float>& v) override {
    if (params.size() != n_ || m.size() != n_ || v.size() != n_) {
      std::fprintf(stderr, "engine_cuda: set_state: expected %zu values each\n", n_);
      std::abort();
    }
    CUDA_CHECK(cudaSetDevice(dev_));
    const std::size_t bytes = n_ * sizeof(float);
    CUDA_CHECK(cudaMemcpyAsync(params_, params.data(), bytes, cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaMemcpyAsync(m_, m.data(), bytes, cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaMemcpyAsync(v_, v.data(), bytes, cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void get_state(std::vector<float>& params, std::vector<float>& m,
                 std::vector<float>& v) override {
    params.resize(n_);
    m.resize(n_);
    v.resize(n_);
    CUDA_CHECK(cudaSetDevice(dev_));
    const std::size_t bytes = n_ * sizeof(float);
    CUDA_CHECK(cudaMemcpyAsync(params.data(), params_, bytes, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaMemcpyAsync(m.data(), m_, bytes, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaMemcpyAsync(v.data(), v_, bytes, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  void forward_backward(std::int64_t first, int count, float loss_scale) override;
  float* grad_buffer() override { return grad_; }
  void* stream() override { return stream_; }

  float loss_slot() override {
    CUDA_CHECK(cudaSetDevice(dev_));
    CUDA_CHECK(cudaMemcpyAsync(host_, grad_ + n_, sizeof(float), cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return host_[0];
  }

  bool unscale_and_check(float inv_scale) override {
    CUDA_CHECK(cudaSetDevice(dev_));
    CUDA_CHECK(cudaMemsetAsync(flag_, 0, sizeof(int), stream_));
    unscale_kernel<<<blocks_for(n_), kThreads, 0, stream_>>>(grad_, n_, inv_scale, flag_);
    LAUNCH_CHECK();
    int* host_flag = reinterpret_cast<int*>(host_ + 1);
    CUDA_CHECK(cudaMemcpyAsync(host_flag, flag_, sizeof(int), cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return *host_flag == 0;
  }

  void adam_step(const AdamConfig& c, float lr, std::int64_t t) override {
    // On the host in float, exactly as engine_cpu.cc.
    const float bc1 = 1.0f - std::pow(c.beta1, static_cast<float>(t));
    const float bc2_sqrt = std::sqrt(1.0f - std::pow(c.beta2, static_cast<float>(t)));
    const float step = lr / bc1;
    const float decay = 1.0f - lr * c.weight_decay;
    CUDA_CHECK(cudaSetDevice(dev_));
    adam_kernel<<<blocks_for(n_), kThreads, 0, stream_>>>(params_, m_, v_, grad_, n_, c.beta1,
                                                         c.beta2, c.eps, decay, step, bc2_sqrt);
    LAUNCH_CHECK();
  }

  void poison_gradient() override {
    CUDA_CHECK(cudaSetDevice(dev_));
    poison_kernel<<<1, 1, 0, stream_>>>(grad_);
    LAUNCH_CHECK();
  }

  std::string perf_summary() override {
    CUDA_CHECK(cudaSetDevice(dev_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    harvest_timings(/*wait=*/true);
    // The first step (cuBLAS's kernel selection and loading) only counts when it is alone.
    const bool warm_only = steps_timed_ == 1;
    const double ms = warm_only ? warm_ms_ : ms_, flops = warm_only ? warm_flops_ : flops_;
    if (steps_timed_ == 0 || ms <= 0) return {};
    char buf[160];
    std::snprintf(buf, sizeof buf,
                  "student GEMMs %.1f TFLOP/s over %d step(s) (%s in, fp32 accumulate)",
                  flops / (ms * 1e-3) / 1e12, warm_only ? 1 : steps_timed_ - 1, precision_name(p_));
    return buf;
  }

 private:
  using Events = std::vector<cudaEvent_t>;  // one step's: (start, stop) around each student GEMM

  template <class U>
  cudaError_t alloc(U** ptr, std::size_t count) {
    void* raw = nullptr;
    cudaError_t e = cudaMalloc(&raw, std::max<std::size_t>(count, 1) * sizeof(U));
    if (e != cudaSuccess) return e;
    allocs_.push_back(raw);
    *ptr = static_cast<U*>(raw);
    return cudaMemsetAsync(raw, 0, std::max<std::size_t>(count, 1) * sizeof(U), stream_);
  }

  // C = op(A) op(B), column-major (see the header comment), fp32 accumulation, beta = 0.
  void gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void* a,
            cudaDataType at, int lda, const void* b, cudaDataType bt, int ldb, void* c,
            cudaDataType ct, int ldc) {
    const float one = 1.0f, zero = 0.0f;
    CUDA_CHECK(cublasGemmEx(blas_, ta, tb, m, n, k, &one, a, at, lda, b, bt, ldb, &zero, c, ct, ldc,
                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }

  // A student GEMM, between two events recorded into `step` for perf_summary().
  void timed_gemm(Events& step, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                  const void* a, cudaDataType at, int lda, const void* b, cudaDataType bt, int ldb,
                  void* c, cudaDataType ct, int ldc) {
    step.push_back(record_event());
    gemm(ta, tb, m, n, k, a, at, lda, b, bt, ldb, c, ct, ldc);
    step.push_back(record_event());
  }

  cudaEvent_t record_event() {
    cudaEvent_t e;
    if (free_events_.empty()) {
      CUDA_CHECK(cudaEventCreate(&e));
    } else {
      e = free_events_.back();
      free_events_.pop_back();
    }
    CUDA_CHECK(cudaEventRecord(e, stream_));
    return e;
  }

  // Adds up the GEMM times of finished steps (all of them when wait) and recycles their events.
  // The stream runs in order, so the first unfinished step ends the scan.
  void harvest_timings(bool wait) {
    std::size_t done = 0;
    for (; done < pending_.size(); ++done) {
      const Events& step = pending_[done];
      if (wait) {
        CUDA_CHECK(cudaEventSynchronize(step.back()));
      } else {
        const cudaError_t e = cudaEventQuery(step.back());
        if (e == cudaErrorNotReady) {
          (void)cudaGetLastError();  // not an error; make sure no later check sees it
          break;
        }
        CUDA_CHECK(e);
      }
      double ms = 0;
      for (std::size_t i = 0; i + 1 < step.size(); i += 2) {
        float t = 0;
        CUDA_CHECK(cudaEventElapsedTime(&t, step[i], step[i + 1]));
        ms += t;
      }
      (harvested_++ == 0 ? warm_ms_ : ms_) += ms;
      free_events_.insert(free_events_.end(), step.begin(), step.end());
    }
    pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(done));
  }

  const Shape s_;
  const Precision p_;
  const std::uint64_t seed_;
  const int max_batch_, dev_;
  const std::size_t n_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  std::vector<void*> allocs_;
  float *params_ = nullptr, *m_ = nullptr, *v_ = nullptr, *grad_ = nullptr;
  float *x_ = nullptr, *h_ = nullptr, *y_ = nullptr, *t1_ = nullptr, *t2_ = nullptr;
  T *wq_ = nullptr, *dz_ = nullptr, *dz_prev_ = nullptr;
  std::vector<T*> a_, z_;  // a_[l]: layer l's input; z_[l]: its pre-activation
  int* flag_ = nullptr;
  float* host_ = nullptr;  // pinned: [0] the loss, [1] the non-finite flag (as int)
  std::vector<Events> pending_;  // steps whose GEMM times are not yet added up
  Events free_events_;
  int steps_timed_ = 0, harvested_ = 0;
  double ms_ = 0, flops_ = 0, warm_ms_ = 0, warm_flops_ = 0;
};

template <class T>
void CudaEngine<T>::forward_backward(std::int64_t first, int count, float loss_scale) {
  if (count < 0 || count > max_batch_) {
    std::fprintf(stderr, "engine_cuda: forward_backward: count %d outside [0, %d]\n", count,
                 max_batch_);
    std::abort();
  }
  CUDA_CHECK(cudaSetDevice(dev_));
  harvest_timings(/*wait=*/false);
  const int L = s_.layers(), th = s_.teacher_hidden, in = s_.in, out = s_.out;
  const cudaDataType f32 = CUDA_R_32F, tt = Num<T>::kType;
  const std::size_t outs = static_cast<std::size_t>(count) * out;

  // The batch, and its targets from the teacher in fp32 on the exact inputs.
  inputs_kernel<T><<<blocks_for(static_cast<std::size_t>(count) * in), kThreads, 0, stream_>>>(
      seed_, first, count, in, x_, a_[0]);
  LAUNCH_CHECK();
  gemm(CUBLAS_OP_N, CUBLAS_OP_N, th, count, in, t1_, f32, th, x_, f32, in, h_, f32, th);
  tanh_kernel<<<blocks_for(static_cast<std::size_t>(count) * th), kThreads, 0, stream_>>>(
      h_, static_cast<std::size_t>(count) * th);
  LAUNCH_CHECK();
  gemm(CUBLAS_OP_N, CUBLAS_OP_N, out, count, th, t2_, f32, out, h_, f32, th, y_, f32, out);
  cast_kernel<T><<<blocks_for(n_), kThreads, 0, stream_>>>(params_, wq_, n_);
  LAUNCH_CHECK();

  Events step;
  step.reserve(2 * (3 * L - 1));
  double flops = 0;
  // Forward: z = q(A Wq) (row-major [count x fo] = [count x fi][fi x fo]); z = q(z + b);
  // next A = q(gelu(z)).
  for (int l = 0; l < L; ++l) {
    const int fi = s_.fan_in(l), fo = s_.fan_out(l);
    timed_gemm(step, CUBLAS_OP_N, CUBLAS_OP_N, fo, count, fi, wq_ + s_.w_offset(l), tt, fo, a_[l],
               tt, fi, z_[l], tt, fo);
    flops += 2.0 * count * fi * fo;
    bias_act_kernel<T><<<blocks_for(static_cast<std::size_t>(count) * fo), kThreads, 0, stream_>>>(
        z_[l], l + 1 < L ? a_[l + 1] : nullptr, params_ + s_.b_offset(l), count, fo);
    LAUNCH_CHECK();
  }

  // Loss and its gradient: dz = q(scale * 2 (pred - y) / (count * out)).
  const float k = 2.0f * loss_scale / static_cast<float>(outs);
  loss_kernel<T><<<1, kThreads, 0, stream_>>>(z_[L - 1], y_, outs, k, dz_, grad_ + n_);
  LAUNCH_CHECK();

  // Backward: dW = A^T dz (fp32, straight into the buffer), db = sum dz, dA = q(dz Wq^T),
  // dz_prev = q(dA * gelu'(z_prev)).
  for (int l = L - 1; l >= 0; --l) {
    const int fi = s_.fan_in(l), fo = s_.fan_out(l);
    // Row-major dW [fi x fo] = column-major [fo x fi] = dz^T A: dz is column-major
    // [fo x count] (ld fo), A is column-major [fi x count] (ld fi), transposed.
    timed_gemm(step, CUBLAS_OP_N, CUBLAS_OP_T, fo, fi, count, dz_, tt, fo, a_[l], tt, fi,
               grad_ + s_.w_offset(l), f32, fo);
    flops += 2.0 * count * fi * fo;
    bias_grad_kernel<T><<<blocks_for(fo), kThreads, 0, stream_>>>(dz_, count, fo,
                                                                  grad_ + s_.b_offset(l));
    LAUNCH_CHECK();
    if (l == 0) break;
    // Row-major dA [count x fi] = column-major [fi x count] = Wq dz^T: Wq is column-major
    // [fo x fi] (ld fo), transposed; dz is column-major [fo x count] (ld fo).
    timed_gemm(step, CUBLAS_OP_T, CUBLAS_OP_N, fi, count, fo, wq_ + s_.w_offset(l), tt, fo, dz_,
               tt, fo, dz_prev_, tt, fi);
    flops += 2.0 * count * fi * fo;
    const std::size_t n = static_cast<std::size_t>(count) * fi;
    gelu_back_kernel<T><<<blocks_for(n), kThreads, 0, stream_>>>(dz_prev_, z_[l - 1], n);
    LAUNCH_CHECK();
    std::swap(dz_, dz_prev_);
  }
  pending_.push_back(std::move(step));
  (steps_timed_++ == 0 ? warm_flops_ : flops_) += flops;
}

template <class T>
absl::StatusOr<std::unique_ptr<Engine>> make(const Shape& shape, Precision p, std::uint64_t seed,
                                             int max_batch, int device) {
  auto engine = std::make_unique<CudaEngine<T>>(shape, p, seed, max_batch, device);
  if (absl::Status st = engine->init(); !st.ok()) return st;
  return std::unique_ptr<Engine>(std::move(engine));
}

}  // namespace

bool cuda_available() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  (void)cudaGetLastError();  // leave no error behind when there is no driver or device
  return ok;
}

absl::StatusOr<std::unique_ptr<Engine>> make_cuda_engine(const Shape& shape, Precision p,
                                                         std::uint64_t seed, int max_batch,
                                                         int device) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n <= 0) {
    (void)cudaGetLastError();
    return absl::UnavailableError("no CUDA device is visible");
  }
  if (device < 0 || device >= n) {
    return absl::InvalidArgumentError("CUDA device " + std::to_string(device) + " out of range (" +
                                      std::to_string(n) + " visible)");
  }
  if (max_batch <= 0) return absl::InvalidArgumentError("max_batch must be positive");
  switch (p) {
    case Precision::kF32: return make<float>(shape, p, seed, max_batch, device);
    case Precision::kBF16: return make<__nv_bfloat16>(shape, p, seed, max_batch, device);
    case Precision::kF16: return make<__half>(shape, p, seed, max_batch, device);
  }
  return absl::InvalidArgumentError("unknown precision");
}

}  // namespace muster::train
