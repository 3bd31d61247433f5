// The GEMMs of tpx's engine and ops. Every matrix product tpx computes goes through these.
//
// On CUDA they are ATen's (cuBLAS). On the CPU, for float32 operands in a layout oneDNN reads
// without a copy (row-major or transposed, as every operand of the engine is), they run on
// oneDNN's matmul, which PyTorch ships, instead of ATen's default BLAS: on AVX-512 machines it
// is the faster fp32 GEMM (see README, "CPU GEMMs"). Its accuracy is fp32's (no reduced
// precision unless the user asked PyTorch for it: torch.backends.mkldnn's fp32_precision).
//
// The choice, read on every call from the environment:
//   TPX_CPU_GEMM=auto    (default) oneDNN when PyTorch has it, it is enabled
//                        (torch.backends.mkldnn.enabled) and a first small product agreed
//                        with ATen's; otherwise ATen.
//   TPX_CPU_GEMM=aten    always ATen's GEMM (the one nn.Linear uses).
//   TPX_CPU_GEMM=onednn  oneDNN where it applies; an error when it is not available.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

namespace tpx {

// out = a @ b, written into `out` (which may be a row or column range of a larger buffer).
void mm_into(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b);

// out += a @ b.
void mm_accumulate(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b);

// out = addend + a @ b; `addend` is a 1-D bias (broadcast over rows) or out's shape.
void addmm_into(const at::Tensor& out, const at::Tensor& addend, const at::Tensor& a,
                const at::Tensor& b);

// out = a @ b (+ bias), written into `out`.
void gemm_into(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
               const std::optional<at::Tensor>& bias);

// A new tensor a @ b (+ bias).
at::Tensor gemm(const at::Tensor& a, const at::Tensor& b,
                const std::optional<at::Tensor>& bias = std::nullopt);

// The CPU float32 GEMM backend the next call would use: "onednn" or "aten".
std::string cpu_gemm_backend();

}  // namespace tpx
