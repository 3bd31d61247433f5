// The one place where tpx launches a kernel. Under nvcc this is the triple-chevron launch; in
// the test build, where the CUDA sources are compiled as C++ on the CPU against the emulation
// layer of the tests (which defines TPX_CUDA_EMULATION), it is that layer's launcher, which
// runs every block of the grid with its threads as concurrent fibers.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

namespace tpx {
namespace cuda {
namespace detail {

// kernel<<<grid, block, shared_bytes, stream>>>(args...). The arguments convert to the
// kernel's parameter types as in a call.
template <typename... Params, typename... Args>
inline void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                          cudaStream_t stream, Args&&... args) {
#if defined(TPX_CUDA_EMULATION)
  tpx_emu::launch(kernel, grid, block, shared_bytes, stream, std::forward<Args>(args)...);
#else
  kernel<<<grid, block, shared_bytes, stream>>>(std::forward<Args>(args)...);
#endif
}

}  // namespace detail
}  // namespace cuda
}  // namespace tpx
