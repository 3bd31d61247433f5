// Process-group plumbing shared by the engine and the vocab-parallel ops.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <exception>
#include <optional>
#include <string>
#include <vector>

namespace tpx {

// The process group tpx runs its collectives on for the group registered under `name`
// (ProcessGroup.group_name in Python): tpx's own copy of it when one was registered
// (register_owned_group), else the group itself. Raises an error that says how to obtain a
// valid group, or that the group was marked broken by an earlier failure.
c10::intrusive_ptr<c10d::ProcessGroup> resolve_group(const std::string& name);

// Makes `owned_name` (a group tpx created with the ranks of `user_name`) the group tpx's ops
// use for `user_name`; `pair_exchange` is what its ranks agreed for two-rank sums.
void register_owned_group(const std::string& user_name, const std::string& owned_name,
                          bool pair_exchange);

// The name of tpx's own group for `user_name`, if it has a live one.
std::optional<std::string> owned_group_name(const std::string& user_name);

// After a failure that leaves the ranks of a group out of step (a send or receive that could
// not be completed), every later tpx op on the group raises `why` instead of pairing the
// wrong messages.
void mark_group_broken(const std::string& name, const std::string& why);
std::optional<std::string> group_broken_reason(const std::string& name);

// Collectives in flight, and the buffers they read or write. They are never abandoned: wait()
// completes every one even when one fails (and rethrows the first failure), and the destructor
// completes them when an exception unwinds past a Pending that was not waited on, so that the
// ranks stay in step on the group. A collective that cannot be completed marks `group` broken.
// The error a failed collective is reported with: c10::DistBackendError (Python:
// torch.distributed.DistBackendError, a RuntimeError), whatever the backend raised (gloo
// raises plain runtime errors), so that tpx's Python side tells a communication failure by its
// type, not its text. A c10::ValueError tpx raised about the arguments, and a DistError, keep
// their type.
std::exception_ptr as_collective_failure(std::exception_ptr e);

struct Pending {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<at::Tensor> keep_alive;
  std::string group;  // for mark_group_broken; set by whoever posts the works
  Pending() = default;
  Pending(Pending&&) = default;
  Pending& operator=(Pending&& other) noexcept {
    drain();
    works = std::move(other.works);
    keep_alive = std::move(other.keep_alive);
    group = std::move(other.group);
    other.works.clear();
    other.keep_alive.clear();
    return *this;
  }
  Pending(const Pending&) = delete;
  Pending& operator=(const Pending&) = delete;
  ~Pending() { drain(); }
  void wait();

 private:
  // Completes what is in flight without throwing; returns the first failure.
  std::exception_ptr drain() noexcept;
};

// An uninitialised buffer that an all-gather writes into: a normal tensor even under
// inference mode (gloo's all-gather in torch 2.5 copies into its output on gloo's own thread,
// where inference mode is off, and refuses an inference tensor there).
at::Tensor gather_buffer(at::IntArrayRef sizes, const at::TensorOptions& options);

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
// In-place maximum over ranks (gloo's or NCCL's all-reduce with ReduceOp::MAX; counted as an
// all-reduce).
WorkPtr all_reduce_max(c10d::ProcessGroup& pg, const at::Tensor& buf);
// In-place sum over ranks into `root`'s buffer (root = rank within pg).
WorkPtr reduce_to(c10d::ProcessGroup& pg, const at::Tensor& buf, int64_t root);
// In-place copy of `root`'s buffer (root = rank within pg).
WorkPtr broadcast(c10d::ProcessGroup& pg, const at::Tensor& buf, int64_t root);

// Test facilities (tpx._C.testing), not part of tpx's API.
namespace testing {
// The n-th collective this process posts from now on raises right after it was posted
// (n = 0 disarms).
void arm_fault(int64_t n);
// All-reduces `buf` over the group and waits twice on the same Work, returning what each
// wait did ("ok", "false" or "raised: <message>").
std::vector<std::string> wait_twice(const at::Tensor& buf, const std::string& group_name);
}  // namespace testing

}  // namespace tpx
