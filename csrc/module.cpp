// The Python extension module tpx._C. Importing it loads the operator library (ops.cpp);
// the only Python-level function it adds describes how the extension was built.
#include <torch/extension.h>
#include <torch/version.h>

#include <string>

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

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "tpx C++/CUDA extension: overlapped collective matmuls (torch.ops.tpx.*)";
  m.def("build_info", &build_info, "How this tpx extension was built.");
}
