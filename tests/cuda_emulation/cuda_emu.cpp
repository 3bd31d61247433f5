// The runtime of the CUDA emulation layer (cuda_emu.h): blocks of fibers, the block barrier,
// the warp rendezvous and the launch checks.
//
// A block runs on the calling OS thread. Each of its threads is a fiber (ucontext) with its
// own stack; a scheduler runs the runnable fibers in a random order, each until it blocks
// (__syncthreads, a warp intrinsic), yields (an atomic) or exits. When no fiber can run, the
// scheduler completes the collectives whose participants have all arrived; if none can
// complete, the block is stuck, and the state of every waiting thread is reported.
#include "cuda_emu.h"

#include <ucontext.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define TPX_EMU_ASAN 1
#endif

namespace tpx_emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;
constexpr int kMaxThreads = 1024;

enum class State { kRunnable, kBarrier, kWarp, kExited };

struct Fiber {
  ThreadState ts;
  ucontext_t ctx;
  char* stack = nullptr;
  State state = State::kRunnable;
  int linear = 0;  // linear thread index in the block
  // Where it waits and with what.
  const char* file = nullptr;
  int line = 0;
  Coll kind = Coll::kSyncWarp;
  unsigned mask = 0;
  uint64_t value = 0;
  int op = 0;
  int width = 32;
  uint64_t result = 0;
#if TPX_EMU_ASAN
  void* fake_stack = nullptr;
#endif
};

struct Block {
  const void* kernel = nullptr;
  std::vector<Fiber> fibers;
  int nthreads = 0;
  Fiber* running = nullptr;
  ucontext_t sched_ctx;
  const std::function<void()>* body = nullptr;
  std::mt19937_64 rng;
#if TPX_EMU_ASAN
  const void* sched_stack_bottom = nullptr;
  size_t sched_stack_size = 0;
  void* sched_fake_stack = nullptr;
#endif
};

Block g_block;
ThreadState g_host_state{};  // what threadIdx & co. read outside a kernel
cudaError_t g_last_error = cudaSuccess;
uint64_t g_launches = 0;

const char* coll_name(Coll k) {
  switch (k) {
    case Coll::kShflSync: return "__shfl_sync";
    case Coll::kShflUp: return "__shfl_up_sync";
    case Coll::kShflDown: return "__shfl_down_sync";
    case Coll::kShflXor: return "__shfl_xor_sync";
    case Coll::kBallot: return "__ballot_sync";
    case Coll::kAll: return "__all_sync";
    case Coll::kAny: return "__any_sync";
    case Coll::kSyncWarp: return "__syncwarp";
  }
  return "?";
}

std::string where(const Fiber& f) {
  char buf[256];
  std::snprintf(buf, sizeof buf, "thread (%u,%u,%u) of block (%u,%u,%u)", f.ts.thread_idx.x,
                f.ts.thread_idx.y, f.ts.thread_idx.z, f.ts.block_idx.x, f.ts.block_idx.y,
                f.ts.block_idx.z);
  return buf;
}

std::string state_of(const Fiber& f) {
  char buf[512];
  switch (f.state) {
    case State::kRunnable: return "running";
    case State::kExited: return "exited";
    case State::kBarrier:
      std::snprintf(buf, sizeof buf, "waits at __syncthreads() at %s:%d", f.file, f.line);
      return buf;
    case State::kWarp:
      std::snprintf(buf, sizeof buf, "waits at %s(mask 0x%08x) at %s:%d", coll_name(f.kind),
                    f.mask, f.file, f.line);
      return buf;
  }
  return "?";
}

std::string kernel_name() {
  char buf[1024];
  std::snprintf(buf, sizeof buf, "%p", g_block.kernel);
#if TPX_EMU_ASAN
  char sym[1024] = "";
  __sanitizer_symbolize_pc(const_cast<void*>(g_block.kernel), "%f", sym, sizeof sym);
  if (sym[0] != '\0') return sym;
#endif
  return buf;
}

[[noreturn]] void fail(const std::string& msg) {
  std::fprintf(stderr, "CUDA emulation: kernel %s: %s\n", kernel_name().c_str(), msg.c_str());
  std::fflush(stderr);
  std::abort();
}

// ---- fiber switching ----------------------------------------------------------------------

void switch_to_scheduler(Fiber& f, bool exiting) {
#if TPX_EMU_ASAN
  __sanitizer_start_switch_fiber(exiting ? nullptr : &f.fake_stack, g_block.sched_stack_bottom,
                                 g_block.sched_stack_size);
#else
  (void)exiting;
#endif
  swapcontext(&f.ctx, &g_block.sched_ctx);
#if TPX_EMU_ASAN
  __sanitizer_finish_switch_fiber(f.fake_stack, nullptr, nullptr);
#endif
}

void fiber_entry() {
  Fiber& f = *g_block.running;
#if TPX_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &g_block.sched_stack_bottom,
                                  &g_block.sched_stack_size);
#endif
  (*g_block.body)();
  f.state = State::kExited;
  switch_to_scheduler(f, /*exiting=*/true);
  std::abort();  // an exited fiber is never resumed
}

void run_fiber(Fiber& f) {
  g_block.running = &f;
#if TPX_EMU_ASAN
  __sanitizer_start_switch_fiber(&g_block.sched_fake_stack, f.stack, kStackBytes);
#endif
  swapcontext(&g_block.sched_ctx, &f.ctx);
#if TPX_EMU_ASAN
  __sanitizer_finish_switch_fiber(g_block.sched_fake_stack, nullptr, nullptr);
#endif
  g_block.running = nullptr;
}

Fiber& self(const char* what) {
  if (g_block.running == nullptr) {
    std::fprintf(stderr, "CUDA emulation: %s called outside a kernel\n", what);
    std::abort();
  }
  return *g_block.running;
}

// ---- collectives --------------------------------------------------------------------------

// Tries to complete the warp collective that fiber `f` waits at. Returns true when done.
bool try_complete_warp(Fiber& f) {
  const int warp_base = f.linear / 32 * 32;
  const unsigned mask = f.mask;
  std::vector<Fiber*> lanes(32, nullptr);
  for (int l = 0; l < 32; ++l) {
    if (!(mask >> l & 1u)) continue;
    const int idx = warp_base + l;
    if (idx >= g_block.nthreads) return false;  // reported as stuck
    Fiber& o = g_block.fibers[idx];
    if (o.state != State::kWarp || o.mask != mask || o.kind != f.kind) return false;
    lanes[l] = &o;
  }
  for (int l = 0; l < 32; ++l) {
    Fiber* o = lanes[l];
    if (o == nullptr) continue;
    uint64_t r = 0;
    const int w = o->width;
    const int seg = l / w * w;  // first lane of this lane's segment
    int src = l;
    switch (f.kind) {
      case Coll::kShflSync: src = seg + (o->op % w + w) % w; break;
      case Coll::kShflUp: src = (l - seg) >= o->op ? l - o->op : l; break;
      case Coll::kShflDown: src = (l - seg) + o->op < w ? l + o->op : l; break;
      case Coll::kShflXor: src = (l ^ o->op) >= seg + w ? l : (l ^ o->op); break;
      default: break;
    }
    switch (f.kind) {
      case Coll::kShflSync:
      case Coll::kShflUp:
      case Coll::kShflDown:
      case Coll::kShflXor:
        if (src < 0 || src >= 32 || !(mask >> src & 1u)) {
          char buf[256];
          std::snprintf(buf, sizeof buf,
                        "%s at %s:%d: lane %d reads lane %d, which is not in the mask 0x%08x",
                        coll_name(f.kind), o->file, o->line, l, src, mask);
          fail(where(*o) + ": " + buf);
        }
        r = lanes[src]->value;
        break;
      case Coll::kBallot:
        for (int k = 0; k < 32; ++k)
          if (lanes[k] != nullptr && lanes[k]->op) r |= 1ull << k;
        break;
      case Coll::kAll:
        r = 1;
        for (int k = 0; k < 32; ++k)
          if (lanes[k] != nullptr && !lanes[k]->op) r = 0;
        break;
      case Coll::kAny:
        r = 0;
        for (int k = 0; k < 32; ++k)
          if (lanes[k] != nullptr && lanes[k]->op) r = 1;
        break;
      case Coll::kSyncWarp: break;
    }
    o->result = r;
  }
  for (Fiber* o : lanes)
    if (o != nullptr) o->state = State::kRunnable;
  return true;
}

bool try_complete_barrier() {
  const Fiber* first = nullptr;
  for (int i = 0; i < g_block.nthreads; ++i) {
    const Fiber& f = g_block.fibers[i];
    if (f.state != State::kBarrier) return false;
    if (first == nullptr) first = &f;
    if (f.line != first->line || std::strcmp(f.file, first->file) != 0) return false;
  }
  for (int i = 0; i < g_block.nthreads; ++i) g_block.fibers[i].state = State::kRunnable;
  return true;
}

[[noreturn]] void report_stuck() {
  std::string msg = "the block cannot make progress:";
  int shown = 0, exited = 0;
  for (int i = 0; i < g_block.nthreads; ++i) {
    const Fiber& f = g_block.fibers[i];
    if (f.state == State::kExited) {
      ++exited;
      continue;
    }
    if (shown++ < 40) msg += "\n  " + where(f) + " " + state_of(f);
  }
  if (shown > 40) msg += "\n  ... and " + std::to_string(shown - 40) + " more waiting threads";
  msg += "\n  (" + std::to_string(exited) + " threads of the block have exited)";
  // Name the first concrete cause.
  for (int i = 0; i < g_block.nthreads; ++i) {
    const Fiber& f = g_block.fibers[i];
    if (f.state != State::kWarp) continue;
    const int warp_base = f.linear / 32 * 32;
    for (int l = 0; l < 32; ++l) {
      if (!(f.mask >> l & 1u)) continue;
      const int idx = warp_base + l;
      if (idx >= g_block.nthreads) {
        msg += "\n  cause: " + std::string(coll_name(f.kind)) + " at " + f.file + ":" +
               std::to_string(f.line) + " names lane " + std::to_string(l) +
               ", which does not exist in this block";
        fail(msg);
      }
      const Fiber& o = g_block.fibers[idx];
      if (o.state == State::kWarp && o.mask == f.mask && o.kind == f.kind) continue;
      msg += "\n  cause: lane " + std::to_string(l) + " of the mask 0x" + [&] {
        char b[16];
        std::snprintf(b, sizeof b, "%08x", f.mask);
        return std::string(b);
      }() + " of " + coll_name(f.kind) + " at " + f.file + ":" + std::to_string(f.line) +
             " does not take part: " + where(o) + " " + state_of(o);
      fail(msg);
    }
  }
  for (int i = 0; i < g_block.nthreads; ++i) {
    const Fiber& f = g_block.fibers[i];
    if (f.state == State::kBarrier) {
      for (int j = 0; j < g_block.nthreads; ++j) {
        const Fiber& o = g_block.fibers[j];
        if (o.state == State::kBarrier && o.line == f.line && std::strcmp(o.file, f.file) == 0)
          continue;
        msg += "\n  cause: __syncthreads() at " + std::string(f.file) + ":" +
               std::to_string(f.line) + " is not reached by every thread of the block: " +
               where(o) + " " + state_of(o);
        fail(msg);
      }
    }
  }
  fail(msg);
}

void run_block(const std::function<void()>& body) {
  Block& b = g_block;
  b.body = &body;
  std::vector<int> order(b.nthreads);
  for (int i = 0; i < b.nthreads; ++i) {
    Fiber& f = b.fibers[i];
    f.state = State::kRunnable;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_entry, 0);
    order[i] = i;
  }
  for (;;) {
    bool any = false;
    std::shuffle(order.begin(), order.end(), b.rng);
    for (int i : order) {
      Fiber& f = b.fibers[i];
      if (f.state != State::kRunnable) continue;
      any = true;
      run_fiber(f);
    }
    if (any) continue;
    // Nothing runnable: complete what can be completed.
    bool all_exited = true, progress = false;
    for (int i = 0; i < b.nthreads; ++i) {
      Fiber& f = b.fibers[i];
      if (f.state == State::kExited) continue;
      all_exited = false;
      if (f.state == State::kWarp && try_complete_warp(f)) progress = true;
    }
    if (all_exited) return;
    if (!progress) progress = try_complete_barrier();
    if (!progress) report_stuck();
  }
}

uint64_t seed_base() {
  const char* s = std::getenv("TPX_EMU_SEED");
  return s != nullptr ? std::strtoull(s, nullptr, 10) : 1;
}

}  // namespace

const ThreadState& current() {
  return g_block.running != nullptr ? g_block.running->ts : g_host_state;
}

void syncthreads(const char* file, int line) {
  Fiber& f = self("__syncthreads");
  f.state = State::kBarrier;
  f.file = file;
  f.line = line;
  switch_to_scheduler(f, false);
}

uint64_t warp_collective(Coll kind, unsigned mask, uint64_t value, int op, int width,
                         const char* file, int line) {
  Fiber& f = self(coll_name(kind));
  const int lane = f.linear % 32;
  if (!(mask >> lane & 1u)) {
    char buf[256];
    std::snprintf(buf, sizeof buf, "%s at %s:%d: lane %d calls with mask 0x%08x, which omits it",
                  coll_name(kind), file, line, lane, mask);
    fail(where(f) + ": " + buf);
  }
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0) {
    fail(where(f) + ": " + coll_name(kind) + " at " + file + ":" + std::to_string(line) +
         ": width " + std::to_string(width) + " is not a power of two <= 32");
  }
  f.state = State::kWarp;
  f.kind = kind;
  f.mask = mask;
  f.value = value;
  f.op = op;
  f.width = width;
  f.file = file;
  f.line = line;
  switch_to_scheduler(f, false);
  return f.result;
}

void yield_point() {
  if (g_block.running == nullptr) return;
  Fiber& f = *g_block.running;
  f.state = State::kRunnable;
  switch_to_scheduler(f, false);
}

void run_grid(const void* kernel, dim3 grid, dim3 block, size_t shared_bytes,
              const std::function<void()>& body) {
  g_block.kernel = kernel;
  const uint64_t threads = static_cast<uint64_t>(block.x) * block.y * block.z;
  char buf[512];
  if (threads == 0 || threads > kMaxThreads || block.x > 1024 || block.y > 1024 ||
      block.z > 64) {
    std::snprintf(buf, sizeof buf,
                  "invalid block (%u,%u,%u): at most 1024 threads, 1024 x 1024 x 64", block.x,
                  block.y, block.z);
    fail(buf);
  }
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 ||
      grid.z > 65535) {
    std::snprintf(buf, sizeof buf,
                  "invalid grid (%u,%u,%u): each dimension >= 1, x < 2^31, y and z <= 65535",
                  grid.x, grid.y, grid.z);
    fail(buf);
  }
  if (shared_bytes > 48 * 1024) {
    std::snprintf(buf, sizeof buf, "%zu bytes of dynamic shared memory (at most 48 KiB)",
                  shared_bytes);
    fail(buf);
  }
  Block& b = g_block;
  b.rng.seed(seed_base() * 0x9e3779b97f4a7c15ull + (++g_launches));
  b.nthreads = static_cast<int>(threads);
  if (b.fibers.size() < threads) {
    const size_t old = b.fibers.size();
    b.fibers.resize(threads);
    for (size_t i = old; i < threads; ++i)
      b.fibers[i].stack = static_cast<char*>(std::malloc(kStackBytes));
  }

  std::vector<uint64_t> blocks(static_cast<uint64_t>(grid.x) * grid.y * grid.z);
  for (uint64_t i = 0; i < blocks.size(); ++i) blocks[i] = i;
  std::shuffle(blocks.begin(), blocks.end(), b.rng);
  for (uint64_t id : blocks) {
    const uint3 bidx{static_cast<unsigned>(id % grid.x),
                     static_cast<unsigned>(id / grid.x % grid.y),
                     static_cast<unsigned>(id / grid.x / grid.y)};
    for (int t = 0; t < b.nthreads; ++t) {
      Fiber& f = b.fibers[t];
      f.linear = t;
      f.ts.thread_idx = uint3{static_cast<unsigned>(t % block.x),
                              static_cast<unsigned>(t / block.x % block.y),
                              static_cast<unsigned>(t / block.x / block.y)};
      f.ts.block_idx = bidx;
      f.ts.block_dim = block;
      f.ts.grid_dim = grid;
    }
    run_block(body);
  }
  g_last_error = cudaSuccess;
}

}  // namespace tpx_emu

cudaError_t cudaGetLastError() {
  const cudaError_t e = tpx_emu::g_last_error;
  tpx_emu::g_last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError() { return tpx_emu::g_last_error; }

const char* cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    default: return "unspecified launch failure";
  }
}
