// CUDA kernels of the vocab-parallel embedding: masked row gather (forward) and the two
// scatter-add forms of the weight gradient (fp32 atomics, or a deterministic segmented sum
// over ids sorted by the caller). See kernels.h for the contracts.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"

namespace tpx {
namespace cuda {
namespace {

using detail::from_f32;
using detail::launch_kernel;
using detail::to_f32;

constexpr int kThreads = 256;
constexpr unsigned kMaxGridX = 1u << 20;  // grid-stride loops beyond this many blocks

// Block shape for row-parallel work on rows of `units` elements: threadIdx.x walks a row,
// threadIdx.y picks the row, tx * ty = kThreads.
dim3 row_block(int64_t units) {
  int tx = 32;
  while (tx < kThreads && tx < units) tx *= 2;
  return dim3(tx, kThreads / tx);
}

unsigned row_grid(int64_t count, unsigned rows_per_block) {
  const int64_t blocks = (count + rows_per_block - 1) / rows_per_block;
  return static_cast<unsigned>(blocks < kMaxGridX ? blocks : kMaxGridX);
}

// The forward copies rows in units of U (16, 8, 4 or 2 bytes), the widest that the row size,
// the row stride and both base pointers allow.
template <typename U>
__global__ void __launch_bounds__(kThreads)
    embedding_forward_kernel(const U* __restrict__ weight, int64_t weight_row_units,
                             int64_t num_local, int64_t row_units,
                             const int64_t* __restrict__ ids, int64_t count,
                             int64_t vocab_start, U* __restrict__ out) {
  for (int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; n < count;
       n += static_cast<int64_t>(gridDim.x) * blockDim.y) {
    const int64_t local = ids[n] - vocab_start;
    U* dst = out + n * row_units;
    if (local >= 0 && local < num_local) {
      const U* src = weight + local * weight_row_units;
      for (int64_t c = threadIdx.x; c < row_units; c += blockDim.x) dst[c] = src[c];
    } else {
      for (int64_t c = threadIdx.x; c < row_units; c += blockDim.x) dst[c] = U{};
    }
  }
}

template <typename U>
cudaError_t launch_forward(const void* weight, int64_t weight_row_bytes, int64_t num_local,
                           int64_t row_bytes, const int64_t* ids, int64_t count,
                           int64_t vocab_start, void* out, cudaStream_t stream) {
  const int64_t row_units = row_bytes / static_cast<int64_t>(sizeof(U));
  const dim3 block = row_block(row_units);
  launch_kernel(
      embedding_forward_kernel<U>, dim3(row_grid(count, block.y)), block, 0, stream,
      static_cast<const U*>(weight), weight_row_bytes / static_cast<int64_t>(sizeof(U)),
      num_local, row_units, ids, count, vocab_start, static_cast<U*>(out));
  return cudaGetLastError();
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    embedding_backward_atomic_kernel(const T* __restrict__ grad, int64_t grad_row_stride,
                                     int64_t count, int64_t dim,
                                     const int64_t* __restrict__ ids, int64_t vocab_start,
                                     int64_t num_local, int64_t padding_idx,
                                     float* __restrict__ grad_weight) {
  for (int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; n < count;
       n += static_cast<int64_t>(gridDim.x) * blockDim.y) {
    const int64_t local = ids[n] - vocab_start;
    if (local < 0 || local >= num_local || local == padding_idx) continue;
    const T* src = grad + n * grad_row_stride;
    float* dst = grad_weight + local * dim;
    for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) atomicAdd(dst + c, to_f32(src[c]));
  }
}

// The deterministic backward. Sorted positions are cut into chunks of kRunSplit; a run of
// equal rows that crosses the end of a chunk leaves, in a first kernel, one fp32 partial sum
// per chunk it covers there (one warp per chunk, positions in order). A second kernel gives
// every run to one warp, the one of its last position, which adds the run's partials in chunk
// order and then its own positions in order. No run keeps a warp busy for more than
// kRunSplit rows plus one partial per chunk, and every sum has a fixed order: the result
// does not depend on the scheduling. grid.y spreads the columns, kColsPerWarp per warp pass.
constexpr int kSortedWarps = 8;
constexpr int kColsPerLane = 4;
constexpr int kColsPerWarp = 32 * kColsPerLane;
constexpr int64_t kRunSplit = 128;
constexpr unsigned kMaxGridY = 65535;

// acc[u] += grad[perm[j], c0 + u * 32 + lane] for j in [first, last], in order.
template <typename T>
__device__ __forceinline__ void add_positions(float (&acc)[kColsPerLane], const T* grad,
                                              int64_t grad_row_stride, const int64_t* perm,
                                              int64_t first, int64_t last, int64_t c0,
                                              int64_t dim) {
  for (int64_t j = first; j <= last; ++j) {
    const T* src = grad + perm[j] * grad_row_stride;
#pragma unroll
    for (int u = 0; u < kColsPerLane; ++u) {
      const int64_t c = c0 + u * 32 + threadIdx.x;
      if (c < dim) acc[u] += to_f32(src[c]);
    }
  }
}

// First position of the run of `row` that ends at `last`, not looking before `floor`.
__device__ __forceinline__ int64_t run_first(const int64_t* sorted_rows, int64_t row,
                                             int64_t last, int64_t floor) {
  int64_t s = last;
  while (s > floor && sorted_rows[s - 1] == row) --s;
  return s;
}

template <typename T>
__global__ void __launch_bounds__(32 * kSortedWarps)
    embedding_backward_partial_kernel(const T* __restrict__ grad, int64_t grad_row_stride,
                                      int64_t dim,
                                      const int64_t* __restrict__ sorted_rows,
                                      const int64_t* __restrict__ perm, int64_t num_local,
                                      int64_t chunks, float* __restrict__ partial) {
  for (int64_t chunk = static_cast<int64_t>(blockIdx.x) * kSortedWarps + threadIdx.y;
       chunk < chunks; chunk += static_cast<int64_t>(gridDim.x) * kSortedWarps) {
    // chunk < chunks = (count - 1) / kRunSplit, so last + 1 < count.
    const int64_t last = (chunk + 1) * kRunSplit - 1;
    const int64_t row = sorted_rows[last];
    if (row < 0 || row >= num_local) continue;       // not held / padding
    if (sorted_rows[last + 1] != row) continue;      // no run crosses this chunk's end
    const int64_t first = run_first(sorted_rows, row, last, chunk * kRunSplit);
    for (int64_t c0 = static_cast<int64_t>(blockIdx.y) * kColsPerWarp; c0 < dim;
         c0 += static_cast<int64_t>(gridDim.y) * kColsPerWarp) {
      float acc[kColsPerLane];
#pragma unroll
      for (int u = 0; u < kColsPerLane; ++u) acc[u] = 0.f;
      add_positions(acc, grad, grad_row_stride, perm, first, last, c0, dim);
      float* dst = partial + chunk * dim;
#pragma unroll
      for (int u = 0; u < kColsPerLane; ++u) {
        const int64_t c = c0 + u * 32 + threadIdx.x;
        if (c < dim) dst[c] = acc[u];
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(32 * kSortedWarps)
    embedding_backward_sorted_kernel(const T* __restrict__ grad, int64_t grad_row_stride,
                                     int64_t count, int64_t dim,
                                     const int64_t* __restrict__ sorted_rows,
                                     const int64_t* __restrict__ perm, int64_t num_local,
                                     const float* __restrict__ partial,
                                     T* __restrict__ grad_weight) {
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * kSortedWarps + threadIdx.y; k < count;
       k += static_cast<int64_t>(gridDim.x) * kSortedWarps) {
    const int64_t row = sorted_rows[k];
    if (row < 0 || row >= num_local) continue;              // not held / padding
    if (k + 1 < count && sorted_rows[k + 1] == row) continue;  // not the last of its run
    const int64_t chunk = k / kRunSplit;
    const int64_t first = run_first(sorted_rows, row, k, chunk * kRunSplit);
    // Chunks before this one that the run covers, each with a partial sum.
    int64_t first_chunk = chunk;
    if (first == chunk * kRunSplit && first > 0 && sorted_rows[first - 1] == row) {
      first_chunk = chunk - 1;
      while (first_chunk > 0 && sorted_rows[first_chunk * kRunSplit - 1] == row) --first_chunk;
    }
    for (int64_t c0 = static_cast<int64_t>(blockIdx.y) * kColsPerWarp; c0 < dim;
         c0 += static_cast<int64_t>(gridDim.y) * kColsPerWarp) {
      float acc[kColsPerLane];
#pragma unroll
      for (int u = 0; u < kColsPerLane; ++u) acc[u] = 0.f;
      for (int64_t q = first_chunk; q < chunk; ++q) {
#pragma unroll
        for (int u = 0; u < kColsPerLane; ++u) {
          const int64_t c = c0 + u * 32 + threadIdx.x;
          if (c < dim) acc[u] += partial[q * dim + c];
        }
      }
      add_positions(acc, grad, grad_row_stride, perm, first, k, c0, dim);
      T* dst = grad_weight + row * dim;
#pragma unroll
      for (int u = 0; u < kColsPerLane; ++u) {
        const int64_t c = c0 + u * 32 + threadIdx.x;
        if (c < dim) dst[c] = from_f32<T>(acc[u]);
      }
    }
  }
}

}  // namespace

cudaError_t embedding_forward(const void* weight, int64_t weight_row_stride, DType dtype,
                              int64_t num_local, int64_t dim, const int64_t* ids, int64_t count,
                              int64_t vocab_start, void* out, cudaStream_t stream) {
  if (count == 0 || dim == 0) return cudaSuccess;
  if (count < 0 || dim < 0 || num_local < 0) return cudaErrorInvalidValue;
  int64_t elem = 0;
  cudaError_t err = dispatch_dtype(dtype, [&](auto tag) { elem = sizeof(tag); });
  if (err != cudaSuccess) return err;
  const int64_t row_bytes = dim * elem, stride_bytes = weight_row_stride * elem;
  const auto fits = [&](int64_t u) {
    return row_bytes % u == 0 && stride_bytes % u == 0 &&
           reinterpret_cast<uintptr_t>(weight) % u == 0 &&
           reinterpret_cast<uintptr_t>(out) % u == 0;
  };
  if (fits(16))
    return launch_forward<uint4>(weight, stride_bytes, num_local, row_bytes, ids, count,
                                 vocab_start, out, stream);
  if (fits(8))
    return launch_forward<uint2>(weight, stride_bytes, num_local, row_bytes, ids, count,
                                 vocab_start, out, stream);
  if (fits(4))
    return launch_forward<uint32_t>(weight, stride_bytes, num_local, row_bytes, ids, count,
                                    vocab_start, out, stream);
  return launch_forward<uint16_t>(weight, stride_bytes, num_local, row_bytes, ids, count,
                                  vocab_start, out, stream);
}

cudaError_t embedding_backward_atomic(const void* grad, int64_t grad_row_stride, DType dtype,
                                      int64_t count, int64_t dim, const int64_t* ids,
                                      int64_t vocab_start, int64_t num_local,
                                      int64_t padding_idx, float* grad_weight,
                                      cudaStream_t stream) {
  if (count == 0 || dim == 0 || num_local == 0) return cudaSuccess;
  if (count < 0 || dim < 0 || num_local < 0) return cudaErrorInvalidValue;
  const dim3 block = row_block(dim);
  const unsigned grid = row_grid(count, block.y);
  cudaError_t err = dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_kernel(
        embedding_backward_atomic_kernel<T>, dim3(grid), block, 0, stream,
        static_cast<const T*>(grad), grad_row_stride, count, dim, ids, vocab_start, num_local,
        padding_idx, grad_weight);
  });
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

int64_t embedding_backward_sorted_workspace(int64_t count, int64_t dim) {
  if (count <= kRunSplit || dim <= 0) return 0;
  return ((count - 1) / kRunSplit) * dim;  // one partial row per chunk but the last
}

cudaError_t embedding_backward_sorted(const void* grad, int64_t grad_row_stride, DType dtype,
                                      int64_t count, int64_t dim, const int64_t* sorted_rows,
                                      const int64_t* perm, int64_t num_local,
                                      void* grad_weight, float* workspace,
                                      cudaStream_t stream) {
  if (count == 0 || dim == 0 || num_local == 0) return cudaSuccess;
  if (count < 0 || dim < 0 || num_local < 0) return cudaErrorInvalidValue;
  const int64_t chunks_with_partial = (count - 1) / kRunSplit;
  if (chunks_with_partial > 0 && workspace == nullptr) return cudaErrorInvalidValue;
  const int64_t col_blocks = (dim + kColsPerWarp - 1) / kColsPerWarp;
  const unsigned grid_y = static_cast<unsigned>(col_blocks < kMaxGridY ? col_blocks : kMaxGridY);
  const dim3 block(32, kSortedWarps);
  cudaError_t err = dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (chunks_with_partial > 0) {
      launch_kernel(embedding_backward_partial_kernel<T>,
                    dim3(row_grid(chunks_with_partial, kSortedWarps), grid_y), block, 0, stream,
                    static_cast<const T*>(grad), grad_row_stride, dim, sorted_rows, perm,
                    num_local, chunks_with_partial, workspace);
    }
    launch_kernel(embedding_backward_sorted_kernel<T>,
                  dim3(row_grid(count, kSortedWarps), grid_y), block, 0, stream,
                  static_cast<const T*>(grad), grad_row_stride, count, dim, sorted_rows, perm,
                  num_local, static_cast<const float*>(workspace),
                  static_cast<T*>(grad_weight));
  });
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace tpx
