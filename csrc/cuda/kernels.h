// CUDA kernels of the vocab-parallel loss and embedding: plain C++ launchers.
//
// This header includes no torch header, so it can be used from the .cu files (compiled with
// bare nvcc) and from the torch-op layer alike. Every launcher takes raw device pointers,
// sizes in elements, a DType of our own and a stream; it only enqueues work and returns the
// launch status (cudaGetLastError()), never synchronising.
//
// Layout conventions: a "row stride" is in elements; the innermost dimension is always dense
// (stride 1). Pointers must be aligned to their element size; the kernels use 16-byte loads
// and stores where the addresses allow it and fall back to narrower accesses elsewhere.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace tpx {
namespace cuda {

enum class DType : int {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
};

// Column order of the per-row cross-entropy statistics, [rows, kCeStats] fp32.
enum CeStat : int {
  kCeMax = 0,         // max_j x_j of the shard's row (-inf for an empty shard)
  kCeSumExp = 1,      // sum_j exp(x_j - max)
  kCeTarget = 2,      // x_t if this shard holds the row's target and it is not ignored, else 0
  kCeSumLogits = 3,   // sum_j x_j (written only when asked for, else 0)
  kCeStats = 4,
};

// Per-row statistics of a shard of logits [rows, width] (row stride `row_stride`), in one
// pass over each row with an online softmax and fp32 accumulation. `target` holds `rows`
// global ids; a row's target is held when 0 <= target - vocab_start < width and
// target != ignore_index. `stats` is [rows, kCeStats] fp32, contiguous; every entry is
// written.
cudaError_t ce_forward_stats(const void* logits, DType dtype, int64_t rows, int64_t width,
                             int64_t row_stride, const int64_t* target, int64_t vocab_start,
                             int64_t ignore_index, bool with_sum_logits, float* stats,
                             cudaStream_t stream);

// Gradient of the per-row loss with respect to a shard of logits:
//   grad[i, j] = g_i * (exp(x_ij - lse_i) - eps / vocab_size) - (1 - eps) * g_i * [j == t_i]
// where g_i = grad_loss[i] (0 for rows whose target is ignore_index) and [j == t_i] is 1 only
// at the local column of a held target. `grad` has the dtype of `logits` and may be the same
// memory (grad == logits with equal row strides): each element is read before it is written
// by the same thread. grad_loss and lse are fp32 [rows], contiguous.
cudaError_t ce_backward(const void* logits, int64_t logits_row_stride, void* grad,
                        int64_t grad_row_stride, DType dtype, int64_t rows, int64_t width,
                        const int64_t* target, const float* lse, const float* grad_loss,
                        int64_t vocab_start, int64_t vocab_size, int64_t ignore_index,
                        float label_smoothing, cudaStream_t stream);

// out[n, :] = weight[ids[n] - vocab_start, :] when 0 <= ids[n] - vocab_start < num_local,
// else zeros. weight is [num_local, dim] with row stride `weight_row_stride`; out is
// [count, dim], contiguous, of the same dtype.
cudaError_t embedding_forward(const void* weight, int64_t weight_row_stride, DType dtype,
                              int64_t num_local, int64_t dim, const int64_t* ids, int64_t count,
                              int64_t vocab_start, void* out, cudaStream_t stream);

// grad_weight[ids[n] - vocab_start, :] += grad[n, :] with fp32 atomics, for the ids this shard
// holds, except the local row padding_idx (-1 for none). grad is [count, dim] with row
// stride `grad_row_stride`; grad_weight is fp32 [num_local, dim], contiguous, and must be
// zeroed by the caller. The summation order, hence the rounding, varies from run to run.
cudaError_t embedding_backward_atomic(const void* grad, int64_t grad_row_stride, DType dtype,
                                      int64_t count, int64_t dim, const int64_t* ids,
                                      int64_t vocab_start, int64_t num_local,
                                      int64_t padding_idx, float* grad_weight,
                                      cudaStream_t stream);

// Deterministic form of the same sum. sorted_rows[k] (k < count) are local row indices sorted
// ascending, with num_local (or any value >= num_local) standing for "no gradient" (ids not
// held, padding); perm[k] is the row of `grad` that sorted_rows[k] came from. Each distinct
// row is summed in fp32 in a fixed order (the order of perm within fixed-size chunks of the
// sorted positions, then the chunks' partial sums in order, so that a long run of one row is
// spread over many warps) and written once in `dtype` into grad_weight [num_local, dim]
// (contiguous); rows that receive nothing are left untouched, so the caller zeroes
// grad_weight. The result is bitwise reproducible. `workspace` is fp32 scratch of
// embedding_backward_sorted_workspace(count, dim) elements (may be null when that is 0).
int64_t embedding_backward_sorted_workspace(int64_t count, int64_t dim);
cudaError_t embedding_backward_sorted(const void* grad, int64_t grad_row_stride, DType dtype,
                                      int64_t count, int64_t dim, const int64_t* sorted_rows,
                                      const int64_t* perm, int64_t num_local,
                                      void* grad_weight, float* workspace,
                                      cudaStream_t stream);

}  // namespace cuda
}  // namespace tpx
