// Vocab-parallel cross-entropy: logits sharded over the vocabulary, exact F.cross_entropy.
//
// Forward: each rank reduces its [N, V_r] shard to four fp32 statistics per row (max, sum of
// exp relative to that max, the target logit if this rank holds the target, the sum of the
// logits for label smoothing). The statistics of all ranks travel in ONE all-gather and every
// rank combines them the same way:
//   M = max_r m_r,  S = sum_r s_r exp(m_r - M),  lse = M + log S,
//   loss = lse - (1 - eps) x_t - (eps / V) sum_j x_j          (0 for ignored rows).
// Backward, one fused pass per row block: grad = g * (softmax - (1 - eps) onehot - eps / V),
// optionally written over the logits themselves.
//
// The shard is processed in row blocks whose fp32 working copy stays in cache, with ATen's
// vectorised kernels (runtime-dispatched SIMD), so any device and dtype works; the
// arithmetic is fp32 for fp32 / fp16 / bf16 logits and fp64 for fp64 logits (as
// F.cross_entropy keeps float64). In CUDA builds, fp32 / fp16 / bf16 logits
// on a GPU take dedicated kernels instead (csrc/cuda): one online-softmax pass per row for
// the statistics and one fused pass for the gradient; the collective and the combine step
// below are the same for both paths.
#include "vocab/cross_entropy.h"

#include "common/process_group.h"
#ifdef TPX_WITH_CUDA
#include "cuda/vocab_cuda.h"
#endif

#include <algorithm>
#include <cmath>
#include <limits>

namespace tpx {
namespace {

// Rows per block: a block's fp32 working copy is about 1 MiB.
int64_t block_rows(int64_t width) {
  return std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(width, 1));
}

void check_args(const char* op, const at::Tensor& logits, const at::Tensor& target,
                int64_t vocab_start, int64_t vocab_size, double label_smoothing) {
  TORCH_CHECK_VALUE(logits.dim() == 2, "tpx.", op, ": logits must be 2-D [N, V_local]; got ",
                    logits.sizes());
  TORCH_CHECK_VALUE(at::isFloatingType(logits.scalar_type()), "tpx.", op,
                    ": logits must be floating point; got ", logits.scalar_type());
  TORCH_CHECK_VALUE(target.dim() == 1 && target.size(0) == logits.size(0), "tpx.", op,
                    ": target must be 1-D with one entry per row of logits (", logits.size(0),
                    "); got ", target.sizes());
  TORCH_CHECK_VALUE(target.scalar_type() == at::kLong, "tpx.", op,
                    ": target must be int64; got ", target.scalar_type());
  TORCH_CHECK_VALUE(target.device() == logits.device(), "tpx.", op, ": target is on ",
                    target.device(), " but logits are on ", logits.device());
  TORCH_CHECK_VALUE(vocab_start >= 0 && vocab_start + logits.size(1) <= vocab_size, "tpx.", op,
                    ": the shard [", vocab_start, ", ", vocab_start + logits.size(1),
                    ") does not lie in the vocabulary [0, ", vocab_size, ")");
  TORCH_CHECK_VALUE(label_smoothing >= 0.0 && label_smoothing <= 1.0, "tpx.", op,
                    ": label_smoothing must lie in [0, 1]; got ", label_smoothing);
}

// Local index of every row's target in this shard (0 where the shard does not hold it) and
// whether it holds it.
std::pair<at::Tensor, at::Tensor> local_targets(const at::Tensor& target, int64_t vocab_start,
                                                int64_t width, int64_t ignore_index) {
  at::Tensor local = target - vocab_start;
  at::Tensor held = (local >= 0) & (local < width) & (target != ignore_index);
  return {at::where(held, local, at::zeros_like(local)), held};
}

}  // namespace

at::ScalarType ce_accumulate_type(at::ScalarType logits) {
  return logits == at::kDouble ? at::kDouble : at::kFloat;
}

void check_targets(const char* op, const at::Tensor& target, int64_t vocab_size,
                   int64_t ignore_index) {
  if (target.numel() == 0) return;
  at::Tensor bad = ((target < 0) | (target >= vocab_size)) & (target != ignore_index);
  if (target.is_cpu()) {
    if (!bad.any().item<bool>()) return;
    const int64_t first = bad.nonzero().select(1, 0)[0].item<int64_t>();
    TORCH_CHECK_VALUE(false, "tpx.", op, ": target ", target[first].item<int64_t>(), " (row ",
                      first, ") is out of bounds for a vocabulary of ", vocab_size,
                      " (valid targets lie in [0, ", vocab_size, "), or equal ignore_index = ",
                      ignore_index, ")");
  }
  // On a GPU the check runs on the device without a host synchronisation, as
  // F.cross_entropy's device-side assertion does.
  at::_assert_async(bad.any().logical_not(),
                    "tpx: a cross-entropy target is out of bounds for the vocabulary");
}

std::tuple<at::Tensor, at::Tensor> vocab_parallel_cross_entropy(
    const at::Tensor& logits, const at::Tensor& target, int64_t vocab_start, int64_t vocab_size,
    const std::string& group_name, int64_t ignore_index, double label_smoothing,
    bool inplace_backward) {
  (void)inplace_backward;  // used by the backward
  check_args("vocab_parallel_cross_entropy", logits, target, vocab_start, vocab_size,
             label_smoothing);
  // The target is replicated: every rank raises here, before the collective.
  check_targets("vocab_parallel_cross_entropy", target, vocab_size, ignore_index);
  auto pg = resolve_group(group_name);
  const int64_t world = pg->getSize();
  const int64_t rows = logits.size(0), width = logits.size(1);
  const auto acc = ce_accumulate_type(logits.scalar_type());
  const auto f32 = logits.options().dtype(acc);

  // Per-row statistics of this shard: [max, sum exp(x - max), target logit, sum x].
  at::Tensor stats = at::zeros({rows, 4}, f32);
#ifdef TPX_WITH_CUDA
  const bool kernel = logits.is_cuda() && cuda::vocab_kernels_support(logits.scalar_type());
#else
  const bool kernel = false;
#endif
  if (kernel) {
#ifdef TPX_WITH_CUDA
    cuda::ce_local_stats(stats, logits, target, vocab_start, ignore_index, label_smoothing > 0);
#endif
  } else if (width == 0) {
    stats.select(1, 0).fill_(-std::numeric_limits<float>::infinity());
  } else {
    const int64_t step = block_rows(width);
    for (int64_t r0 = 0; r0 < rows; r0 += step) {
      const int64_t n = std::min(step, rows - r0);
      at::Tensor x = logits.narrow(0, r0, n).to(acc);
      at::Tensor st = stats.narrow(0, r0, n);
      at::Tensor m = x.amax(1, /*keepdim=*/true);
      st.select(1, 0).copy_(m.squeeze(1));
      // A row whose shard is all -inf (a masked vocabulary) has max -inf and sum 0; shifting
      // it by its own max would give exp(-inf - (-inf)) = NaN.
      at::Tensor shift = at::where(m == -std::numeric_limits<float>::infinity(),
                                   at::zeros_like(m), m);
      st.select(1, 1).copy_((x - shift).exp_().sum(1));
      if (label_smoothing > 0) st.select(1, 3).copy_(x.sum(1));
    }
    auto [idx, held] = local_targets(target, vocab_start, width, ignore_index);
    at::Tensor xt = logits.gather(1, idx.unsqueeze(1)).squeeze(1).to(acc);
    stats.select(1, 2).copy_(at::where(held, xt, at::zeros_like(xt)));  // not xt * held: -inf * 0 is NaN
  }

  // Two all-reduces, the fewest bytes (Megatron's derivation): the row maxima (MAX), then the
  // sums of exp rescaled to the global maximum and the target logits (and the sums of the
  // logits for label smoothing) in one buffer (SUM). Every rank ends with the same numbers.
  const int64_t cols = label_smoothing > 0 ? 3 : 2;
  at::Tensor m = stats.select(1, 0).clone(at::MemoryFormat::Contiguous);  // a copy: reduced in place
  if (world > 1) all_reduce_max(*pg, m)->wait();
  const double ninf = -std::numeric_limits<double>::infinity();
  at::Tensor m_r = stats.select(1, 0);
  // A shard whose row is all -inf has sum 0: its factor is 0 (not exp(-inf - -inf) = NaN).
  at::Tensor factor = at::where(m_r == ninf, at::zeros_like(m_r), (m_r - m).exp());
  at::Tensor sums = at::empty({rows, cols}, f32);
  sums.select(1, 0).copy_(stats.select(1, 1) * factor);
  sums.select(1, 1).copy_(stats.select(1, 2));
  if (cols == 3) sums.select(1, 2).copy_(stats.select(1, 3));
  if (world > 1) all_reduce(*pg, sums)->wait();
  at::Tensor lse = m + sums.select(1, 0).log();
  const double eps = label_smoothing;
  at::Tensor loss = lse - (1.0 - eps) * sums.select(1, 1);
  if (eps > 0) loss -= (eps / static_cast<double>(vocab_size)) * sums.select(1, 2);
  loss.masked_fill_(target == ignore_index, 0);
  return {loss, lse};
}

namespace {

// grad[r0:r0+n] = g * (softmax - (1 - eps) onehot - eps / V), computed in place in `x`
// (an fp32 block of logits) and copied to `dst` when it is not `x` itself.
void backward_block(at::Tensor x, const at::Tensor& dst, const at::Tensor& lse,
                    const at::Tensor& g, const at::Tensor& idx, const at::Tensor& held,
                    double eps, int64_t vocab_size) {
  x.sub_(lse.unsqueeze(1)).exp_().mul_(g.unsqueeze(1));
  if (eps > 0) x.sub_((g * (eps / static_cast<double>(vocab_size))).unsqueeze(1));
  x.scatter_add_(1, idx.unsqueeze(1), (-(1.0 - eps) * g * held).unsqueeze(1));
  if (!x.is_same(dst)) dst.copy_(x);
}

void backward_into(const at::Tensor& out, const at::Tensor& grad_loss, const at::Tensor& logits,
                   const at::Tensor& target, const at::Tensor& lse, int64_t vocab_start,
                   int64_t vocab_size, int64_t ignore_index, double label_smoothing) {
  const int64_t rows = logits.size(0), width = logits.size(1);
  if (width == 0 || rows == 0) return;
#ifdef TPX_WITH_CUDA
  if (logits.is_cuda() && cuda::vocab_kernels_support(logits.scalar_type())) {
    cuda::ce_backward(out, grad_loss, logits, target, lse, vocab_start, vocab_size, ignore_index,
                      label_smoothing);
    return;
  }
#endif
  auto [idx, held] = local_targets(target, vocab_start, width, ignore_index);
  const auto acc = ce_accumulate_type(logits.scalar_type());
  at::Tensor g = grad_loss.to(acc).masked_fill(target == ignore_index, 0);
  at::Tensor lse32 = lse.to(acc);
  const bool direct = out.scalar_type() == acc && out.is_contiguous();
  const bool in_place = out.is_same(logits);
  const int64_t step = block_rows(width);
  for (int64_t r0 = 0; r0 < rows; r0 += step) {
    const int64_t n = std::min(step, rows - r0);
    at::Tensor dst = out.narrow(0, r0, n);
    at::Tensor x = direct ? dst : logits.narrow(0, r0, n).to(acc);
    if (direct && !in_place) x.copy_(logits.narrow(0, r0, n));
    backward_block(x, dst, lse32.narrow(0, r0, n), g.narrow(0, r0, n), idx.narrow(0, r0, n),
                   held.narrow(0, r0, n), label_smoothing, vocab_size);
  }
}

}  // namespace

at::Tensor vocab_parallel_cross_entropy_backward(
    const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& target,
    const at::Tensor& lse, int64_t vocab_start, int64_t vocab_size, int64_t ignore_index,
    double label_smoothing) {
  check_args("vocab_parallel_cross_entropy_backward", logits, target, vocab_start, vocab_size,
             label_smoothing);
  at::Tensor out = at::empty_like(logits, at::MemoryFormat::Contiguous);
  backward_into(out, grad_loss, logits, target, lse, vocab_start, vocab_size, ignore_index,
                label_smoothing);
  if (logits.size(1) == 0 || logits.size(0) == 0) out.zero_();
  return out;
}

void vocab_parallel_cross_entropy_backward_(
    const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& target,
    const at::Tensor& lse, int64_t vocab_start, int64_t vocab_size, int64_t ignore_index,
    double label_smoothing) {
  check_args("vocab_parallel_cross_entropy_backward_", logits, target, vocab_start, vocab_size,
             label_smoothing);
  TORCH_CHECK_VALUE(logits.is_contiguous(), "tpx: inplace_backward needs contiguous logits");
  backward_into(logits, grad_loss, logits, target, lse, vocab_start, vocab_size, ignore_index,
                label_smoothing);
}

}  // namespace tpx
