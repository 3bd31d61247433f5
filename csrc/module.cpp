// The Python extension module tpx._C. Importing it loads the operator library (ops.cpp);
// the only Python-level function it adds describes how the extension was built.
#include <torch/extension.h>
#include <torch/version.h>

#include <string>

#include "common/comm_stats.h"
#include "common/memory_stats.h"
#include "common/process_group.h"
#include "overlap/collective_matmul.h"

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
}
