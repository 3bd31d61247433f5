// A test-only CUDA emulation layer: enough of the CUDA runtime and device language to compile
// the production kernels (csrc/cuda/*.cu) as plain C++ and run them on the CPU.
//
// The stub headers in include/ (cuda_runtime.h, cuda_fp16.h, cuda_bf16.h) pull this file in,
// so the .cu files compile unchanged with `g++ -x c++ -Itests/cuda_emulation/include`.
//
// Semantics kept where bugs hide:
//  - every thread of a block is a fiber; the threads of a block run concurrently, interleaved
//    at every synchronisation point (and at atomics) in an order drawn from a seeded random
//    generator (TPX_EMU_SEED), and the blocks of a grid run in a random order;
//  - __syncthreads() waits for every thread of the block, all at the same call site; a thread
//    that has exited or waits elsewhere is reported, never silently skipped;
//  - the warp intrinsics (__shfl*_sync, __ballot_sync, __all_sync, __any_sync, __syncwarp)
//    are rendezvous of the lanes of their mask: every lane of the mask must arrive with the
//    same mask at the same kind of intrinsic, the calling lane must be in the mask, and a
//    shuffle's source lane must be in the mask;
//  - __shared__ variables are per block (blocks run one after another), and the launch
//    limits are checked (block <= 1024 threads and 1024/1024/64 per dimension, grid.x <
//    2^31, grid.y/z <= 65535, dynamic shared memory <= 48 KiB);
//  - the vector types carry CUDA's alignment, so a misaligned 16-byte access is undefined
//    behaviour that UBSan reports; built with AddressSanitizer, an out-of-bounds access fails.
// Any violation prints a message naming the kernel, block, thread and call site and aborts.
#pragma once

#define TPX_CUDA_EMULATION 1

#include <math.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

// ---- language keywords --------------------------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
// No __noinline__: libstdc++ (GCC 13 and later) writes __attribute__((__noinline__)) itself,
// which such a macro would break; the kernels do not use it.
#define __launch_bounds__(...)
// Per block: blocks run one after another, so one static instance serves each block in turn.
#define __shared__ static
#define __constant__ static const

// ---- runtime types ------------------------------------------------------------------------

enum cudaError_t : int {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchFailure = 719,
};
using cudaError = cudaError_t;
struct CUstream_st;
using cudaStream_t = CUstream_st*;

struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
};
struct alignas(8) uint2 {
  unsigned int x, y;
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) int2 {
  int x, y;
};
struct alignas(16) int4 {
  int x, y, z, w;
};

cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t err);

// ---- half and bfloat16 (explicit conversions only, as under torch's extension flags) -------

struct alignas(2) __half {
  unsigned short __x;
};
struct alignas(2) __nv_bfloat16 {
  unsigned short __x;
};

inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h.__x, 2);
  return static_cast<float>(f);
}
inline __half __float2half_rn(float x) {  // round to nearest even, as the hardware
  const _Float16 f = static_cast<_Float16>(x);
  __half h;
  std::memcpy(&h.__x, &f, 2);
  return h;
}
inline __half __float2half(float x) { return __float2half_rn(x); }
inline float __bfloat162float(__nv_bfloat16 b) {
  const uint32_t bits = static_cast<uint32_t>(b.__x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float x) {  // round to nearest even; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  __nv_bfloat16 b;
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    b.__x = static_cast<unsigned short>((bits >> 16) | 0x40u);
  } else {
    bits += 0x7fffu + ((bits >> 16) & 1u);
    b.__x = static_cast<unsigned short>(bits >> 16);
  }
  return b;
}
inline __nv_bfloat16 __float2bfloat16(float x) { return __float2bfloat16_rn(x); }

// ---- the emulator -------------------------------------------------------------------------

namespace tpx_emu {

// The thread being run: its index, and its block's index and shape.
struct ThreadState {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};
const ThreadState& current();

void syncthreads(const char* file, int line);
// Warp collectives. `kind` names the intrinsic; `op` is the lane operand (source lane, lane
// mask, delta) for shuffles and the predicate for votes; `width` the shuffle's segment.
enum class Coll : int { kShflSync, kShflUp, kShflDown, kShflXor, kBallot, kAll, kAny, kSyncWarp };
uint64_t warp_collective(Coll kind, unsigned mask, uint64_t value, int op, int width,
                         const char* file, int line);
// A point where another thread may run (atomics).
void yield_point();

// Runs `body` once per thread of every block of the grid. Checks the launch limits.
// `kernel` identifies the kernel in error messages.
void run_grid(const void* kernel, dim3 grid, dim3 block, size_t shared_bytes,
              const std::function<void()>& body);

template <typename T>
inline uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a large type");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
inline T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
            cudaStream_t /*stream*/, Args&&... args) {
  // The arguments are converted to the parameter types once, as a launch copies them.
  std::tuple<std::decay_t<Params>...> params(static_cast<Params>(std::forward<Args>(args))...);
  run_grid(reinterpret_cast<const void*>(kernel), grid, block, shared_bytes,
           [&]() { std::apply(kernel, params); });
}

}  // namespace tpx_emu

#define threadIdx (::tpx_emu::current().thread_idx)
#define blockIdx (::tpx_emu::current().block_idx)
#define blockDim (::tpx_emu::current().block_dim)
#define gridDim (::tpx_emu::current().grid_dim)
constexpr int warpSize = 32;

#define __syncthreads() ::tpx_emu::syncthreads(__FILE__, __LINE__)

template <typename T>
inline T tpx_emu_shfl(::tpx_emu::Coll kind, unsigned mask, T v, int op, int width,
                      const char* file, int line) {
  return ::tpx_emu::from_bits<T>(
      ::tpx_emu::warp_collective(kind, mask, ::tpx_emu::to_bits(v), op, width, file, line));
}
#define __shfl_sync(mask, v, lane, ...) \
  tpx_emu_shfl(::tpx_emu::Coll::kShflSync, (mask), (v), (lane), TPX_EMU_WIDTH(__VA_ARGS__), __FILE__, __LINE__)
#define __shfl_up_sync(mask, v, delta, ...) \
  tpx_emu_shfl(::tpx_emu::Coll::kShflUp, (mask), (v), (delta), TPX_EMU_WIDTH(__VA_ARGS__), __FILE__, __LINE__)
#define __shfl_down_sync(mask, v, delta, ...) \
  tpx_emu_shfl(::tpx_emu::Coll::kShflDown, (mask), (v), (delta), TPX_EMU_WIDTH(__VA_ARGS__), __FILE__, __LINE__)
#define __shfl_xor_sync(mask, v, lane_mask, ...) \
  tpx_emu_shfl(::tpx_emu::Coll::kShflXor, (mask), (v), (lane_mask), TPX_EMU_WIDTH(__VA_ARGS__), __FILE__, __LINE__)
// The optional width argument of a shuffle (32 when absent).
#define TPX_EMU_WIDTH(...) (::tpx_emu::width_or_32(0, ##__VA_ARGS__))
namespace tpx_emu {
inline int width_or_32(int) { return 32; }
inline int width_or_32(int, int w) { return w; }
}  // namespace tpx_emu

#define __ballot_sync(mask, pred)                                                            \
  static_cast<unsigned>(::tpx_emu::warp_collective(::tpx_emu::Coll::kBallot, (mask), 0,      \
                                                   (pred) ? 1 : 0, 32, __FILE__, __LINE__))
#define __all_sync(mask, pred)                                                              \
  static_cast<int>(::tpx_emu::warp_collective(::tpx_emu::Coll::kAll, (mask), 0, (pred) ? 1 : 0, \
                                              32, __FILE__, __LINE__))
#define __any_sync(mask, pred)                                                              \
  static_cast<int>(::tpx_emu::warp_collective(::tpx_emu::Coll::kAny, (mask), 0, (pred) ? 1 : 0, \
                                              32, __FILE__, __LINE__))
#define __syncwarp(...)                                                                   \
  static_cast<void>(::tpx_emu::warp_collective(::tpx_emu::Coll::kSyncWarp,                \
                                               ::tpx_emu::mask_or_full(0, ##__VA_ARGS__), 0, 0, \
                                               32, __FILE__, __LINE__))
namespace tpx_emu {
inline unsigned mask_or_full(int) { return 0xffffffffu; }
inline unsigned mask_or_full(int, unsigned m) { return m; }
}  // namespace tpx_emu

// ---- atomics (the threads of the emulator interleave only at yield points) ------------------

template <typename T>
inline T tpx_emu_atomic_rmw(T* p, T v, T (*op)(T, T)) {
  ::tpx_emu::yield_point();
  const T old = *p;
  *p = op(old, v);
  return old;
}
inline float atomicAdd(float* p, float v) {
  return tpx_emu_atomic_rmw<float>(p, v, [](float a, float b) { return a + b; });
}
inline double atomicAdd(double* p, double v) {
  return tpx_emu_atomic_rmw<double>(p, v, [](double a, double b) { return a + b; });
}
inline int atomicAdd(int* p, int v) {
  return tpx_emu_atomic_rmw<int>(p, v, [](int a, int b) { return a + b; });
}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  return tpx_emu_atomic_rmw<unsigned>(p, v, [](unsigned a, unsigned b) { return a + b; });
}
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return tpx_emu_atomic_rmw<unsigned long long>(
      p, v, [](unsigned long long a, unsigned long long b) { return a + b; });
}
inline int atomicMax(int* p, int v) {
  return tpx_emu_atomic_rmw<int>(p, v, [](int a, int b) { return a > b ? a : b; });
}
inline int atomicMin(int* p, int v) {
  return tpx_emu_atomic_rmw<int>(p, v, [](int a, int b) { return a < b ? a : b; });
}
inline int atomicExch(int* p, int v) {
  return tpx_emu_atomic_rmw<int>(p, v, [](int, int b) { return b; });
}
inline int atomicCAS(int* p, int compare, int v) {
  ::tpx_emu::yield_point();
  const int old = *p;
  if (old == compare) *p = v;
  return old;
}
inline void __threadfence() {}
inline void __threadfence_block() {}
