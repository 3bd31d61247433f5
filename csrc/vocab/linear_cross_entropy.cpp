#include "vocab/linear_cross_entropy.h"

#include "common/gemm.h"
#include "common/process_group.h"
#include "vocab/cross_entropy.h"

#include <algorithm>

namespace tpx {
namespace {

void check_args(const char* op, const at::Tensor& hidden, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias, const at::Tensor& target,
                int64_t chunk_size) {
  TORCH_CHECK_VALUE(hidden.dim() == 2, "tpx.", op, ": hidden must be 2-D [N, d]; got ",
                    hidden.sizes());
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == hidden.size(1), "tpx.", op,
                    ": weight must be [V_local, d] with d = hidden.size(-1) = ", hidden.size(1),
                    "; got ", weight.sizes());
  TORCH_CHECK_VALUE(weight.scalar_type() == hidden.scalar_type(), "tpx.", op, ": hidden (",
                    hidden.scalar_type(), ") and weight (", weight.scalar_type(),
                    ") must have the same dtype");
  TORCH_CHECK_VALUE(weight.device() == hidden.device(), "tpx.", op, ": hidden is on ",
                    hidden.device(), " but weight is on ", weight.device());
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0), "tpx.", op,
                      ": bias must be [V_local] = [", weight.size(0), "]; got ", bias->sizes());
  }
  TORCH_CHECK_VALUE(target.dim() == 1 && target.size(0) == hidden.size(0), "tpx.", op,
                    ": target must be [N] = [", hidden.size(0), "]; got ", target.sizes());
  TORCH_CHECK_VALUE(chunk_size >= 1, "tpx.", op, ": chunk_size must be >= 1; got ", chunk_size);
}

at::Tensor chunk_logits(const at::Tensor& h, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias) {
  return gemm(h, weight.t(), bias);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> linear_cross_entropy(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& target, int64_t vocab_start, int64_t vocab_size,
    const std::string& group_name, int64_t chunk_size, int64_t ignore_index,
    double label_smoothing) {
  check_args("linear_cross_entropy", hidden, weight, bias, target, chunk_size);
  const int64_t rows = hidden.size(0);
  const auto f32 = hidden.options().dtype(at::kFloat);
  at::Tensor loss = at::empty({rows}, f32), lse = at::empty({rows}, f32);
  for (int64_t r0 = 0; r0 < rows; r0 += chunk_size) {
    const int64_t n = std::min(chunk_size, rows - r0);
    at::Tensor logits = chunk_logits(hidden.narrow(0, r0, n), weight, bias);
    auto [l, s] = vocab_parallel_cross_entropy(logits, target.narrow(0, r0, n), vocab_start,
                                               vocab_size, group_name, ignore_index,
                                               label_smoothing, false);
    loss.narrow(0, r0, n).copy_(l);
    lse.narrow(0, r0, n).copy_(s);
  }
  return {loss, lse};
}

std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>, std::optional<at::Tensor>>
linear_cross_entropy_backward(const at::Tensor& grad_loss, const at::Tensor& hidden,
                              const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                              const at::Tensor& target, const at::Tensor& lse,
                              int64_t vocab_start, int64_t vocab_size,
                              const std::string& group_name, int64_t chunk_size,
                              int64_t ignore_index, double label_smoothing, bool need_hidden,
                              bool need_weight, bool need_bias) {
  check_args("linear_cross_entropy_backward", hidden, weight, bias, target, chunk_size);
  auto pg = resolve_group(group_name);
  const int64_t rows = hidden.size(0);
  std::optional<at::Tensor> grad_hidden, grad_weight, grad_bias;
  if (need_hidden) grad_hidden = at::empty_like(hidden, at::MemoryFormat::Contiguous);
  if (need_weight) grad_weight = at::zeros_like(weight, at::MemoryFormat::Contiguous);
  if (need_bias && bias.has_value()) grad_bias = at::zeros_like(*bias);
  if (!need_hidden && !need_weight && !grad_bias.has_value()) return {grad_hidden, grad_weight, grad_bias};
  Pending pending;
  for (int64_t r0 = 0; r0 < rows; r0 += chunk_size) {
    const int64_t n = std::min(chunk_size, rows - r0);
    at::Tensor h = hidden.narrow(0, r0, n);
    at::Tensor g = chunk_logits(h, weight, bias);  // recomputed, then overwritten by its grad
    vocab_parallel_cross_entropy_backward_(grad_loss.narrow(0, r0, n), g,
                                           target.narrow(0, r0, n), lse.narrow(0, r0, n),
                                           vocab_start, vocab_size, ignore_index,
                                           label_smoothing);
    if (need_hidden) {
      at::Tensor gh = grad_hidden->narrow(0, r0, n);
      mm_into(gh, g, weight);
      // Partial over the vocabulary: summed while the next chunk runs.
      if (pg->getSize() > 1) pending.works.push_back(all_reduce(*pg, gh));
    }
    if (need_weight) mm_accumulate(*grad_weight, g.t(), h);
    if (grad_bias.has_value()) grad_bias->add_(g.sum(0));
  }
  pending.wait();
  return {grad_hidden, grad_weight, grad_bias};
}

}  // namespace tpx
