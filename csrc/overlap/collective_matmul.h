// The overlap engine: matrix products decomposed into pieces and interleaved with the
// asynchronous collectives of a c10d::ProcessGroup.
//
// One code path serves every backend: the GEMMs go through ATen (MKL/OpenBLAS on the CPU,
// cuBLAS on the current CUDA stream) and the collectives through the process group (gloo runs
// them on its own threads, NCCL on its own stream and orders it against the compute stream
// with events). Ordering is only ever expressed with Work::wait(), which on NCCL makes the
// current stream wait and never blocks the host.
//
// Layout convention: an N-D operand whose gathered or scattered dimension `dim` is not 0 is
// handled in a "dim-first" layout (that dimension moved to the front, then made contiguous),
// in which every rank's block and every chunk of it is a contiguous range of rows of a 2-D
// [rows, features] matrix. Outputs are allocated dim-first and returned as views moved back,
// so every GEMM piece writes straight into its final place.
#pragma once

#include <ATen/ATen.h>
#include <optional>

#include <string>
#include <tuple>
#include <vector>

namespace tpx {

// out = all_gather(a, gather_dim) @ b (+ bias). Returns (a_gathered, out). `a_gathered` holds
// every rank's rows in the pipeline's chunk-major order: with a pipeline depth of c > 1 the
// local extent along gather_dim is split into c spans, and a_gathered lists span 0 of ranks
// 0..W-1, then span 1 of every rank, ... (rank order when c = 1 or W = 1). It is what the
// backward consumes; the Python wrapper returns it in rank order.
std::tuple<at::Tensor, at::Tensor> all_gather_matmul(
    const at::Tensor& a, const at::Tensor& b, int64_t gather_dim,
    const std::string& group_name, std::optional<int64_t> chunks,
    const std::optional<at::Tensor>& bias);

// Backward of all_gather_matmul: grad_a = reduce_scatter(grad_out @ b^T + grad_a_gathered),
// overlapped with grad_b = a_gathered^T @ grad_out (returned as the transpose of a contiguous
// [n, k] tensor) and grad_bias = grad_out summed over rows. `a_gathered` and `grad_a_gathered`
// are in the forward's chunk-major order (same `chunks`). Only the gradients asked for are
// computed: need_a = false skips the input-gradient GEMM and its reduce-scatter, need_b =
// false the weight-gradient GEMM; the skipped ones are returned as None.
std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>, std::optional<at::Tensor>>
all_gather_matmul_backward(const at::Tensor& grad_out,
                           const std::optional<at::Tensor>& grad_a_gathered,
                           const at::Tensor& a_gathered, const at::Tensor& b, int64_t gather_dim,
                           const std::string& group_name, std::optional<int64_t> chunks,
                           bool need_a, bool need_b, bool bias_grad);

// out = reduce_scatter(a @ b (+ bias), scatter_dim).
at::Tensor matmul_reduce_scatter(
    const at::Tensor& a, const at::Tensor& b, int64_t scatter_dim,
    const std::string& group_name, std::optional<int64_t> chunks,
    const std::optional<at::Tensor>& bias);

// Backward of matmul_reduce_scatter: the gradient is all-gathered piece by piece and each
// piece feeds both grad_a = g @ b^T and grad_b += a^T @ g as soon as it lands. Only the
// gradients asked for are computed; with neither need_a nor need_b nothing is gathered (the
// replicated bias gradient is one small all-reduce of the local row sums).
std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>, std::optional<at::Tensor>>
matmul_reduce_scatter_backward(const at::Tensor& grad_out, const at::Tensor& a,
                               const at::Tensor& b, int64_t scatter_dim,
                               const std::string& group_name, std::optional<int64_t> chunks,
                               bool need_a, bool need_b, bool bias_grad);

// out = all_reduce(a @ b (+ bias)).
at::Tensor matmul_all_reduce(
    const at::Tensor& a, const at::Tensor& b, const std::string& group_name,
    std::optional<int64_t> chunks, const std::optional<at::Tensor>& bias);

// The local backward of matmul_all_reduce (its output is replicated, so no collective):
// grad_a = grad_out @ b^T, grad_b = a^T @ grad_out, each computed only when asked for.
std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>, std::optional<at::Tensor>>
matmul_all_reduce_backward(const at::Tensor& grad_out, const at::Tensor& a, const at::Tensor& b,
                           bool need_a, bool need_b, bool bias_grad);

// out = a @ b (+ bias) on this rank alone, with the GEMM the engine uses (common/gemm.h).
at::Tensor local_matmul(const at::Tensor& a, const at::Tensor& b,
                        const std::optional<at::Tensor>& bias);

// out = a @ b (+ bias) with `a` replicated: no communication forward. Its backward all-reduces
// grad_a = grad_out @ b^T (issued before the weight-gradient GEMM and waited after it).
at::Tensor replicated_matmul(
    const at::Tensor& a, const at::Tensor& b, const std::string& group_name,
    std::optional<int64_t> chunks, const std::optional<at::Tensor>& bias);

// need_a = false skips the input-gradient GEMM and its all-reduce, need_b = false the
// weight-gradient GEMM.
std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>, std::optional<at::Tensor>>
replicated_matmul_backward(const at::Tensor& grad_out, const at::Tensor& a, const at::Tensor& b,
                           const std::string& group_name, std::optional<int64_t> chunks,
                           bool need_a, bool need_b, bool bias_grad);

// The pipeline depth an op picks for a collective moving `bytes` per rank over `extent`
// splittable units along its split dimension (same inputs -> same depth on every rank).
int64_t pipeline_depth(std::optional<int64_t> chunks, int64_t extent, int64_t bytes);

// The pipeline depth used when the caller passes chunks=None.
int64_t default_chunks();

// `sizes` with its last entry replaced by `last`.
std::vector<int64_t> with_last(at::IntArrayRef sizes, int64_t last);

// Rows [lo, lo + len) of a pipelined dimension.
struct Span {
  int64_t lo;
  int64_t len;
};

// Splits [0, n) into `parts` contiguous spans whose lengths differ by at most one (callers
// clamp `parts` to n with pipeline_depth, so no span is empty unless n is 0).
std::vector<Span> split_even(int64_t n, int64_t parts);

}  // namespace tpx
