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

// All-gathers `local` (contiguous) of every rank into `out`: [world * local.size(0), ...],
// rank-major.
void all_gather_into(c10d::ProcessGroup& pg, const at::Tensor& out, const at::Tensor& local);

}  // namespace tpx
