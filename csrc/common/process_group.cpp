#include "common/process_group.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

// ProcessGroup::_allgather_base is the spelling every supported torch release has (>= 2.5);
// newer releases mark it deprecated in favour of all_gather_single.
#if defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif

namespace tpx {

c10::intrusive_ptr<c10d::ProcessGroup> resolve_group(const std::string& name) {
  try {
    return c10d::resolve_process_group(name);
  } catch (const std::exception&) {
    TORCH_CHECK(false, "tpx: no process group is registered under the name '", name,
                "'. Call torch.distributed.init_process_group() first and pass a ProcessGroup "
                "(or a 1-D DeviceMesh) of this process as `group`.");
  }
}

void all_gather_into(c10d::ProcessGroup& pg, const at::Tensor& out, const at::Tensor& local) {
  at::Tensor o = out, in = local;
  pg._allgather_base(o, in)->wait();
}

}  // namespace tpx
