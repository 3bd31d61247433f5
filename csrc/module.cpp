// The Python extension module tpx._C. Importing it loads the operator library (ops.cpp); the
// module adds plain functions (how the extension was built, communication statistics, tpx's
// own groups) and `direct`: the kernels of the layers' common calls, callable without the
// dispatcher.
#include <torch/extension.h>
#include <torch/version.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/comm_stats.h"
#include "common/memory_stats.h"
#include "common/process_group.h"
#include "overlap/collective_matmul.h"
#include "vocab/embedding.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/record_function.h>
#include <torch/csrc/Exceptions.h>

namespace {

pybind11::dict build_info() {
  pybind11::dict info;
  // Ops whose CUDA dispatch runs kernels of tpx's own (csrc/cuda) for their per-shard work;
  // the other ops run ATen kernels on either device.
  pybind11::list kernels;
#ifdef TPX_WITH_CUDA
  info["cuda"] = true;
  for (const char* op : {"vocab_parallel_cross_entropy", "vocab_parallel_cross_entropy_backward",
                         "vocab_parallel_cross_entropy_backward_", "vocab_parallel_embedding",
                         "vocab_parallel_embedding_backward", "linear_cross_entropy",
                         "linear_cross_entropy_backward"})
    kernels.append(op);
#else
  info["cuda"] = false;
#endif
  info["cuda_kernels"] = kernels;
  info["torch_version"] = std::to_string(TORCH_VERSION_MAJOR) + "." +
                          std::to_string(TORCH_VERSION_MINOR) + "." +
                          std::to_string(TORCH_VERSION_PATCH);
  info["default_chunks"] = tpx::default_chunks();
  return info;
}

// {(group name, kind): (calls, bytes)} since start or the last reset.
pybind11::dict comm_counters() {
  pybind11::dict out;
  for (const auto& [key, counter] : tpx::comm_counters()) {
    out[pybind11::make_tuple(key.first, key.second)] =
        pybind11::make_tuple(counter.calls, counter.bytes);
  }
  return out;
}

void count_collective(const std::string& group_name, const std::string& kind, int64_t bytes) {
  using tpx::Collective;
  Collective c;
  if (kind == "all_gather") c = Collective::kAllGather;
  else if (kind == "reduce_scatter") c = Collective::kReduceScatter;
  else if (kind == "all_reduce") c = Collective::kAllReduce;
  else if (kind == "broadcast") c = Collective::kBroadcast;
  else if (kind == "reduce") c = Collective::kReduce;
  else if (kind == "scatter") c = Collective::kScatter;
  else TORCH_CHECK_VALUE(false, "tpx: unknown collective kind '", kind, "'");
  tpx::count_collective(group_name, c, bytes);
}


// tpx._C.direct.<op>: the kernel of torch.ops.tpx.<op> called from Python without the
// dispatcher, whose boxed call from Python (argument parsing against the schema, the Python
// and autograd keys) costs a few microseconds a call, about what a small GEMM costs. For the
// layers' common call only (python/tpx/ops/core.py, lean_mode): plain CPU or CUDA tensors, no
// gradient recorded, no dispatch mode or functorch transform active; anything else takes
// torch.ops.tpx. What the dispatcher would do for such a call is done here: the kernel runs
// below autograd and without the GIL, the profiler records it under the operator's name (with
// its inputs when asked), and errors reach Python with the types torch.ops raises.
template <typename Fn, typename... Args>
auto direct(const char* name, Fn fn, const Args&... args) {
  HANDLE_TH_ERRORS
  pybind11::gil_scoped_release no_gil;
  at::AutoDispatchBelowAutograd below_autograd;
  RECORD_FUNCTION(name, std::vector<c10::IValue>({c10::IValue(args)...}));
  return fn(args...);
  END_HANDLE_TH_ERRORS_PYBIND
}

using Tensor = at::Tensor;
using OptTensor = std::optional<at::Tensor>;
using OptInt = std::optional<int64_t>;
using Str = std::string;

void add_direct(pybind11::module_& m) {
  auto d = m.def_submodule("direct", "tpx's kernels called without the dispatcher (the "
                           "layers' common call; see tpx.ops.core.lean_mode).");
  d.def("replicated_matmul", [](const Tensor& a, const Tensor& b, const Str& group, OptInt chunks,
                                const OptTensor& bias) {
    return direct("tpx::replicated_matmul", tpx::replicated_matmul, a, b, group, chunks, bias);
  });
  d.def("replicated_matmul_backward",
        [](const Tensor& grad, const Tensor& a, const Tensor& b, const Str& group, OptInt chunks,
           bool need_a, bool need_b, bool bias_grad) {
          return direct("tpx::replicated_matmul_backward", tpx::replicated_matmul_backward, grad,
                        a, b, group, chunks, need_a, need_b, bias_grad);
        });
  d.def("matmul_all_reduce", [](const Tensor& a, const Tensor& b, const Str& group, OptInt chunks,
                                const OptTensor& bias) {
    return direct("tpx::matmul_all_reduce", tpx::matmul_all_reduce, a, b, group, chunks, bias);
  });
  d.def("matmul_all_reduce_backward", [](const Tensor& grad, const Tensor& a, const Tensor& b,
                                         bool need_a, bool need_b, bool bias_grad) {
    return direct("tpx::matmul_all_reduce_backward", tpx::matmul_all_reduce_backward, grad, a, b,
                  need_a, need_b, bias_grad);
  });
  d.def("vocab_parallel_embedding", [](const Tensor& weight, const Tensor& ids,
                                       int64_t vocab_start, const Str& group, OptInt scatter_dim,
                                       int64_t padding_idx) {
    return direct("tpx::vocab_parallel_embedding", tpx::vocab_parallel_embedding, weight, ids,
                  vocab_start, group, scatter_dim, padding_idx);
  });
  // the lookup with the ids' range checked in the same call (CPU ids; see embedding.h)
  d.def("vocab_parallel_lookup", [](const Tensor& weight, const Tensor& ids, int64_t vocab_start,
                                    int64_t num_embeddings, const Str& group,
                                    int64_t padding_idx) {
    return direct("tpx::vocab_parallel_embedding", tpx::vocab_parallel_lookup, weight, ids,
                  vocab_start, num_embeddings, group, padding_idx);
  });
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "tpx C++/CUDA extension: overlapped collective matmuls (torch.ops.tpx.*)";
  m.def("build_info", &build_info, "How this tpx extension was built.");
  m.def("pipeline_depth", &tpx::pipeline_depth, pybind11::arg("chunks"), pybind11::arg("extent"),
        pybind11::arg("bytes"), "The pipeline depth the ops pick (see collective_matmul.h).");
  m.def("comm_counters", &comm_counters,
        "Collectives issued by tpx: {(group_name, kind): (calls, bytes)}.");
  m.def("enable_cpu_memory_stats", &tpx::enable_cpu_memory_stats,
        "Counts CPU tensor allocations from now on (all threads).");
  m.def("cpu_memory_stats", &tpx::cpu_memory_stats, "(bytes allocated now, peak since reset).");
  m.def("reset_cpu_memory_peak", &tpx::reset_cpu_memory_peak, "Peak := current.");
  m.def("count_collective", &count_collective,
        "Records a collective issued from Python (group_name, kind, bytes).");
  m.def("register_owned_group", &tpx::register_owned_group, pybind11::arg("user_name"),
        pybind11::arg("owned_name"), pybind11::arg("pair_exchange"),
        "Makes `owned_name` the group tpx's ops run on for the user's group `user_name`.");
  auto testing = m.def_submodule("testing", "Test facilities; not part of tpx's API.");
  testing.def("arm_fault", &tpx::testing::arm_fault, pybind11::arg("n"),
              "The n-th collective posted from now on raises after it was posted (0 disarms).");
  testing.def("wait_twice", &tpx::testing::wait_twice, pybind11::arg("buf"),
              pybind11::arg("group_name"), "One all-reduce, waited on twice; what each wait did.");
  m.def("group_broken_reason", &tpx::group_broken_reason, pybind11::arg("name"),
        "Why tpx marked the group `name` unusable, or None.");
  m.def("mark_group_broken", &tpx::mark_group_broken, pybind11::arg("name"), pybind11::arg("why"),
        "Makes every later tpx op on the group `name` raise `why` (the first cause is kept).");
  add_direct(m);
}
