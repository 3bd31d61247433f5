// The multi-dimensional tensor-parallel linear layers (2-D SUMMA, 2.5-D, 3-D) as ops of the
// overlap engine: block GEMMs interleaved with the broadcasts / reductions / gathers of the
// c10d process groups of the mesh dimensions, resolved by name.
//
// Every op takes the Linear weight block in nn.Linear's orientation, [out_local, in_local],
// and computes y = x @ weight^T (+ bias) over the mesh. The block notation and which mesh
// dimension splits which tensor dimension are written above each op in multidim.cpp.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>

namespace tpx {

// 2-D SUMMA forward over a q x q grid (2.5-D: one depth layer of it). Rank (i, j) holds
// x = X_ij [..., k/q] and weight = W_ji (the block A_ij of A = W^T), returns Y_ij.
at::Tensor linear_2d(const at::Tensor& x, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias, const std::string& row_group,
                     const std::string& col_group,
                     const std::optional<std::string>& depth_group);

// 2-D SUMMA backward: the transposed products dX = dY A^T and dA = X^T dY, each pipelined.
// Only the requested gradients are computed; with depth_group (2.5-D) the weight and bias
// gradients are also summed over the depth layers.
std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>, std::optional<at::Tensor>>
linear_2d_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                   const std::string& row_group, const std::string& col_group,
                   const std::optional<std::string>& depth_group, bool need_x,
                   bool need_weight, bool need_bias);

// 3-D forward: all-gather x over batch_group and the weight over input_group, local GEMM,
// reduce-scatter y over hidden_group, chunked. Returns (y, x_gathered, weight_gathered).
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_3d(
    const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const std::string& input_group, const std::string& batch_group,
    const std::string& hidden_group, std::optional<int64_t> chunks);

// 3-D backward: all-gathers grad_out over hidden_group, reduce-scatters grad x over
// batch_group and grad weight over input_group; bias gradient all-reduced over input_group.
std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>, std::optional<at::Tensor>>
linear_3d_backward(const at::Tensor& grad_out, const at::Tensor& x_gathered,
                   const at::Tensor& weight_gathered, const std::string& input_group,
                   const std::string& batch_group, const std::string& hidden_group,
                   std::optional<int64_t> chunks, bool need_x, bool need_weight,
                   bool need_bias);

// Out-of-place sum of `x` over the group (norm statistics and gradients of replicated
// parameters of the multi-dimensional layers).
at::Tensor mesh_all_reduce(const at::Tensor& x, const std::string& group);

// Stacks every rank's `x` (same shape on all ranks): [world, *x.shape], rank-major.
at::Tensor mesh_all_gather(const at::Tensor& x, const std::string& group);

}  // namespace tpx
