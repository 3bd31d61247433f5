// CUDA implementations of the per-shard parts of the vocab-parallel ops (torch-op layer over
// the kernels of kernels.h). Compiled only in CUDA builds (TPX_WITH_CUDA); the collectives
// and the combine step stay in csrc/vocab/*.cpp and are shared with the ATen path.
#pragma once

#include <ATen/ATen.h>

namespace tpx {
namespace cuda {

// Whether the kernels below handle tensors of this dtype (fp32, fp16, bf16).
bool vocab_kernels_support(at::ScalarType dtype);

// Writes every entry of stats [rows, 4] fp32 (contiguous, on the logits' device) with the
// per-row statistics of the shard logits [rows, V_local] (see CeStat in kernels.h).
void ce_local_stats(const at::Tensor& stats, const at::Tensor& logits, const at::Tensor& target,
                    int64_t vocab_start, int64_t ignore_index, bool with_sum_logits);

// out = d loss / d logits for the upstream gradient grad_loss [rows]; out has the logits'
// dtype and shape, a dense last dimension, and may be `logits` itself.
void ce_backward(const at::Tensor& out, const at::Tensor& grad_loss, const at::Tensor& logits,
                 const at::Tensor& target, const at::Tensor& lse, int64_t vocab_start,
                 int64_t vocab_size, int64_t ignore_index, double label_smoothing);

// [ids.numel(), D]: the rows of weight [V_local, D] for the ids this shard holds, zeros for
// the others.
at::Tensor embedding_gather(const at::Tensor& weight, const at::Tensor& ids,
                            int64_t vocab_start);

// [num_local, D] in grad's dtype: grad [ids.numel(), D] summed into the local rows of the ids
// this shard holds, except the local row padding_idx (-1 for none). When
// at::globalContext().deterministicAlgorithms() is set (torch.use_deterministic_algorithms)
// the ids are sorted and each row is summed by one thread per column in a fixed order
// (bitwise reproducible); otherwise fp32 atomics are used (fp16 / bf16 gradients are
// accumulated in an fp32 buffer, then rounded once).
at::Tensor embedding_scatter(const at::Tensor& grad, const at::Tensor& ids, int64_t vocab_start,
                             int64_t num_local, int64_t padding_idx);

}  // namespace cuda
}  // namespace tpx
