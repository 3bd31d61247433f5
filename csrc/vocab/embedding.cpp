// Vocab-parallel embedding: masked gather forward, scatter-add backward, with the partial
// results reduced over the group (all-reduce, or reduce-scatter under sequence parallelism).
// The ids are processed dim-first (the scattered dimension moved to the front) so that each
// rank's block of the output is a contiguous range of rows.
//
// In CUDA builds, fp32 / fp16 / bf16 tables on a GPU use dedicated kernels (csrc/cuda) for
// the masked gather and for the scatter-add: a sorted, bitwise reproducible segmented sum for
// fp16 / bf16 gradients and under torch.use_deterministic_algorithms(True), fp32 atomics for
// an fp32 gradient otherwise. The collectives are the same for both paths.
#include "vocab/embedding.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "common/process_group.h"
#ifdef TPX_WITH_CUDA
#include "cuda/vocab_cuda.h"
#endif

#if defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif

namespace tpx {
namespace {

int64_t normalize_scatter_dim(std::optional<int64_t> dim, int64_t ndim) {
  const int64_t d = *dim < 0 ? *dim + ndim : *dim;
  TORCH_CHECK_VALUE(d >= 0 && d < ndim, "tpx.vocab_parallel_embedding: scatter_dim=", *dim,
                    " is out of range for ids with ", ndim, " dimensions");
  return d;
}

// Local row of every id, and whether this rank holds it.
std::pair<at::Tensor, at::Tensor> local_rows(const at::Tensor& ids, int64_t vocab_start,
                                             int64_t num_local) {
  at::Tensor local = ids - vocab_start;
  at::Tensor held = (local >= 0) & (local < num_local);
  return {at::where(held, local, at::zeros_like(local)), held};
}

// The masked gather on the CPU in one pass: each id's row copied when this rank holds it,
// zeros otherwise (bit for bit what index_select and masked_fill give, without their five
// intermediate tensors). Needs rows of contiguous elements and contiguous int64 ids; an
// undefined tensor otherwise.
at::Tensor gather_rows_cpu(const at::Tensor& weight, const at::Tensor& ids, int64_t vocab_start) {
  if (!weight.is_cpu() || weight.is_sparse() || weight.is_quantized() || weight.is_conj() ||
      weight.is_neg() || (weight.size(1) > 1 && weight.stride(1) != 1) || !ids.is_contiguous())
    return {};
  const int64_t n = ids.numel(), rows = weight.size(0), dim = weight.size(1);
  at::Tensor out = at::empty({n, dim}, weight.options().memory_format(at::MemoryFormat::Contiguous));
  if (n == 0 || dim == 0) return out;
  const int64_t* id = ids.const_data_ptr<int64_t>();
  const auto* src = static_cast<const char*>(weight.const_data_ptr());
  auto* dst = static_cast<char*>(out.mutable_data_ptr());
  const int64_t elem = weight.element_size(), row_bytes = dim * elem,
                src_stride = weight.stride(0) * elem;
  // rows of a few hundred bytes: split only when there are many
  at::parallel_for(0, n, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(row_bytes, 1)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t i = begin; i < end; ++i) {
                       const int64_t local = id[i] - vocab_start;
                       if (local >= 0 && local < rows)
                         std::memcpy(dst + i * row_bytes, src + local * src_stride, row_bytes);
                       else
                         std::memset(dst + i * row_bytes, 0, row_bytes);
                     }
                   });
  return out;
}

void check_ids(const char* op, const at::Tensor& ids, const at::Tensor& like) {
  TORCH_CHECK_VALUE(ids.scalar_type() == at::kLong, "tpx.", op, ": ids must be int64; got ",
                    ids.scalar_type());
  TORCH_CHECK_VALUE(ids.device() == like.device(), "tpx.", op, ": ids are on ", ids.device(),
                    " but the table is on ", like.device());
}

}  // namespace

at::Tensor vocab_parallel_embedding(const at::Tensor& weight, const at::Tensor& ids,
                                    int64_t vocab_start, const std::string& group_name,
                                    std::optional<int64_t> scatter_dim, int64_t padding_idx) {
  (void)padding_idx;  // used by the backward
  TORCH_CHECK_VALUE(weight.dim() == 2, "tpx.vocab_parallel_embedding: weight must be 2-D "
                    "[V_local, D]; got ", weight.sizes());
  check_ids("vocab_parallel_embedding", ids, weight);
  auto pg = resolve_group(group_name);
  const int64_t world = pg->getSize(), dim = weight.size(1);
  at::Tensor idm = ids;
  int64_t sd = 0;
  if (scatter_dim.has_value()) {
    sd = normalize_scatter_dim(scatter_dim, ids.dim());
    TORCH_CHECK_VALUE(ids.size(sd) % world == 0, "tpx.vocab_parallel_embedding: ids.size(", sd,
                      ") = ", ids.size(sd), " must divide by the group size ", world,
                      " to be scattered; pad the sequence to a multiple of ", world);
    idm = ids.movedim(sd, 0).contiguous();
  }
  at::Tensor partial;  // [numel(ids), D]
#ifdef TPX_WITH_CUDA
  if (weight.is_cuda() && cuda::vocab_kernels_support(weight.scalar_type()))
    partial = cuda::embedding_gather(weight, idm, vocab_start);
#endif
  if (!partial.defined() && weight.size(0) == 0) {
    // A rank whose shard of the vocabulary is empty (fewer rows than ranks) holds no id: its
    // part of the sum is zero, and it still takes part in the collective below.
    partial = at::zeros({idm.numel(), dim}, weight.options());
  }
  if (!partial.defined()) partial = gather_rows_cpu(weight, idm, vocab_start);
  if (!partial.defined()) {
    auto [idx, held] = local_rows(idm.reshape({-1}), vocab_start, weight.size(0));
    partial = weight.index_select(0, idx);
    partial.masked_fill_(held.logical_not().unsqueeze(1), 0);
  }
  auto shape = idm.sizes().vec();
  shape.push_back(dim);
  if (!scatter_dim.has_value()) {
    if (world > 1) {
      all_reduce(*pg, partial)->wait();
    }
    return at::_unsafe_view(partial, shape);  // a new tensor to autograd: user code may write into it
  }
  if (world == 1) return partial.view(shape).movedim(0, sd).contiguous();
  shape[0] /= world;
  at::Tensor out = at::empty(shape, partial.options());
  reduce_scatter_base(*pg, out.view({-1, dim}), partial)->wait();
  return out.movedim(0, sd).contiguous();  // contiguous for user code that may .view() it
}

at::Tensor vocab_parallel_lookup(const at::Tensor& weight, const at::Tensor& ids,
                                 int64_t vocab_start, int64_t num_embeddings,
                                 const std::string& group_name, int64_t padding_idx) {
  if (num_embeddings >= 0 && ids.is_cpu() && ids.scalar_type() == at::kLong && ids.numel()) {
    const at::Tensor flat = ids.contiguous();
    const int64_t* id = flat.const_data_ptr<int64_t>();
    int64_t lo = id[0], hi = id[0];
    for (int64_t i = 1, n = flat.numel(); i < n; ++i) {
      lo = std::min(lo, id[i]);
      hi = std::max(hi, id[i]);
    }
    TORCH_CHECK_VALUE(lo >= 0 && hi < num_embeddings, "tpx.VocabParallelEmbedding: id ",
                      lo < 0 ? lo : hi, " is outside the table [0, ", num_embeddings, ")");
  }
  return vocab_parallel_embedding(weight, ids, vocab_start, group_name, std::nullopt,
                                  padding_idx);
}

at::Tensor vocab_parallel_embedding_backward(const at::Tensor& grad_out, const at::Tensor& ids,
                                             int64_t vocab_start, int64_t num_local,
                                             int64_t padding_idx, const std::string& group_name,
                                             std::optional<int64_t> scatter_dim) {
  check_ids("vocab_parallel_embedding_backward", ids, grad_out);
  auto pg = resolve_group(group_name);
  const int64_t world = pg->getSize(), dim = grad_out.size(-1);
  at::Tensor idm = ids;
  at::Tensor g;  // [numel(ids), D], rows in the order of idm
  if (scatter_dim.has_value()) {
    const int64_t sd = normalize_scatter_dim(scatter_dim, ids.dim());
    idm = ids.movedim(sd, 0).contiguous();
    at::Tensor local = grad_out.movedim(sd, 0).contiguous().view({-1, dim});
    if (world > 1) {
      g = at::empty({local.size(0) * world, dim}, local.options());
      all_gather_into(*pg, g, local);
    } else {
      g = local;
    }
  } else {
    g = grad_out.reshape({-1, dim});
  }
#ifdef TPX_WITH_CUDA
  if (g.is_cuda() && cuda::vocab_kernels_support(g.scalar_type()))
    return cuda::embedding_scatter(g, idm, vocab_start, num_local, padding_idx);
#endif
  auto [idx, held] = local_rows(idm.reshape({-1}), vocab_start, num_local);
  if (padding_idx >= 0) held = held & (idx != padding_idx);
  at::Tensor rows = held.nonzero().squeeze(1);
  at::Tensor grad_weight = at::zeros({num_local, dim}, g.options());
  grad_weight.index_add_(0, idx.index_select(0, rows), g.index_select(0, rows));
  return grad_weight;
}

}  // namespace tpx
