// Vocab-parallel cross-entropy (see cross_entropy.cpp for the algorithm).
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>

namespace tpx {

// The dtype the loss is computed and returned in: float64 for float64 logits, else float32.
at::ScalarType ce_accumulate_type(at::ScalarType logits);

// Raises (on a GPU: asserts on the device, without a host synchronisation) when a target is
// neither in [0, vocab_size) nor ignore_index, as F.cross_entropy does.
void check_targets(const char* op, const at::Tensor& target, int64_t vocab_size,
                   int64_t ignore_index);

// logits: this rank's [N, V_local] columns [vocab_start, vocab_start + V_local) of a
// vocabulary of vocab_size; target: [N] global ids. Returns (loss [N], lse [N]) in
// ce_accumulate_type(logits).
std::tuple<at::Tensor, at::Tensor> vocab_parallel_cross_entropy(
    const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start, int64_t vocab_size,
    const std::string& group_name, int64_t ignore_index, double label_smoothing,
    bool inplace_backward);

// d loss / d logits for an upstream gradient grad_loss [N]: g * (softmax - smoothed onehot).
at::Tensor vocab_parallel_cross_entropy_backward(
    const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& target,
    const at::Tensor& lse, int64_t vocab_start, int64_t vocab_size, int64_t ignore_index,
    double label_smoothing);

// The same, written over `logits`.
void vocab_parallel_cross_entropy_backward_(
    const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& target,
    const at::Tensor& lse, int64_t vocab_start, int64_t vocab_size, int64_t ignore_index,
    double label_smoothing);

}  // namespace tpx
