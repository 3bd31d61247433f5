// Kernels with deliberate CUDA mistakes, to show that the emulator reports each of them (see
// test_kernels_emulated.py). Run by the driver as `selftest NAME`.
#include <cstdio>
#include <cstdlib>
#include <string>

#include <cuda_runtime.h>

namespace {

__global__ void lane_exits_before_shuffle(float* out) {
  float v = static_cast<float>(threadIdx.x);
  if (threadIdx.x == 31) return;
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}

__global__ void mask_omits_caller(float* out) {
  float v = static_cast<float>(threadIdx.x);
  v += __shfl_xor_sync(0x0000ffffu, v, 1);
  out[threadIdx.x] = v;
}

__global__ void source_lane_outside_mask(float* out) {
  float v = static_cast<float>(threadIdx.x);
  if (threadIdx.x < 16) v += __shfl_xor_sync(0x0000ffffu, v, 16);
  out[threadIdx.x] = v;
}

__global__ void divergent_syncthreads(float* out) {
  if (threadIdx.x < 64) __syncthreads();
  out[threadIdx.x] = 1.f;
}

// Each thread reads its neighbour's shared slot; with_barrier = 0 omits the __syncthreads.
__global__ void neighbour_exchange(float* out, int with_barrier) {
  __shared__ float slot[256];
  slot[threadIdx.x] = static_cast<float>(blockIdx.x * 1000 + threadIdx.x);
  if (with_barrier) __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = slot[(threadIdx.x + 1) % blockDim.x];
}

__global__ void noop(float*) {}

__global__ void write_past_end(float* out, int n) { out[n + threadIdx.x] = 0.f; }

int neighbour(int with_barrier) {
  constexpr int kBlocks = 4, kThreads = 256;
  float* out = static_cast<float*>(std::malloc(sizeof(float) * kBlocks * kThreads));
  tpx_emu::launch(neighbour_exchange, dim3(kBlocks), dim3(kThreads), 0, nullptr, out,
                  with_barrier);
  int wrong = 0;
  for (int b = 0; b < kBlocks; ++b)
    for (int t = 0; t < kThreads; ++t)
      wrong += out[b * kThreads + t] != static_cast<float>(b * 1000 + (t + 1) % kThreads);
  std::free(out);
  std::printf("neighbour_exchange: %d wrong values\n", wrong);
  return wrong == 0 ? 0 : 4;
}

}  // namespace

int run_selftest(const std::string& name) {
  float* out = static_cast<float*>(std::malloc(sizeof(float) * 1024));
  const auto one = [&](void (*k)(float*), dim3 grid, dim3 block) {
    tpx_emu::launch(k, grid, block, 0, nullptr, out);
  };
  int rc = 0;
  if (name == "lane_exits_before_shuffle") one(lane_exits_before_shuffle, 1, 32);
  else if (name == "mask_omits_caller") one(mask_omits_caller, 1, 32);
  else if (name == "source_lane_outside_mask") one(source_lane_outside_mask, 1, 32);
  else if (name == "divergent_syncthreads") one(divergent_syncthreads, 1, 128);
  else if (name == "block_too_large") one(noop, 1, 1025);
  else if (name == "grid_y_too_large") one(noop, dim3(1, 65536), 32);
  else if (name == "shared_too_large") tpx_emu::launch(noop, 1, 32, 48 * 1024 + 4, nullptr, out);
  else if (name == "write_past_end") tpx_emu::launch(write_past_end, 1, 32, 0, nullptr, out, 1000);
  else if (name == "neighbour_with_barrier") rc = neighbour(1);
  else if (name == "neighbour_without_barrier") rc = neighbour(0);
  else rc = 2;
  std::free(out);
  return rc;
}
