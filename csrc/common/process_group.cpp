#include "common/process_group.h"

#include "common/comm_stats.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <cstdlib>
#include <cstring>

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

namespace {

// The tag of tpx's pairwise exchanges (gloo matches a receive to the sends of the same tag in
// the order they were posted; every rank posts its exchanges in the same order).
constexpr int kExchangeTag = 0x7470;

// An all-reduce of a two-rank group done as one exchange: each rank sends its buffer to the
// other and adds the one it receives. Gloo's all-reduce takes two steps (reduce-scatter,
// then all-gather) through its worker thread for the same bytes; the exchange was faster at
// every size benchmarks/bench_collectives.py measures (4 KiB - 8 MiB), and posting the send
// before the receive was measured faster than the reverse. IEEE addition is commutative, so
// a + b on one rank and b + a on the other are the same bits.
class PairSumWork : public c10d::Work {
 public:
  PairSumWork(at::Tensor buf, at::Tensor peer, WorkPtr send, WorkPtr recv)
      : buf_(std::move(buf)), peer_(std::move(peer)), send_(std::move(send)),
        recv_(std::move(recv)) {}

  bool wait(std::chrono::milliseconds timeout) override {
    if (!summed_) {
      recv_->wait(timeout);
      send_->wait(timeout);  // buf_ is read by the send until it completes
      buf_.add_(peer_);
      summed_ = true;
      peer_ = at::Tensor();
    }
    return true;
  }

  bool isCompleted() override { return summed_; }

 private:
  at::Tensor buf_, peer_;
  WorkPtr send_, recv_;
  bool summed_ = false;
};

// Read on every call (a getenv is negligible next to a collective), so a benchmark can time
// both algorithms in one run.
bool pair_exchange_enabled() {
  const char* env = std::getenv("TPX_GLOO_ALLREDUCE");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "exchange") == 0) return true;
  TORCH_CHECK_VALUE(std::strcmp(env, "gloo") == 0,
                    "TPX_GLOO_ALLREDUCE must be 'exchange' (the default: a two-rank all-reduce "
                    "is one send/recv exchange) or 'gloo' (gloo's own all-reduce); got '", env,
                    "'");
  return false;
}

bool uses_pair_exchange(c10d::ProcessGroup& pg, const at::Tensor& buf) {
  if (pg.getSize() != 2 || !buf.device().is_cpu() || !buf.is_contiguous() ||
      !pair_exchange_enabled()) {
    return false;
  }
  try {
    return pg.getBackend(c10::DeviceType::CPU)->getBackendName() == "gloo";
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

WorkPtr all_reduce(c10d::ProcessGroup& pg, const at::Tensor& buf) {
  count_collective(pg, Collective::kAllReduce, nbytes(buf));
  if (uses_pair_exchange(pg, buf)) {
    const int peer_rank = 1 - pg.getRank();
    at::Tensor peer = at::empty_like(buf);
    std::vector<at::Tensor> out{buf}, in{peer};
    WorkPtr send = pg.send(out, peer_rank, kExchangeTag);
    WorkPtr recv = pg.recv(in, peer_rank, kExchangeTag);
    return c10::make_intrusive<PairSumWork>(buf, std::move(peer), std::move(send),
                                            std::move(recv));
  }
  std::vector<at::Tensor> bufs{buf};
  return pg.allreduce(bufs);
}

WorkPtr broadcast(c10d::ProcessGroup& pg, const at::Tensor& buf, int64_t root) {
  std::vector<at::Tensor> bufs{buf};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  count_collective(pg, Collective::kBroadcast, nbytes(buf));
  return pg.broadcast(bufs, opts);
}

WorkPtr reduce_to(c10d::ProcessGroup& pg, const at::Tensor& buf, int64_t root) {
  std::vector<at::Tensor> bufs{buf};
  c10d::ReduceOptions opts;
  opts.rootRank = root;
  count_collective(pg, Collective::kReduce, nbytes(buf));
  return pg.reduce(bufs, opts);
}

}  // namespace tpx
