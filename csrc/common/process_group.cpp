#include "common/process_group.h"

#include "common/comm_stats.h"

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#if defined(__linux__)
#include <dirent.h>
#include <sched.h>
#include <sys/types.h>
#endif

// ProcessGroup::_allgather_base is the spelling every supported torch release has (>= 2.5);
// newer releases mark it deprecated in favour of all_gather_single.
#if defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif

namespace tpx {

namespace {

// Whether `pg` runs its CPU collectives on gloo.
bool cpu_backend_is_gloo(c10d::ProcessGroup& pg) {
  try {
    return pg.getBackend(c10::DeviceType::CPU)->getBackendName() == "gloo";
  } catch (const std::exception&) {
    return false;
  }
}

// Gloo's TCP transport runs one event-loop thread per process group (named "gloo_tcp_loop").
// Its event handler only try-locks the pair a socket event is for; when another thread holds
// the pair's lock, the handler returns with the event unconsumed and epoll reports it again at
// once, so the loop thread spins until the lock is released. The lock holder is the thread
// that posts a send or receive (the rank's own thread for send/recv, gloo's worker thread for
// its collectives), and it often runs on the same core: when a message from the peer wakes the
// loop thread while that thread is inside the pair's lock, the kernel's wake-up preemption
// hands the core to the loop thread, which then spins until the next scheduler tick (4 ms at
// HZ=250) lets the lock holder finish. Measured on a 2-core VM with one rank per core, a
// 256 KiB exchange after 1.5 ms of compute took 2.4 ms at the median instead of 0.1 ms.
//
// SCHED_BATCH tells the kernel not to preempt the running thread when a batch thread wakes;
// the loop thread then runs as soon as the poster releases the lock and blocks (or at its
// turn), and the spin disappears. It changes nothing else for a thread of nice 0.
bool gloo_loop_batch_enabled() {
  const char* env = std::getenv("TPX_GLOO_LOOP_POLICY");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "batch") == 0) return true;
  TORCH_CHECK_VALUE(std::strcmp(env, "keep") == 0,
                    "TPX_GLOO_LOOP_POLICY must be 'batch' (the default: gloo's event-loop "
                    "threads run as SCHED_BATCH) or 'keep' (leave them as gloo starts them); "
                    "got '", env, "'");
  return false;
}

// Every gloo event-loop thread of this process that still has the default policy
// (SCHED_OTHER) becomes SCHED_BATCH. A thread given another policy is left as it is; a
// refusal (a sandbox without sched_setscheduler) leaves gloo's default.
void batch_gloo_loop_threads() {
#if defined(__linux__)
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return;
  while (const dirent* entry = readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    const pid_t tid = static_cast<pid_t>(std::atol(entry->d_name));
    char path[64], comm[32] = {0};
    std::snprintf(path, sizeof(path), "/proc/self/task/%d/comm", static_cast<int>(tid));
    FILE* f = std::fopen(path, "r");
    if (f == nullptr) continue;  // the thread has exited
    const bool named = std::fgets(comm, sizeof(comm), f) != nullptr;
    std::fclose(f);
    comm[std::strcspn(comm, "\n")] = '\0';
    if (!named || std::strcmp(comm, "gloo_tcp_loop") != 0) continue;
    if (sched_getscheduler(tid) != SCHED_OTHER) continue;
    sched_param param{};
    (void)sched_setscheduler(tid, SCHED_BATCH, &param);
  }
  closedir(dir);
#endif
}

// The first time tpx uses a gloo group, its event-loop thread (and any other gloo loop thread
// of the process) is switched. Groups are remembered weakly: a group created later at the
// address of a destroyed one is handled anew.
void prepare_gloo_threads(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  static std::mutex mutex;
  static std::vector<c10::weak_intrusive_ptr<c10d::ProcessGroup>> seen;
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& w : seen) {
    if (w._unsafe_get_target() == pg.get() && !w.expired()) return;
  }
  if (cpu_backend_is_gloo(*pg) && gloo_loop_batch_enabled()) batch_gloo_loop_threads();
  seen.erase(std::remove_if(seen.begin(), seen.end(), [](const auto& w) { return w.expired(); }),
             seen.end());
  seen.emplace_back(pg);
}

}  // namespace

c10::intrusive_ptr<c10d::ProcessGroup> resolve_group(const std::string& name) {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  try {
    pg = c10d::resolve_process_group(name);
  } catch (const std::exception&) {
    TORCH_CHECK(false, "tpx: no process group is registered under the name '", name,
                "'. Call torch.distributed.init_process_group() first and pass a ProcessGroup "
                "(or a 1-D DeviceMesh) of this process as `group`.");
  }
  prepare_gloo_threads(pg);
  return pg;
}

void all_gather_into(c10d::ProcessGroup& pg, const at::Tensor& out, const at::Tensor& local) {
  all_gather_base(pg, out, local)->wait();
}

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

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

// The tags of tpx's pairwise exchanges (gloo matches a receive to the sends of the same tag in
// the order they were posted; every rank posts its exchanges in the same order).
constexpr int kExchangeTag = 0x7470;
constexpr int kStampTag = 0x7471;

// Each exchange carries a stamp: a constant, the sender's byte count and its dtype. Gloo
// accepts a message shorter than the posted receive, so without it a rank whose buffer is
// larger than its peer's would add a partly received buffer: a wrong answer. With it, that
// rank raises a ValueError; its peer, whose buffer is the smaller one, stops on gloo's own
// check ("Received data size doesn't match expected size"), as gloo's all-reduce does for the
// same mistake. Up to kPackedStampMaxBytes the stamp travels after the payload in one message
// (copying the payload costs less than a second message, which made a 4 KiB exchange a third
// slower when measured); above, it is a second, 24-byte message sent in parallel. Neither form
// changed the time of the benchmark's small MLP step measurably (0.97-1.02x without a stamp).
constexpr int64_t kStampMagic = 0x7470'7375'6d5f'7631;  // "tpsum_v1" in ASCII
constexpr int64_t kStampSlotBytes = 4 * sizeof(int64_t);  // 3 used; keeps sizes 16-aligned
constexpr int64_t kPackedStampMaxBytes = int64_t{1} << 20;

void write_stamp(int64_t* dst, const at::Tensor& buf) {
  dst[0] = kStampMagic;
  dst[1] = nbytes(buf);
  dst[2] = static_cast<int64_t>(buf.scalar_type());
}

// An all-reduce of a two-rank group done as one exchange: each rank sends its buffer to the
// other and adds the one it receives. Gloo's all-reduce takes two steps (reduce-scatter,
// then all-gather) through its worker thread for the same bytes; the exchange was faster at
// every size benchmarks/bench_collectives.py measures (4 KiB - 8 MiB), and posting the send
// before the receive was measured faster than the reverse. IEEE addition is commutative, so
// a + b on one rank and b + a on the other are the same bits.
class PairSumWork : public c10d::Work {
 public:
  // `peer` receives the peer's payload; the stamp it sent lands `stamp_at` bytes into
  // `stamp_in` (the storage of `peer` when packed); `keep` holds the buffers the sends read.
  PairSumWork(std::string group, int peer_rank, at::Tensor buf, at::Tensor peer,
              at::Tensor stamp_in, int64_t stamp_at, std::vector<at::Tensor> keep,
              std::vector<WorkPtr> sends, std::vector<WorkPtr> recvs)
      : group_(std::move(group)), peer_rank_(peer_rank), buf_(std::move(buf)),
        peer_(std::move(peer)), stamp_in_(std::move(stamp_in)), stamp_at_(stamp_at),
        keep_(std::move(keep)), sends_(std::move(sends)), recvs_(std::move(recvs)) {}

  bool wait(std::chrono::milliseconds timeout) override {
    if (summed_) return true;
    summed_ = true;
    for (auto& w : recvs_) w->wait(timeout);
    recvs_.clear();
    int64_t mine[3];
    write_stamp(mine, buf_);
    const auto* theirs = reinterpret_cast<const int64_t*>(
        static_cast<const uint8_t*>(stamp_in_.const_data_ptr()) + stamp_at_);
    const bool match = std::equal(mine, mine + 3, theirs);
    // The sends read buf_ and keep_ until they complete. After a mismatch the peer may already
    // have stopped, failing our send: the mismatch is the error to report.
    for (auto& w : sends_) {
      if (match) {
        w->wait(timeout);
      } else {
        try {
          w->wait(timeout);
        } catch (const std::exception&) {
        }
      }
    }
    sends_.clear();
    keep_.clear();
    if (!match) {
      const bool stamped = theirs[0] == kStampMagic;
      const std::string peer_has =
          stamped ? "has " + std::to_string(theirs[1]) + " bytes of " +
                        std::string(c10::toString(c10::ScalarType(theirs[2])))
                  : std::string("is smaller");
      peer_ = stamp_in_ = at::Tensor();
      TORCH_CHECK_VALUE(false, "tpx: the two ranks of process group '", group_, "' all-reduce "
                        "different buffers: this rank's has ", mine[1], " bytes of ",
                        buf_.scalar_type(), ", rank ", peer_rank_, "'s ", peer_has,
                        ". Every rank must call a tpx op with tensors of the same shape and "
                        "dtype (for example the same batch size); TPX_DEBUG_CHECKS=1 compares "
                        "every op's arguments across ranks before its collectives run.");
    }
    buf_.add_(peer_);
    peer_ = stamp_in_ = at::Tensor();
    return true;
  }

  bool isCompleted() override { return summed_; }

 private:
  std::string group_;
  int peer_rank_;
  at::Tensor buf_, peer_, stamp_in_;
  int64_t stamp_at_;
  std::vector<at::Tensor> keep_;
  std::vector<WorkPtr> sends_, recvs_;
  bool summed_ = false;
};

WorkPtr pair_exchange(c10d::ProcessGroup& pg, const at::Tensor& buf) {
  const int peer_rank = 1 - pg.getRank();
  const int64_t bytes = nbytes(buf);
  auto send = [&](const at::Tensor& t, int tag) {
    std::vector<at::Tensor> v{t};
    return pg.send(v, peer_rank, tag);
  };
  auto recv = [&](const at::Tensor& t, int tag) {
    std::vector<at::Tensor> v{t};
    return pg.recv(v, peer_rank, tag);
  };
  std::vector<WorkPtr> sends, recvs;
  std::vector<at::Tensor> keep;
  at::Tensor peer, stamp_in;
  int64_t stamp_at = 0;
  if (bytes <= kPackedStampMaxBytes) {
    // [payload | zero padding | stamp] as bytes, both ways; the stamp starts at a multiple of
    // 16 bytes, so the receive buffer views as any dtype. Its slot in the receive buffer starts
    // zeroed: a shorter message cannot leave a matching stamp there.
    stamp_at = (bytes + 15) / 16 * 16;
    const int64_t total = stamp_at + kStampSlotBytes;
    const auto u8 = buf.options().dtype(at::kByte);
    at::Tensor packed = at::empty({total}, u8);
    auto* out = packed.mutable_data_ptr<uint8_t>();
    if (bytes > 0) std::memcpy(out, buf.const_data_ptr(), bytes);
    std::memset(out + bytes, 0, total - bytes);
    write_stamp(reinterpret_cast<int64_t*>(out + stamp_at), buf);
    stamp_in = at::empty({total}, u8);
    std::memset(stamp_in.mutable_data_ptr<uint8_t>() + stamp_at, 0, kStampSlotBytes);
    peer = stamp_in.view(buf.scalar_type()).narrow(0, 0, buf.numel()).view(buf.sizes());
    sends.push_back(send(packed, kExchangeTag));
    recvs.push_back(recv(stamp_in, kExchangeTag));
    keep.push_back(std::move(packed));
  } else {
    at::Tensor stamp = at::empty({3}, at::kLong);
    write_stamp(stamp.mutable_data_ptr<int64_t>(), buf);
    stamp_in = at::zeros({3}, at::kLong);
    peer = at::empty_like(buf);
    sends.push_back(send(stamp, kStampTag));
    sends.push_back(send(buf, kExchangeTag));
    recvs.push_back(recv(stamp_in, kStampTag));
    recvs.push_back(recv(peer, kExchangeTag));
    keep.push_back(std::move(stamp));
  }
  return c10::make_intrusive<PairSumWork>(pg.getGroupName(), peer_rank, buf, std::move(peer),
                                          std::move(stamp_in), stamp_at, std::move(keep),
                                          std::move(sends), std::move(recvs));
}

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
  return pg.getSize() == 2 && buf.device().is_cpu() && buf.is_contiguous() &&
         pair_exchange_enabled() && cpu_backend_is_gloo(pg);
}

}  // namespace

WorkPtr all_reduce(c10d::ProcessGroup& pg, const at::Tensor& buf) {
  count_collective(pg, Collective::kAllReduce, nbytes(buf));
  if (uses_pair_exchange(pg, buf)) return pair_exchange(pg, buf);
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
