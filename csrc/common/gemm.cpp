#include "common/gemm.h"

#include <ATen/Context.h>

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <exception>

namespace tpx {
namespace {

// at::native::mkldnn_matmul(mat1, mat2, result, beta, alpha) computes
// result = beta * result + alpha * mat1 @ mat2 with oneDNN, writing into `result` in place.
// libtorch_cpu exports it, but its header is not installed and it is not a stable API, so it
// is looked up by its (mangled) name at run time: when a PyTorch release lacks it, or spells
// it differently, tpx uses ATen's GEMM and nothing else changes.
using OneDnnMatmul = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, float,
                              float);
constexpr const char* kOneDnnMatmulSymbol =
    "_ZN2at6native13mkldnn_matmulERKNS_6TensorES3_S3_ff";

// Below this many multiply-adds a GEMM costs mostly its call overhead: ATen's, the cheaper.
constexpr int64_t kMinOneDnnMacs = int64_t{16} * 16 * 16;
// With TPX_CPU_GEMM=auto, oneDNN only from this many: below it, oneDNN's call overhead (about
// 12 us a call on a 2-core AVX-512 VM) outweighs what its kernel saves; the two cross near
// 4M multiply-adds there (docs/benchmarks.md, "CPU GEMMs").
constexpr int64_t kMinAutoOneDnnMacs = int64_t{1} << 22;

OneDnnMatmul lookup() {
  void* sym = nullptr;
  // The library that defines ATen's operators (libtorch_cpu), already loaded by torch.
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&at::_ops::mm::call), &info) != 0 &&
      info.dli_fname != nullptr) {
    if (void* lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD)) {
      sym = dlsym(lib, kOneDnnMatmulSymbol);
      dlclose(lib);  // only drops the reference RTLD_NOLOAD took; torch keeps it loaded
    }
  }
  if (sym == nullptr) sym = dlsym(RTLD_DEFAULT, kOneDnnMatmulSymbol);
  return reinterpret_cast<OneDnnMatmul>(sym);
}

// oneDNN's matmul when it is present and a first product, in the layouts the engine passes
// (one operand transposed; overwrite, then accumulate), equals ATen's exactly. The operands
// are small integers, so both sums are exact. Decided once per process.
OneDnnMatmul onednn() {
  static const OneDnnMatmul fn = []() -> OneDnnMatmul {
    const OneDnnMatmul f = lookup();
    if (f == nullptr) return nullptr;
    try {
      const auto opts = at::TensorOptions().dtype(at::kFloat).device(at::kCPU);
      const at::Tensor a = at::arange(48 * 96, opts).reshape({48, 96}).remainder(7.0).sub(3.0);
      const at::Tensor bt = at::arange(40 * 96, opts).reshape({40, 96}).remainder(5.0).sub(2.0);
      const at::Tensor expect = at::mm(a, bt.t());
      at::Tensor out = at::empty({48, 40}, opts);
      f(a, bt.t(), out, 0.0f, 1.0f);
      if (!at::equal(out, expect)) return nullptr;
      f(a, bt.t(), out, 1.0f, 1.0f);
      if (!at::equal(out, expect.mul(2))) return nullptr;
    } catch (const std::exception&) {
      return nullptr;  // e.g. a CPU without the instructions this oneDNN path requires
    }
    return f;
  }();
  return fn;
}

enum class Choice { kAuto, kAten, kOneDnn };

Choice requested() {
  const char* env = std::getenv("TPX_CPU_GEMM");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0) return Choice::kAuto;
  if (std::strcmp(env, "aten") == 0) return Choice::kAten;
  if (std::strcmp(env, "onednn") == 0) return Choice::kOneDnn;
  TORCH_CHECK_VALUE(false, "TPX_CPU_GEMM must be 'auto', 'aten' or 'onednn'; got '", env, "'");
}

// Row-major, or the transpose of a row-major matrix: the two layouts oneDNN reads in place.
bool onednn_operand(const at::Tensor& t) {
  if (t.dim() != 2) return false;
  if (t.stride(1) == 1 && t.stride(0) == t.size(1)) return true;
  return t.stride(0) == 1 && t.stride(1) == t.size(0);
}

// Whether oneDNN computes out (+)= a @ b: float32 CPU operands it reads in place, an output with
// unit-stride rows, a product big enough, and the backend chosen and available.
bool use_onednn(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  const Choice choice = requested();
  if (choice == Choice::kAten) return false;
  if (!out.device().is_cpu() || !a.device().is_cpu() || !b.device().is_cpu()) return false;
  if (out.scalar_type() != at::kFloat || a.scalar_type() != at::kFloat ||
      b.scalar_type() != at::kFloat) {
    return false;
  }
  if (choice == Choice::kOneDnn) {
    TORCH_CHECK(onednn() != nullptr, "TPX_CPU_GEMM=onednn, but this PyTorch build's oneDNN "
                "matmul is not available to tpx (or disagreed with ATen on a test product); "
                "unset TPX_CPU_GEMM or set it to 'aten'");
  }
  if (!at::globalContext().userEnabledMkldnn()) return false;  // torch.backends.mkldnn.enabled
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  const int64_t min_macs = choice == Choice::kOneDnn ? kMinOneDnnMacs : kMinAutoOneDnnMacs;
  if (m == 0 || k == 0 || n == 0 || m * n * k < min_macs) return false;
  if (!onednn_operand(a) || !onednn_operand(b)) return false;
  if (out.dim() != 2 || out.stride(1) != 1 || out.stride(0) < n) return false;
  return onednn() != nullptr;
}

void check_2d(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && out.dim() == 2 && a.size(1) == b.size(0) &&
                  out.size(0) == a.size(0) && out.size(1) == b.size(1),
              "tpx: internal GEMM shape mismatch: out ", out.sizes(), " = a ", a.sizes(),
              " @ b ", b.sizes());
}

// out = a @ b, or out += a @ b with `accumulate`.
void product(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
  check_2d(out, a, b);
  if (use_onednn(out, a, b)) {
    onednn()(a, b, out, accumulate ? 1.0f : 0.0f, 1.0f);
    return;
  }
  at::Tensor o = out;
  if (accumulate) {
    o.addmm_(a, b);
  } else {
    at::mm_out(o, a, b);
  }
}

}  // namespace

void mm_into(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  product(out, a, b, false);
}

void mm_accumulate(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  product(out, a, b, true);
}

void addmm_into(const at::Tensor& out, const at::Tensor& addend, const at::Tensor& a,
                const at::Tensor& b) {
  check_2d(out, a, b);
  if (use_onednn(out, a, b)) {
    at::Tensor o = out;
    o.copy_(addend.dim() == 1 ? addend.expand_as(out) : addend);
    onednn()(a, b, out, 1.0f, 1.0f);
    return;
  }
  at::Tensor o = out;
  at::addmm_out(o, addend, a, b);
}

void gemm_into(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
               const std::optional<at::Tensor>& bias) {
  if (bias.has_value()) {
    addmm_into(out, *bias, a, b);
  } else {
    mm_into(out, a, b);
  }
}

at::Tensor gemm(const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& bias) {
  at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options());
  gemm_into(out, a, b, bias);
  return out;
}

std::string cpu_gemm_backend() {
  // The choice use_onednn() makes for a float32 CPU product large enough and laid out for it.
  const auto probe = at::empty({256, 256}, at::TensorOptions().dtype(at::kFloat));
  return use_onednn(probe, probe, probe) ? "onednn" : "aten";
}

}  // namespace tpx
