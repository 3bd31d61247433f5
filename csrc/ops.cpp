// The tpx operator library: every schema in one place, and the CPU and CUDA kernels.
//
// The ops are device-generic (ATen kernels plus c10d collectives), so the same function
// serves both dispatch keys; in CUDA builds the vocab-parallel loss and embedding branch
// inside to their own kernels (csrc/cuda) for CUDA tensors. Fake (meta) implementations for
// torch.compile are registered from Python (tpx/ops.py).
#include <torch/library.h>

#include "common/gemm.h"
#include "overlap/collective_matmul.h"
#include "overlap/multidim.h"
#include "vocab/cross_entropy.h"
#include "vocab/embedding.h"
#include "vocab/linear_cross_entropy.h"

TORCH_LIBRARY(tpx, m) {
  m.def(
      "all_gather_matmul(Tensor a, Tensor b, int gather_dim, str group_name, int? chunks=None, "
      "Tensor? bias=None) -> (Tensor, Tensor)");
  m.def(
      "all_gather_matmul_backward(Tensor grad_out, Tensor? grad_a_gathered, Tensor a_gathered, "
      "Tensor b, int gather_dim, str group_name, int? chunks, bool need_a, bool need_b, "
      "bool bias_grad) -> (Tensor?, Tensor?, Tensor?)");
  m.def(
      "matmul_reduce_scatter(Tensor a, Tensor b, int scatter_dim, str group_name, "
      "int? chunks=None, Tensor? bias=None) -> Tensor");
  m.def(
      "matmul_reduce_scatter_backward(Tensor grad_out, Tensor a, Tensor b, int scatter_dim, "
      "str group_name, int? chunks, bool need_a, bool need_b, bool bias_grad) "
      "-> (Tensor?, Tensor?, Tensor?)");
  m.def(
      "matmul_all_reduce(Tensor a, Tensor b, str group_name, int? chunks=None, "
      "Tensor? bias=None) -> Tensor");
  m.def(
      "replicated_matmul(Tensor a, Tensor b, str group_name, int? chunks=None, "
      "Tensor? bias=None) -> Tensor");
  m.def(
      "replicated_matmul_backward(Tensor grad_out, Tensor a, Tensor b, str group_name, "
      "int? chunks, bool need_a, bool need_b, bool bias_grad) -> (Tensor?, Tensor?, Tensor?)");
  m.def(
      "vocab_parallel_cross_entropy(Tensor logits, Tensor target, int vocab_start, "
      "int vocab_size, str group_name, int ignore_index, float label_smoothing, "
      "bool inplace_backward) -> (Tensor, Tensor)");
  m.def(
      "vocab_parallel_cross_entropy_backward(Tensor grad_loss, Tensor logits, Tensor target, "
      "Tensor lse, int vocab_start, int vocab_size, int ignore_index, float label_smoothing) "
      "-> Tensor");
  m.def(
      "vocab_parallel_cross_entropy_backward_(Tensor grad_loss, Tensor(a!) logits, "
      "Tensor target, Tensor lse, int vocab_start, int vocab_size, int ignore_index, "
      "float label_smoothing) -> ()");
  m.def(
      "vocab_parallel_embedding(Tensor weight, Tensor ids, int vocab_start, str group_name, "
      "int? scatter_dim, int padding_idx) -> Tensor");
  m.def(
      "vocab_parallel_embedding_backward(Tensor grad_out, Tensor ids, int vocab_start, "
      "int num_local, int padding_idx, str group_name, int? scatter_dim) -> Tensor");
  m.def(
      "linear_cross_entropy(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
      "int vocab_start, int vocab_size, str group_name, int chunk_size, int ignore_index, "
      "float label_smoothing) -> (Tensor, Tensor)");
  m.def(
      "linear_cross_entropy_backward(Tensor grad_loss, Tensor hidden, Tensor weight, "
      "Tensor? bias, Tensor target, Tensor lse, int vocab_start, int vocab_size, "
      "str group_name, int chunk_size, int ignore_index, float label_smoothing, "
      "bool need_hidden, bool need_weight, bool need_bias) -> (Tensor?, Tensor?, Tensor?)");
  // Multi-dimensional tensor parallelism (csrc/overlap/multidim.h).
  m.def(
      "linear_2d(Tensor x, Tensor weight, Tensor? bias, str row_group, str col_group, "
      "str? depth_group=None) -> Tensor");
  m.def(
      "linear_2d_backward(Tensor grad_out, Tensor x, Tensor weight, str row_group, "
      "str col_group, str? depth_group, bool need_x, bool need_weight, bool need_bias) "
      "-> (Tensor?, Tensor?, Tensor?)");
  m.def(
      "linear_3d(Tensor x, Tensor weight, Tensor? bias, str input_group, str batch_group, "
      "str hidden_group, int? chunks=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "linear_3d_backward(Tensor grad_out, Tensor x_gathered, Tensor weight_gathered, "
      "str input_group, str batch_group, str hidden_group, int? chunks, bool need_x, "
      "bool need_weight, bool need_bias) -> (Tensor?, Tensor?, Tensor?)");
  m.def(
      "matmul_all_reduce_backward(Tensor grad_out, Tensor a, Tensor b, bool need_a, "
      "bool need_b, bool bias_grad) -> (Tensor?, Tensor?, Tensor?)");
  m.def("local_matmul(Tensor a, Tensor b, Tensor? bias=None) -> Tensor");
  // No tensor argument to dispatch on: one kernel for every backend.
  m.def("cpu_gemm_backend() -> str", &tpx::cpu_gemm_backend);
  m.def("mesh_all_reduce(Tensor x, str group) -> Tensor");
  m.def("mesh_all_gather(Tensor x, str group) -> Tensor");
}

#define TPX_REGISTER_OPS(m)                                           \
  m.impl("all_gather_matmul", &tpx::all_gather_matmul);                              \
  m.impl("all_gather_matmul_backward", &tpx::all_gather_matmul_backward);            \
  m.impl("matmul_reduce_scatter", &tpx::matmul_reduce_scatter);                      \
  m.impl("matmul_reduce_scatter_backward", &tpx::matmul_reduce_scatter_backward);    \
  m.impl("matmul_all_reduce", &tpx::matmul_all_reduce);                              \
  m.impl("replicated_matmul", &tpx::replicated_matmul);                              \
  m.impl("matmul_all_reduce_backward", &tpx::matmul_all_reduce_backward);            \
  m.impl("local_matmul", &tpx::local_matmul);                                        \
  m.impl("replicated_matmul_backward", &tpx::replicated_matmul_backward);              \
  m.impl("vocab_parallel_cross_entropy", &tpx::vocab_parallel_cross_entropy);          \
  m.impl("vocab_parallel_cross_entropy_backward",                                      \
         &tpx::vocab_parallel_cross_entropy_backward);                                 \
  m.impl("vocab_parallel_cross_entropy_backward_",                                     \
         &tpx::vocab_parallel_cross_entropy_backward_);                                \
  m.impl("vocab_parallel_embedding", &tpx::vocab_parallel_embedding);                  \
  m.impl("vocab_parallel_embedding_backward", &tpx::vocab_parallel_embedding_backward); \
  m.impl("linear_cross_entropy", &tpx::linear_cross_entropy);                          \
  m.impl("linear_cross_entropy_backward", &tpx::linear_cross_entropy_backward)

TORCH_LIBRARY_IMPL(tpx, CPU, m) { TPX_REGISTER_OPS(m); }

TORCH_LIBRARY_IMPL(tpx, CUDA, m) { TPX_REGISTER_OPS(m); }

#define TPX_REGISTER_MULTIDIM_OPS(m)                                                   \
  m.impl("linear_2d", &tpx::linear_2d);                                                \
  m.impl("linear_2d_backward", &tpx::linear_2d_backward);                              \
  m.impl("linear_3d", &tpx::linear_3d);                                                \
  m.impl("linear_3d_backward", &tpx::linear_3d_backward);                              \
  m.impl("mesh_all_reduce", &tpx::mesh_all_reduce);                                    \
  m.impl("mesh_all_gather", &tpx::mesh_all_gather)

TORCH_LIBRARY_IMPL(tpx, CPU, m) { TPX_REGISTER_MULTIDIM_OPS(m); }

TORCH_LIBRARY_IMPL(tpx, CUDA, m) { TPX_REGISTER_MULTIDIM_OPS(m); }
