// The LM head and the vocab-parallel loss fused: the logits of all tokens never exist at once.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>

namespace tpx {

// hidden [N, d] (replicated), weight [V_local, d] (this rank's vocabulary rows from
// vocab_start), optional bias [V_local], target [N]. Tokens are processed chunk_size at a time.
// Returns (loss [N] fp32, lse [N] fp32).
std::tuple<at::Tensor, at::Tensor> linear_cross_entropy(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, int64_t vocab_start, int64_t vocab_size,
    const std::string& group_name, int64_t chunk_size, int64_t ignore_index,
    double label_smoothing);

// Recomputes each chunk's logits, turns them into their gradient in place, and accumulates
// grad_weight / grad_bias; the partial grad_hidden of each chunk is all-reduced while the
// next chunk is computed. Returns (grad_hidden, grad_weight, grad_bias), each only when asked
// for (need_*): without need_hidden there is no grad_hidden GEMM and no all-reduce; with
// nothing needed, nothing is recomputed.
std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>, std::optional<at::Tensor>>
linear_cross_entropy_backward(const at::Tensor& grad_loss, const at::Tensor& hidden,
                              const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                              const at::Tensor& target, const at::Tensor& lse,
                              int64_t vocab_start, int64_t vocab_size,
                              const std::string& group_name, int64_t chunk_size,
                              int64_t ignore_index, double label_smoothing, bool need_hidden,
                              bool need_weight, bool need_bias);

}  // namespace tpx
