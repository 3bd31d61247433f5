// The Python extension module tpx._C. Importing it loads the operator library (ops.cpp);
// the only Python-level function it adds describes how the extension was built.
#include <torch/extension.h>
#include <torch/version.h>

#include <string>

#include "overlap/collective_matmul.h"

namespace {

pybind11::dict build_info() {
  pybind11::dict info;
#ifdef TPX_WITH_CUDA
  info["cuda"] = true;
#else
  info["cuda"] = false;
#endif
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
