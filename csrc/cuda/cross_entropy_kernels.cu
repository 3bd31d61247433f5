// CUDA kernels of the vocab-parallel cross-entropy: per-row statistics of a logits shard
// (forward) and the fused gradient (backward). See kernels.h for the contracts.
//
// Rows are mapped to threads in one of two shapes: a warp per row (8 rows per block) for
// narrow shards, where a block per row would leave most threads idle, and a 256-thread block
// per row for wide ones. Each row is split into a scalar head up to the first 16-byte
// boundary, a body of 16-byte vectors and a scalar tail, so any row stride and any shard
// width get vector loads for the bulk of the row. All arithmetic is fp32.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"

namespace tpx {
namespace cuda {
namespace {

using detail::from_f32;
using detail::head_elems;
using detail::launch_kernel;
using detail::load_vec;
using detail::store_vec;
using detail::to_f32;
using detail::Vec;

constexpr int kWideThreads = 256;   // threads per row, block-per-row shape
constexpr int kNarrowRows = 8;      // rows per block, warp-per-row shape
constexpr int64_t kNarrowMaxWidth = 2048;

// Online softmax state of a set of values: m = their max, s = sum exp(x - m). An empty set
// (or one of -inf only) is (-inf, 0).
struct Online {
  float m;
  float s;
};

// Adds n values to the state: the running sum is rescaled once per call when the max grows.
template <int N>
__device__ __forceinline__ void online_add(Online& st, const float (&x)[N]) {
  float mc = x[0];
#pragma unroll
  for (int k = 1; k < N; ++k) mc = fmaxf(mc, x[k]);
  const float mn = fmaxf(st.m, mc);
  if (mn == -INFINITY) {
    // Only -inf (contributes nothing) or NaN so far; fmaxf drops NaN, so keep it in s.
#pragma unroll
    for (int k = 0; k < N; ++k)
      if (isnan(x[k])) st.s = x[k];
    return;
  }
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < N; ++k) acc += expf(x[k] - mn);
  st.s = st.s * expf(st.m - mn) + acc;  // expf(-inf) = 0 for an empty state
  st.m = mn;
}

__device__ __forceinline__ void online_merge(Online& a, const Online& b) {
  const float mn = fmaxf(a.m, b.m);
  if (mn == -INFINITY) {  // both empty: 0 + 0 (or NaN carried along)
    a.s += b.s;
    return;
  }
  a.s = a.s * expf(a.m - mn) + b.s * expf(b.m - mn);
  a.m = mn;
}

template <int N>
__device__ __forceinline__ float sum_of(const float (&x)[N]) {
  float r = 0.f;
#pragma unroll
  for (int k = 0; k < N; ++k) r += x[k];
  return r;
}

// Reduces (state, sum) over the kRowThreads threads of a row; the row's thread 0 gets the
// result. `smem` holds kRowThreads / 32 entries per array (unused for a warp per row).
template <int kRowThreads>
__device__ __forceinline__ void reduce_row(Online& st, float& sum, float* smem_m, float* smem_s,
                                           float* smem_sum) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Online other{__shfl_xor_sync(0xffffffffu, st.m, o), __shfl_xor_sync(0xffffffffu, st.s, o)};
    online_merge(st, other);
    sum += __shfl_xor_sync(0xffffffffu, sum, o);
  }
  if constexpr (kRowThreads > 32) {
    constexpr int kWarps = kRowThreads / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
      smem_m[warp] = st.m;
      smem_s[warp] = st.s;
      smem_sum[warp] = sum;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < kWarps; ++w) {
        online_merge(st, Online{smem_m[w], smem_s[w]});
        sum += smem_sum[w];
      }
    }
  }
}

template <typename T, int kRowThreads, int kRowsPerBlock>
__global__ void __launch_bounds__(kRowThreads* kRowsPerBlock)
    ce_stats_kernel(const T* __restrict__ logits, int64_t rows, int64_t width,
                    int64_t row_stride, const int64_t* __restrict__ target, int64_t vocab_start,
                    int64_t ignore_index, bool with_sum, float* __restrict__ stats) {
  static_assert(kRowThreads == 32 || kRowsPerBlock == 1, "several rows per block: warp each");
  constexpr int kN = Vec<T>::kN;
  constexpr int kUnroll = 4;
  __shared__ float smem_m[kRowThreads / 32], smem_s[kRowThreads / 32],
      smem_sum[kRowThreads / 32];

  const int64_t row =
      static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kRowThreads;
  const int t = static_cast<int>(threadIdx.x % kRowThreads);
  if (kRowsPerBlock > 1 && row >= rows) return;  // a whole warp leaves; no block barrier
  const T* x = logits + row * row_stride;

  Online st{-INFINITY, 0.f};
  float sum = 0.f;
  const int64_t head = head_elems(x, width);
  const int64_t nvec = (width - head) / kN;
  const int64_t tail = head + nvec * kN;
  for (int64_t j = t; j < head; j += kRowThreads) {
    const float v[1] = {to_f32(x[j])};
    online_add(st, v);
    sum += v[0];
  }
  const T* body = x + head;
  int64_t i = t;
  for (; i + (kUnroll - 1) * kRowThreads < nvec; i += kUnroll * kRowThreads) {
    float v[kUnroll][kN];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) load_vec(body + (i + u * kRowThreads) * kN, v[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      online_add(st, v[u]);
      sum += sum_of(v[u]);
    }
  }
  for (; i < nvec; i += kRowThreads) {
    float v[kN];
    load_vec(body + i * kN, v);
    online_add(st, v);
    sum += sum_of(v);
  }
  for (int64_t j = tail + t; j < width; j += kRowThreads) {
    const float v[1] = {to_f32(x[j])};
    online_add(st, v);
    sum += v[0];
  }

  reduce_row<kRowThreads>(st, sum, smem_m, smem_s, smem_sum);
  if (t == 0) {
    const int64_t tg = target[row];
    const int64_t local = tg - vocab_start;
    const bool held = tg != ignore_index && local >= 0 && local < width;
    float* out = stats + row * kCeStats;
    out[kCeMax] = st.m;
    out[kCeSumExp] = st.s;
    out[kCeTarget] = held ? to_f32(x[local]) : 0.f;
    out[kCeSumLogits] = with_sum ? sum : 0.f;
  }
}

// One element of the gradient: g * (exp(x - lse) - eps / V), minus (1 - eps) g at the target.
__device__ __forceinline__ float grad_elem(float x, float lse, float g, float g_uniform,
                                           float g_target, bool is_target) {
  float v = expf(x - lse) * g - g_uniform;
  if (is_target) v += g_target;
  return v;
}

template <typename T, int kRowThreads, int kRowsPerBlock>
__global__ void __launch_bounds__(kRowThreads* kRowsPerBlock)
    ce_backward_kernel(const T* logits, int64_t logits_row_stride, T* grad,
                       int64_t grad_row_stride, int64_t rows, int64_t width,
                       const int64_t* __restrict__ target, const float* __restrict__ lse,
                       const float* __restrict__ grad_loss, int64_t vocab_start,
                       int64_t ignore_index, float uniform, float one_minus_eps) {
  // logits and grad may be the same memory: no __restrict__ on them.
  static_assert(kRowThreads == 32 || kRowsPerBlock == 1, "several rows per block: warp each");
  constexpr int kN = Vec<T>::kN;
  constexpr int kUnroll = 2;

  const int64_t row =
      static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kRowThreads;
  const int t = static_cast<int>(threadIdx.x % kRowThreads);
  if (row >= rows) return;
  const T* x = logits + row * logits_row_stride;
  T* y = grad + row * grad_row_stride;

  const int64_t tg = target[row];
  const bool ignored = tg == ignore_index;
  const float g = ignored ? 0.f : grad_loss[row];
  const float l = lse[row];
  const float g_uniform = g * uniform;             // g * eps / V
  const float g_target = -one_minus_eps * g;       // -(1 - eps) g
  const int64_t local = tg - vocab_start;
  const int64_t tcol = (!ignored && local >= 0 && local < width) ? local : -1;

  // Vector body only when input and output rows share their offset from a 16-byte boundary.
  const bool same_phase =
      ((reinterpret_cast<uintptr_t>(x) ^ reinterpret_cast<uintptr_t>(y)) & 15) == 0;
  const int64_t head = same_phase ? head_elems(x, width) : width;
  const int64_t nvec = (width - head) / kN;
  const int64_t tail = head + nvec * kN;

  for (int64_t j = t; j < head; j += kRowThreads)
    y[j] = from_f32<T>(grad_elem(to_f32(x[j]), l, g, g_uniform, g_target, j == tcol));
  const T* xb = x + head;
  T* yb = y + head;
  int64_t i = t;
  for (; i + (kUnroll - 1) * kRowThreads < nvec; i += kUnroll * kRowThreads) {
    float v[kUnroll][kN];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) load_vec(xb + (i + u * kRowThreads) * kN, v[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j0 = head + (i + u * kRowThreads) * kN;
#pragma unroll
      for (int k = 0; k < kN; ++k)
        v[u][k] = grad_elem(v[u][k], l, g, g_uniform, g_target, j0 + k == tcol);
      store_vec(yb + (i + u * kRowThreads) * kN, v[u]);
    }
  }
  for (; i < nvec; i += kRowThreads) {
    float v[kN];
    load_vec(xb + i * kN, v);
    const int64_t j0 = head + i * kN;
#pragma unroll
    for (int k = 0; k < kN; ++k) v[k] = grad_elem(v[k], l, g, g_uniform, g_target, j0 + k == tcol);
    store_vec(yb + i * kN, v);
  }
  for (int64_t j = tail + t; j < width; j += kRowThreads)
    y[j] = from_f32<T>(grad_elem(to_f32(x[j]), l, g, g_uniform, g_target, j == tcol));
}

bool grid_ok(int64_t blocks) { return blocks > 0 && blocks <= 0x7fffffff; }

}  // namespace

cudaError_t ce_forward_stats(const void* logits, DType dtype, int64_t rows, int64_t width,
                             int64_t row_stride, const int64_t* target, int64_t vocab_start,
                             int64_t ignore_index, bool with_sum_logits, float* stats,
                             cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (rows < 0 || width < 0) return cudaErrorInvalidValue;
  bool launched = false;
  cudaError_t err = dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(logits);
    if (width <= kNarrowMaxWidth) {
      const int64_t blocks = (rows + kNarrowRows - 1) / kNarrowRows;
      if (!grid_ok(blocks)) return;
      launch_kernel(ce_stats_kernel<T, 32, kNarrowRows>, static_cast<unsigned>(blocks),
                    32 * kNarrowRows, 0, stream, x, rows, width, row_stride, target, vocab_start,
                    ignore_index, with_sum_logits, stats);
    } else {
      if (!grid_ok(rows)) return;
      launch_kernel(ce_stats_kernel<T, kWideThreads, 1>, static_cast<unsigned>(rows), kWideThreads,
                    0, stream, x, rows, width, row_stride, target, vocab_start, ignore_index,
                    with_sum_logits, stats);
    }
    launched = true;
  });
  if (err != cudaSuccess) return err;
  if (!launched) return cudaErrorInvalidConfiguration;
  return cudaGetLastError();
}

cudaError_t ce_backward(const void* logits, int64_t logits_row_stride, void* grad,
                        int64_t grad_row_stride, DType dtype, int64_t rows, int64_t width,
                        const int64_t* target, const float* lse, const float* grad_loss,
                        int64_t vocab_start, int64_t vocab_size, int64_t ignore_index,
                        float label_smoothing, cudaStream_t stream) {
  if (rows == 0 || width == 0) return cudaSuccess;
  if (rows < 0 || width < 0 || vocab_size <= 0) return cudaErrorInvalidValue;
  // The same fp32 constants the ATen path uses: eps / V and (1 - eps), rounded once.
  const float uniform =
      static_cast<float>(static_cast<double>(label_smoothing) / static_cast<double>(vocab_size));
  const float one_minus_eps = static_cast<float>(1.0 - static_cast<double>(label_smoothing));
  bool launched = false;
  cudaError_t err = dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(logits);
    T* y = static_cast<T*>(grad);
    if (width <= kNarrowMaxWidth) {
      const int64_t blocks = (rows + kNarrowRows - 1) / kNarrowRows;
      if (!grid_ok(blocks)) return;
      launch_kernel(ce_backward_kernel<T, 32, kNarrowRows>, static_cast<unsigned>(blocks),
                    32 * kNarrowRows, 0, stream, x, logits_row_stride, y, grad_row_stride, rows,
                    width, target, lse, grad_loss, vocab_start, ignore_index, uniform,
                    one_minus_eps);
    } else {
      if (!grid_ok(rows)) return;
      launch_kernel(ce_backward_kernel<T, kWideThreads, 1>, static_cast<unsigned>(rows),
                    kWideThreads, 0, stream, x, logits_row_stride, y, grad_row_stride, rows,
                    width, target, lse, grad_loss, vocab_start, ignore_index, uniform,
                    one_minus_eps);
    }
    launched = true;
  });
  if (err != cudaSuccess) return err;
  if (!launched) return cudaErrorInvalidConfiguration;
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace tpx
