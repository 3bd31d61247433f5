#include "common/process_group.h"

#include "common/comm_stats.h"

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
  all_gather_base(pg, out, local)->wait();
}

namespace {
int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }
}  // namespace

WorkPtr all_gather_base(c10d::ProcessGroup& pg, const at::Tensor& out, const at::Tensor& in) {
  at::Tensor o = out, i = in;
  count_collective(pg, Collective::kAllGather, nbytes(in));
  return pg._allgather_base(o, i);
}

WorkPtr reduce_scatter_base(c10d::ProcessGroup& pg, const at::Tensor& out, const at::Tensor& in) {
  at::Tensor o = out, i = in;
  count_collective(pg, Collective::kReduceScatter, nbytes(out));
  return pg._reduce_scatter_base(o, i);
}

WorkPtr all_reduce(c10d::ProcessGroup& pg, const at::Tensor& buf) {
  std::vector<at::Tensor> bufs{buf};
  count_collective(pg, Collective::kAllReduce, nbytes(buf));
  return pg.allreduce(bufs);
}

WorkPtr broadcast(c10d::ProcessGroup& pg, const at::Tensor& buf, int64_t root) {
  std::vector<at::Tensor> bufs{buf};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  count_collective(pg, Collective::kBroadcast, nbytes(buf));
  return pg.broadcast(bufs, opts);
}

}  // namespace tpx
