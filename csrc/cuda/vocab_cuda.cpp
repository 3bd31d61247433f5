// Torch-op layer over the vocab kernels (kernels.h): argument checks, layout normalisation
// (dense last dimension, contiguous index vectors), the current CUDA stream of the tensors'
// device, and the launch status turned into a TORCH_CHECK error. The stream comes from
// c10/cuda (the same current stream as at::cuda::getCurrentCUDAStream) so that this file
// needs no CUDA library header beyond the runtime's.
#include "cuda/vocab_cuda.h"

#include <ATen/Context.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/kernels.h"

namespace tpx {
namespace cuda {
namespace {

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      break;
  }
  TORCH_CHECK(false, "tpx: no CUDA kernel for dtype ", t.scalar_type());
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "tpx: CUDA kernel ", what, " failed to launch: ",
              cudaGetErrorString(err));
}

// A 2-D tensor whose last dimension is dense (stride 1); copies only when it is not.
at::Tensor dense_rows(const at::Tensor& t) {
  return (t.size(1) <= 1 || t.stride(1) == 1) ? t : t.contiguous();
}

void check_on(const at::Tensor& t, const at::Tensor& like, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.device() == like.device(), "tpx.", op, ": ", name, " is on ", t.device(),
                    " but the main input is on ", like.device());
}

}  // namespace

bool vocab_kernels_support(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
}

void ce_local_stats(const at::Tensor& stats, const at::Tensor& logits, const at::Tensor& target,
                    int64_t vocab_start, int64_t ignore_index, bool with_sum_logits) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2, "tpx: ce_local_stats needs 2-D CUDA logits");
  TORCH_CHECK(stats.scalar_type() == at::kFloat && stats.is_contiguous() && stats.dim() == 2 &&
                  stats.size(0) == logits.size(0) && stats.size(1) == kCeStats,
              "tpx: ce_local_stats needs contiguous fp32 stats [rows, ", int(kCeStats), "]");
  check_on(stats, logits, "vocab_parallel_cross_entropy", "stats");
  check_on(target, logits, "vocab_parallel_cross_entropy", "target");
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor x = dense_rows(logits);
  const at::Tensor t = target.contiguous();
  check_launch(ce_forward_stats(x.data_ptr(), dtype_of(x), x.size(0), x.size(1), x.stride(0),
                                t.data_ptr<int64_t>(), vocab_start, ignore_index,
                                with_sum_logits, stats.data_ptr<float>(),
                                c10::cuda::getCurrentCUDAStream(x.device().index()).stream()),
               "ce_forward_stats");
}

void ce_backward(const at::Tensor& out, const at::Tensor& grad_loss, const at::Tensor& logits,
                 const at::Tensor& target, const at::Tensor& lse, int64_t vocab_start,
                 int64_t vocab_size, int64_t ignore_index, double label_smoothing) {
  const char* op = "vocab_parallel_cross_entropy_backward";
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2, "tpx: ce_backward needs 2-D CUDA logits");
  TORCH_CHECK(out.sizes() == logits.sizes() && out.scalar_type() == logits.scalar_type() &&
                  (out.size(1) <= 1 || out.stride(1) == 1),
              "tpx: ce_backward needs an output shaped like the logits with a dense last dim");
  const int64_t rows = logits.size(0);
  TORCH_CHECK_VALUE(grad_loss.numel() == rows && lse.numel() == rows, "tpx.", op,
                    ": grad_loss and lse must have one entry per row (", rows, "); got ",
                    grad_loss.sizes(), " and ", lse.sizes());
  check_on(out, logits, op, "the output");
  check_on(grad_loss, logits, op, "grad_loss");
  check_on(lse, logits, op, "lse");
  check_on(target, logits, op, "target");
  const c10::cuda::CUDAGuard guard(logits.device());
  // In place, out is logits (contiguous, checked by the caller) and dense_rows returns it.
  const at::Tensor x = dense_rows(logits);
  const at::Tensor t = target.contiguous();
  const at::Tensor g = grad_loss.to(at::kFloat).reshape({rows}).contiguous();
  const at::Tensor l = lse.to(at::kFloat).reshape({rows}).contiguous();
  check_launch(
      cuda::ce_backward(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), dtype_of(x),
                        rows, x.size(1), t.data_ptr<int64_t>(), l.data_ptr<float>(),
                        g.data_ptr<float>(), vocab_start, vocab_size, ignore_index,
                        static_cast<float>(label_smoothing),
                        c10::cuda::getCurrentCUDAStream(x.device().index()).stream()),
      "ce_backward");
}

at::Tensor embedding_gather(const at::Tensor& weight, const at::Tensor& ids,
                            int64_t vocab_start) {
  TORCH_CHECK(weight.is_cuda() && weight.dim() == 2, "tpx: embedding_gather needs a 2-D CUDA table");
  check_on(ids, weight, "vocab_parallel_embedding", "ids");
  const c10::cuda::CUDAGuard guard(weight.device());
  const at::Tensor w = dense_rows(weight);
  const at::Tensor id = ids.reshape({-1}).contiguous();
  at::Tensor out = at::empty({id.numel(), w.size(1)}, w.options());
  check_launch(embedding_forward(w.data_ptr(), w.stride(0), dtype_of(w), w.size(0), w.size(1),
                                 id.data_ptr<int64_t>(), id.numel(), vocab_start, out.data_ptr(),
                                 c10::cuda::getCurrentCUDAStream(w.device().index()).stream()),
               "embedding_forward");
  return out;
}

at::Tensor embedding_scatter(const at::Tensor& grad, const at::Tensor& ids, int64_t vocab_start,
                             int64_t num_local, int64_t padding_idx) {
  const char* op = "vocab_parallel_embedding_backward";
  TORCH_CHECK(grad.is_cuda() && grad.dim() == 2, "tpx: embedding_scatter needs 2-D CUDA grad");
  TORCH_CHECK_VALUE(grad.size(0) == ids.numel(), "tpx.", op, ": the output gradient has ",
                    grad.size(0), " rows for ", ids.numel(), " ids");
  check_on(ids, grad, op, "ids");
  const c10::cuda::CUDAGuard guard(grad.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(grad.device().index()).stream();
  const at::Tensor g = dense_rows(grad);
  const at::Tensor id = ids.reshape({-1}).contiguous();
  const int64_t count = id.numel(), dim = g.size(1);

  // 16-bit gradients take the sorted kernel: the atomic one needs an fp32 accumulation table
  // of the whole shard ([num_local, dim], twice the gradient's bytes, then a cast), where the
  // sorted one needs fp32 scratch for the ids only. On an H200 (bf16, 8192 ids into a
  // 128256 x 4096 table) it was also faster: 1.57 ms against 1.86 ms, 65 MiB against 2 GiB
  // beyond the gradient (benchmarks/bench_gpu.py).
  if (at::globalContext().deterministicAlgorithms() || g.scalar_type() != at::kFloat) {
    // Ids this shard does not hold (and the padding row) sort last under the key num_local.
    const at::Tensor local = id - vocab_start;
    at::Tensor valid = (local >= 0) & (local < num_local);
    if (padding_idx >= 0) valid = valid & (local != padding_idx);
    const at::Tensor keys = at::where(valid, local, at::scalar_tensor(num_local, local.options()));
    auto [sorted, perm] = at::sort(keys, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    at::Tensor grad_weight = at::zeros({num_local, dim}, g.options());
    const int64_t ws = embedding_backward_sorted_workspace(count, dim);
    at::Tensor workspace = at::empty({ws}, g.options().dtype(at::kFloat));
    check_launch(embedding_backward_sorted(g.data_ptr(), g.stride(0), dtype_of(g), count, dim,
                                           sorted.data_ptr<int64_t>(), perm.data_ptr<int64_t>(),
                                           num_local, grad_weight.data_ptr(),
                                           ws > 0 ? workspace.data_ptr<float>() : nullptr,
                                           stream),
                 "embedding_backward_sorted");
    return grad_weight;
  }

  at::Tensor acc = at::zeros({num_local, dim}, g.options().dtype(at::kFloat));
  check_launch(embedding_backward_atomic(g.data_ptr(), g.stride(0), dtype_of(g), count, dim,
                                         id.data_ptr<int64_t>(), vocab_start, num_local,
                                         padding_idx, acc.data_ptr<float>(), stream),
               "embedding_backward_atomic");
  return acc;
}

}  // namespace cuda
}  // namespace tpx
