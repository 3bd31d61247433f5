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
    TORCH_CHECK_VALUE(bias->scalar_type() == weight.scalar_type(), "tpx.", op, ": bias (",
                      bias->scalar_type(), ") must have the dtype of weight (",
                      weight.scalar_type(), ")");
    TORCH_CHECK_VALUE(bias->device() == weight.device(), "tpx.", op, ": bias is on ",
                      bias->device(), " but weight is on ", weight.device());
  }
  TORCH_CHECK_VALUE(target.dim() == 1 && target.size(0) == hidden.size(0), "tpx.", op,
                    ": target must be [N] = [", hidden.size(0), "]; got ", target.sizes());
  TORCH_CHECK_VALUE(target.scalar_type() == at::kLong, "tpx.", op,
                    ": target must be int64; got ", target.scalar_type());
  TORCH_CHECK_VALUE(target.device() == hidden.device(), "tpx.", op, ": target is on ",
                    target.device(), " but hidden is on ", hidden.device());
  TORCH_CHECK_VALUE(chunk_size >= 1, "tpx.", op, ": chunk_size must be >= 1; got ", chunk_size);
}

// The backward's per-row inputs, checked before the first chunk's collective is posted.
void check_rows(const char* op, const char* name, const at::Tensor& t, int64_t rows) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == rows, "tpx.", op, ": ", name,
                    " must be [N] = [", rows, "], one entry per row of hidden; got ", t.sizes());
  TORCH_CHECK_VALUE(at::isFloatingType(t.scalar_type()), "tpx.", op, ": ", name,
                    " must be floating point; got ", t.scalar_type());
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
  // The target is replicated: every rank raises here, before the first chunk's collective.
  check_targets("linear_cross_entropy", target, vocab_size, ignore_index);
  const int64_t rows = hidden.size(0);
  const auto f32 = hidden.options().dtype(ce_accumulate_type(hidden.scalar_type()));
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
  check_rows("linear_cross_entropy_backward", "grad_loss", grad_loss, hidden.size(0));
  check_rows("linear_cross_entropy_backward", "lse", lse, hidden.size(0));
  auto pg = resolve_group(group_name);
  const int64_t rows = hidden.size(0);
  std::optional<at::Tensor> grad_hidden, grad_weight, grad_bias;
  if (need_hidden) grad_hidden = at::empty_like(hidden, at::MemoryFormat::Contiguous);
  if (need_weight) grad_weight = at::zeros_like(weight, at::MemoryFormat::Contiguous);
  if (need_bias && bias.has_value()) grad_bias = at::zeros_like(*bias);
  if (!need_hidden && !need_weight && !grad_bias.has_value()) return {grad_hidden, grad_weight, grad_bias};
  Pending pending;
  pending.group = pg->getGroupName();
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
