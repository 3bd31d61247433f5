// Process-group plumbing shared by the engine and the vocab-parallel ops.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <string>
#include <vector>

namespace tpx {

// The c10d::ProcessGroup registered under `name` (ProcessGroup.group_name in Python), or an
// error that says how to obtain a valid one.
c10::intrusive_ptr<c10d::ProcessGroup> resolve_group(const std::string& name);

// Collectives in flight, and the buffers they read or write.
struct Pending {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<at::Tensor> keep_alive;
  void wait() {
    for (auto& w : works) w->wait();
    works.clear();
    keep_alive.clear();
  }
};

// The bytes of `t`'s elements: numel * element size.
int64_t nbytes(const at::Tensor& t);

// All-gathers `local` (contiguous) of every rank into `out`: [world * local.size(0), ...],
// rank-major, and waits.
void all_gather_into(c10d::ProcessGroup& pg, const at::Tensor& out, const at::Tensor& local);

// The collectives tpx issues, asynchronous, each counted once in the communication
// statistics (common/comm_stats.h). Every collective of tpx goes through these.
using WorkPtr = c10::intrusive_ptr<c10d::Work>;
// out = [world * in.size(0), ...] rank-major; both contiguous.
WorkPtr all_gather_base(c10d::ProcessGroup& pg, const at::Tensor& out, const at::Tensor& in);
// out = this rank's block of the sum over ranks of in ([world * out.size(0), ...]).
WorkPtr reduce_scatter_base(c10d::ProcessGroup& pg, const at::Tensor& out, const at::Tensor& in);
// In-place sum over ranks. On a two-rank gloo group (CPU tensors) this is one send/recv
// exchange and a local add (see process_group.cpp; TPX_GLOO_ALLREDUCE=gloo opts out).
WorkPtr all_reduce(c10d::ProcessGroup& pg, const at::Tensor& buf);
// In-place sum over ranks into `root`'s buffer (root = rank within pg).
WorkPtr reduce_to(c10d::ProcessGroup& pg, const at::Tensor& buf, int64_t root);
// In-place copy of `root`'s buffer (root = rank within pg).
WorkPtr broadcast(c10d::ProcessGroup& pg, const at::Tensor& buf, int64_t root);

}  // namespace tpx
