#include "common/process_group.h"

#include "common/comm_stats.h"

#include <c10/core/InferenceMode.h>

#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <optional>
#include <string>
#include <unordered_map>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>


// ProcessGroup::_allgather_base is the spelling every supported torch release has (>= 2.5);
// newer releases mark it deprecated in favour of all_gather_single.
#if defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif

namespace tpx {


namespace {

// tpx's own groups. python/tpx/comm_groups.py makes, collectively, one gloo group of its own
// for every gloo group of two or more ranks that a tpx op or module meets, and registers it
// here with what its ranks agreed on; the ops then run their collectives on it, so tpx's
// traffic (its two-rank exchange, its tags, its event-loop threads) never reaches a group the
// user owns. A user group without one (NCCL, a mixed backend, one rank) is used as it is.
struct OwnedGroup {
  std::string name;  // the registered name of tpx's own group
  c10::weak_intrusive_ptr<c10d::ProcessGroup> user;
  bool pair_exchange;
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<std::string, OwnedGroup> by_user;        // user group name -> owned
  std::unordered_map<std::string, bool> pair_exchange;        // owned group name -> agreed
  std::unordered_map<std::string, std::string> broken;        // group name -> what happened
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: ops may run during exit
  return *r;
}

c10::intrusive_ptr<c10d::ProcessGroup> lookup(const std::string& name) {
  try {
    return c10d::resolve_process_group(name);
  } catch (const std::exception&) {
    return {};
  }
}

}  // namespace

void register_owned_group(const std::string& user_name, const std::string& owned_name,
                          bool pair_exchange) {
  auto user = lookup(user_name);
  TORCH_CHECK(user, "tpx: no process group is registered under the name '", user_name, "'");
  TORCH_CHECK(lookup(owned_name), "tpx: no process group is registered under the name '",
              owned_name, "'");
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.by_user.insert_or_assign(
      user_name,
      OwnedGroup{owned_name, c10::weak_intrusive_ptr<c10d::ProcessGroup>(user), pair_exchange});
  r.pair_exchange[owned_name] = pair_exchange;
  r.broken.erase(owned_name);
  set_stats_alias(owned_name, user_name);
}

std::optional<std::string> owned_group_name(const std::string& user_name) {
  auto user = lookup(user_name);
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.by_user.find(user_name);
  if (!user || it == r.by_user.end() || it->second.user.expired() ||
      it->second.user._unsafe_get_target() != user.get() || !lookup(it->second.name)) {
    return std::nullopt;
  }
  return it->second.name;
}

void mark_group_broken(const std::string& name, const std::string& why) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.broken.emplace(name, why);  // the first cause is the one worth reporting
}

std::optional<std::string> group_broken_reason(const std::string& name) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.broken.find(name);
  if (it == r.broken.end()) return std::nullopt;
  return it->second;
}

c10::intrusive_ptr<c10d::ProcessGroup> resolve_group(const std::string& name) {
  auto pg = lookup(name);
  TORCH_CHECK(pg, "tpx: no process group is registered under the name '", name,
              "'. Call torch.distributed.init_process_group() first and pass a ProcessGroup "
              "(or a 1-D DeviceMesh) of this process as `group`.");
  if (const auto owned = owned_group_name(name)) {
    if (auto own = lookup(*owned)) pg = own;
  }
  if (const auto why = group_broken_reason(pg->getGroupName())) {
    // c10::DistError itself (Python: torch.distributed.DistError): the refusal of a group tpx
    // marked broken, told apart from a collective's failure (DistBackendError) by its type.
    TORCH_CHECK_WITH(DistError, false, "tpx: process group '", name,
                "' can no longer be used by tpx: ", *why,
                ". The ranks of the group no longer agree on which message comes next, so "
                "any later collective could pair the wrong messages; end the run (or destroy "
                "the group and make a new one) and resume from the last checkpoint.");
  }
  return pg;
}

std::exception_ptr as_collective_failure(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::ValueError&) {
    return e;  // tpx's own finding about the arguments (a peer's buffer of another size)
  } catch (const c10::DistError&) {
    return e;
  } catch (const std::exception& x) {
    return std::make_exception_ptr(
        c10::DistBackendError(c10::SourceLocation{__func__, __FILE__, __LINE__}, x.what()));
  } catch (...) {
    return std::make_exception_ptr(c10::DistBackendError(
        c10::SourceLocation{__func__, __FILE__, __LINE__}, "a collective failed"));
  }
}

std::exception_ptr Pending::drain() noexcept {
  std::exception_ptr first;
  for (auto& w : works) {
    try {
      if (!w->wait()) TORCH_CHECK(false, "a collective did not complete");
    } catch (...) {
      if (!first) first = as_collective_failure(std::current_exception());
    }
  }
  works.clear();
  keep_alive.clear();
  if (first && !group.empty()) {
    try {
      std::rethrow_exception(first);
    } catch (const std::exception& e) {
      mark_group_broken(group, std::string("a collective failed: ") + e.what());
    } catch (...) {
      mark_group_broken(group, "a collective failed");
    }
  }
  return first;
}

void Pending::wait() {
  if (auto failed = drain()) std::rethrow_exception(failed);
}

namespace {

// A test facility (tpx._C.testing.arm_fault): the N-th collective this process posts after
// arm_fault(N) raises right after it was posted, and its Work is dropped unwaited, as an
// allocation or a GEMM failing in the middle of an op would leave it. Disarmed: one relaxed
// atomic load per post.
std::atomic<int64_t> fault_countdown{0};

WorkPtr inject_fault(WorkPtr work) {
  if (fault_countdown.load(std::memory_order_relaxed) <= 0) return work;
  if (fault_countdown.fetch_sub(1) != 1) return work;
  work.reset();  // dropped unwaited
  TORCH_CHECK(false, "tpx: fault injected (tpx._C.testing.arm_fault)");
}

}  // namespace

void all_gather_into(c10d::ProcessGroup& pg, const at::Tensor& out, const at::Tensor& local) {
  auto work = all_gather_base(pg, out, local);
  try {
    work->wait();
  } catch (...) {
    std::rethrow_exception(as_collective_failure(std::current_exception()));
  }
}

at::Tensor gather_buffer(at::IntArrayRef sizes, const at::TensorOptions& options) {
  if (!c10::InferenceMode::is_enabled()) return at::empty(sizes, options);
  c10::InferenceMode normal_tensors(false);
  return at::empty(sizes, options);
}

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

WorkPtr all_gather_base(c10d::ProcessGroup& pg, const at::Tensor& out, const at::Tensor& in) {
  at::Tensor o = out, i = in;
  count_collective(pg, Collective::kAllGather, nbytes(in));
  return inject_fault(pg._allgather_base(o, i));
}

WorkPtr reduce_scatter_base(c10d::ProcessGroup& pg, const at::Tensor& out, const at::Tensor& in) {
  at::Tensor o = out, i = in;
  count_collective(pg, Collective::kReduceScatter, nbytes(out));
  return inject_fault(pg._reduce_scatter_base(o, i));
}

namespace {

// The tags of tpx's pairwise exchanges. They run only on tpx's own groups (see resolve_group),
// where nothing else sends: gloo matches a receive to the sends of the same tag in the order
// they were posted, and every rank posts its exchanges in the same order.
constexpr int kExchangeTag = 0x7470;
constexpr int kStampTag = 0x7471;

// Each exchange carries a stamp: a constant, the sender's byte count and its dtype. Gloo
// accepts a message shorter than the posted receive, so without it a rank whose buffer is
// larger than its peer's would add a partly received buffer: a wrong answer. With it, that
// rank raises a ValueError. Its peer, which receives the longer message, cannot: gloo's loop
// thread aborts that process ("Received data size doesn't match expected size", SIGABRT),
// as gloo's own all-reduce does for the same mistake. Ranks whose arguments may differ are
// caught earlier, on every rank, by the ops' argument checks and TPX_DEBUG_CHECKS=1.
// Up to kPackedStampMaxBytes the stamp travels after the payload in one message (copying the
// payload costs less than a second message, which made a 4 KiB exchange a third slower when
// measured); above, it is a second, 24-byte message sent in parallel.
constexpr int64_t kStampMagic = 0x7470'7375'6d5f'7631;  // "tpsum_v1" in ASCII
constexpr int64_t kStampSlotBytes = 4 * sizeof(int64_t);  // 3 used; keeps sizes 16-aligned
constexpr int64_t kPackedStampMaxBytes = int64_t{1} << 20;

void write_stamp(int64_t* dst, const at::Tensor& buf) {
  dst[0] = kStampMagic;
  dst[1] = nbytes(buf);
  dst[2] = static_cast<int64_t>(buf.scalar_type());
}

// Work::wait's default: the group's own timeout.
constexpr std::chrono::milliseconds kWaitForever{0};

// Waits for every work, even after one of them failed; returns the first failure (or null).
// A work whose wait() returns false did not complete: that is a failure too.
std::exception_ptr wait_all(std::vector<WorkPtr>& works, std::chrono::milliseconds timeout) {
  std::exception_ptr first;
  for (auto& w : works) {
    try {
      if (!w->wait(timeout)) {
        TORCH_CHECK(false, "a send or receive did not complete");
      }
    } catch (...) {
      if (!first) first = as_collective_failure(std::current_exception());
    }
  }
  works.clear();
  return first;
}

std::string what(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "an unknown error";
  }
}

// An all-reduce of a two-rank group done as one exchange: each rank sends its buffer to the
// other and adds the one it receives. Gloo's all-reduce takes two steps (reduce-scatter,
// then all-gather) through its worker thread for the same bytes; the exchange was faster at
// every size benchmarks/bench_collectives.py measures (4 KiB - 8 MiB), and posting the send
// before the receive was measured faster than the reverse. IEEE addition is commutative, so
// a + b on one rank and b + a on the other are the same bits.
//
// An exchange is never left half done: wait() completes every send and receive it posted
// even when one fails, and an exchange dropped without wait() (an exception between posting
// and waiting) drains them in its destructor. A receive left posted would otherwise take the
// peer's next message into a freed buffer and shift every later exchange by one. When the
// sends and receives cannot be completed, the group is marked broken for tpx
// (mark_group_broken): every later tpx op on it raises instead of pairing the wrong messages.
class PairSumWork : public c10d::Work {
 public:
  // `peer` receives the peer's payload; the stamp it sent lands `stamp_at` bytes into
  // `stamp_in` (the storage of `peer` when packed); `keep` holds the buffers the sends read;
  // `result` is the caller's buffer when `buf` is a contiguous copy of it.
  PairSumWork(std::string group, int peer_rank, at::Tensor buf, at::Tensor result,
              at::Tensor peer, at::Tensor stamp_in, int64_t stamp_at,
              std::vector<at::Tensor> keep, std::vector<WorkPtr> sends,
              std::vector<WorkPtr> recvs)
      : group_(std::move(group)), peer_rank_(peer_rank), buf_(std::move(buf)),
        result_(std::move(result)), peer_(std::move(peer)), stamp_in_(std::move(stamp_in)),
        stamp_at_(stamp_at), keep_(std::move(keep)), sends_(std::move(sends)),
        recvs_(std::move(recvs)) {}

  ~PairSumWork() override {
    if (state_ != State::kPosted) return;
    // Dropped without wait(): complete the messages, add nothing.
    auto failed = wait_all(recvs_, kWaitForever);
    auto send_failed = wait_all(sends_, kWaitForever);
    if (!failed) failed = send_failed;
    if (failed) {
      mark_group_broken(group_, "a two-rank exchange was abandoned (an error between posting "
                        "it and waiting for it) and could not be completed: " + what(failed));
    }
  }

  bool wait(std::chrono::milliseconds timeout) override {
    if (state_ == State::kSummed) return true;
    if (state_ == State::kFailed) std::rethrow_exception(error_);
    auto failed = wait_all(recvs_, timeout);
    bool match = false;
    int64_t mine[3], theirs[3] = {0, 0, 0};
    if (!failed) {
      write_stamp(mine, buf_);
      std::memcpy(theirs, static_cast<const uint8_t*>(stamp_in_.const_data_ptr()) + stamp_at_,
                  sizeof(theirs));
      match = std::equal(mine, mine + 3, theirs);
    }
    // The sends read buf_ and keep_ until they complete. After a mismatch the peer may already
    // have stopped, failing our send: the mismatch is the error to report.
    auto send_failed = wait_all(sends_, timeout);
    if (!failed && match) failed = send_failed;
    keep_.clear();
    if (failed) {
      mark_group_broken(group_, "a two-rank exchange failed: " + what(failed));
      return fail(failed);
    }
    if (!match) {
      const std::string peer_has =
          theirs[0] == kStampMagic
              ? "has " + std::to_string(theirs[1]) + " bytes of " +
                    std::string(c10::toString(c10::ScalarType(theirs[2])))
              : std::string("is smaller (its message was shorter than this rank's)");
      // Every message of the exchange was received: the ranks are still in step, and the
      // group stays usable (the rank that received the longer message, if any, was stopped
      // by gloo).
      try {
        TORCH_CHECK_VALUE(false, "tpx: the two ranks of process group '", group_, "' all-reduce "
                          "different buffers: this rank's has ", mine[1], " bytes of ",
                          buf_.scalar_type(), ", rank ", peer_rank_, "'s ", peer_has,
                          ". Every rank must call a tpx op with tensors of the same shape and "
                          "dtype (for example the same batch size); TPX_DEBUG_CHECKS=1 compares "
                          "every op's arguments across ranks before its collectives run.");
      } catch (...) {
        return fail(std::current_exception());
      }
    }
    buf_.add_(peer_);
    if (result_.defined()) result_.copy_(buf_);
    peer_ = stamp_in_ = buf_ = result_ = at::Tensor();
    state_ = State::kSummed;
    return true;
  }

  bool isCompleted() override { return state_ != State::kPosted; }
  bool isSuccess() const override { return state_ == State::kSummed; }

 private:
  enum class State { kPosted, kSummed, kFailed };

  [[noreturn]] bool fail(std::exception_ptr e) {
    state_ = State::kFailed;
    error_ = e;
    peer_ = stamp_in_ = at::Tensor();
    std::rethrow_exception(e);
  }

  std::string group_;
  int peer_rank_;
  at::Tensor buf_, result_, peer_, stamp_in_;
  int64_t stamp_at_;
  std::vector<at::Tensor> keep_;
  std::vector<WorkPtr> sends_, recvs_;
  State state_ = State::kPosted;
  std::exception_ptr error_;
};

WorkPtr pair_exchange(c10d::ProcessGroup& pg, const at::Tensor& target) {
  const int peer_rank = 1 - pg.getRank();
  // A strided buffer is summed in a contiguous copy and written back: the protocol (and the
  // bytes on the wire) do not depend on a tensor's layout, which ranks need not share.
  at::Tensor result, buf = target;
  if (!target.is_contiguous()) {
    buf = target.contiguous();
    result = target;
  }
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
    keep.push_back(packed);
    // Both posted before any wait, so the exchange can be drained whatever happens next.
    sends.push_back(send(packed, kExchangeTag));
    recvs.push_back(recv(stamp_in, kExchangeTag));
  } else {
    at::Tensor stamp = at::empty({3}, at::kLong);
    write_stamp(stamp.mutable_data_ptr<int64_t>(), buf);
    stamp_in = at::zeros({3}, at::kLong);
    peer = at::empty_like(buf);
    keep.push_back(stamp);
    sends.push_back(send(stamp, kStampTag));
    sends.push_back(send(buf, kExchangeTag));
    recvs.push_back(recv(stamp_in, kStampTag));
    recvs.push_back(recv(peer, kExchangeTag));
  }
  return c10::make_intrusive<PairSumWork>(pg.getGroupName(), peer_rank, buf, result,
                                          std::move(peer), std::move(stamp_in), stamp_at,
                                          std::move(keep), std::move(sends), std::move(recvs));
}

// Whether the ranks of `pg` agreed to sum with the exchange (register_owned_group): only on
// tpx's own two-rank gloo groups, for CPU tensors.
bool uses_pair_exchange(c10d::ProcessGroup& pg, const at::Tensor& buf) {
  if (pg.getSize() != 2 || !buf.device().is_cpu()) return false;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.pair_exchange.find(pg.getGroupName());
  return it != r.pair_exchange.end() && it->second;
}

}  // namespace

WorkPtr all_reduce(c10d::ProcessGroup& pg, const at::Tensor& buf) {
  count_collective(pg, Collective::kAllReduce, nbytes(buf));
  if (uses_pair_exchange(pg, buf)) return inject_fault(pair_exchange(pg, buf));
  std::vector<at::Tensor> bufs{buf};
  return inject_fault(pg.allreduce(bufs));
}

WorkPtr all_reduce_max(c10d::ProcessGroup& pg, const at::Tensor& buf) {
  count_collective(pg, Collective::kAllReduce, nbytes(buf));
  std::vector<at::Tensor> bufs{buf};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::MAX;
  return inject_fault(pg.allreduce(bufs, opts));
}

WorkPtr broadcast(c10d::ProcessGroup& pg, const at::Tensor& buf, int64_t root) {
  std::vector<at::Tensor> bufs{buf};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  count_collective(pg, Collective::kBroadcast, nbytes(buf));
  return inject_fault(pg.broadcast(bufs, opts));
}

WorkPtr reduce_to(c10d::ProcessGroup& pg, const at::Tensor& buf, int64_t root) {
  std::vector<at::Tensor> bufs{buf};
  c10d::ReduceOptions opts;
  opts.rootRank = root;
  count_collective(pg, Collective::kReduce, nbytes(buf));
  return inject_fault(pg.reduce(bufs, opts));
}

namespace testing {

void arm_fault(int64_t n) {
  TORCH_CHECK(n >= 0, "tpx: arm_fault: n must be >= 0 (0 disarms); got ", n);
  fault_countdown.store(n);
}

std::vector<std::string> wait_twice(const at::Tensor& buf, const std::string& group_name) {
  auto work = all_reduce(*resolve_group(group_name), buf);
  std::vector<std::string> outcomes;
  for (int i = 0; i < 2; ++i) {
    try {
      outcomes.push_back(work->wait() ? "ok" : "false");
    } catch (const std::exception& e) {
      outcomes.push_back(std::string("raised: ") + e.what());
    }
  }
  return outcomes;
}

}  // namespace testing

}  // namespace tpx
