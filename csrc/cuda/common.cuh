// Device helpers shared by the tpx kernels: dtype conversion, 16-byte vector access and the
// dispatch from our DType to a C++ element type. No torch header.
//
// Only the explicit conversion intrinsics are used, so the code also compiles under
// torch's extension flags (__CUDA_NO_HALF_OPERATORS__, __CUDA_NO_HALF_CONVERSIONS__,
// __CUDA_NO_BFLOAT16_CONVERSIONS__).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels.h"

namespace tpx {
namespace cuda {
namespace detail {

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Elements per 16-byte vector.
template <typename T>
struct Vec {
  static constexpr int kN = 16 / static_cast<int>(sizeof(T));
};

// Loads / stores kN elements at a 16-byte aligned address, converting to / from fp32.
template <typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[Vec<T>::kN]) {
  union {
    uint4 raw;
    T e[Vec<T>::kN];
  } u;
  u.raw = *reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int k = 0; k < Vec<T>::kN; ++k) out[k] = to_f32(u.e[k]);
}

template <typename T>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[Vec<T>::kN]) {
  union {
    uint4 raw;
    T e[Vec<T>::kN];
  } u;
#pragma unroll
  for (int k = 0; k < Vec<T>::kN; ++k) u.e[k] = from_f32<T>(in[k]);
  *reinterpret_cast<uint4*>(p) = u.raw;
}

// Number of leading elements of a row starting at `p` before the first 16-byte boundary
// (p is aligned to sizeof(T)), capped at `width`.
template <typename T>
__device__ __forceinline__ int64_t head_elems(const T* p, int64_t width) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  const int64_t head = static_cast<int64_t>((16 - (addr & 15)) & 15) / static_cast<int64_t>(sizeof(T));
  return head < width ? head : width;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

}  // namespace detail

// Calls f(T{}) with T the element type of `dtype`; returns cudaErrorInvalidValue for an
// unknown dtype.
template <typename F>
inline cudaError_t dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      f(float{});
      return cudaSuccess;
    case DType::kFloat16:
      f(__half{});
      return cudaSuccess;
    case DType::kBFloat16:
      f(__nv_bfloat16{});
      return cudaSuccess;
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace tpx
