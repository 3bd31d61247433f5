// Runs the launchers of csrc/cuda/kernels.h on the emulator, driven by a request file, so that
// a test can feed the kernels and read back their results without loading sanitized code into
// its own process.
//
// Usage: tpx_kernels_emu REQUEST. REQUEST holds one command per line:
//   buf NAME NBYTES OFFSET PATH  allocate NBYTES (64-byte aligned, exactly that size, so an
//                                access past the end is caught), fill it from the file PATH; the
//                                argument NAME points OFFSET bytes into it
//   alias NAME OTHER             the argument NAME is the buffer OTHER (an in-place call)
//   int NAME VALUE               an integer argument
//   float NAME HEXFLOAT          a float argument (printf %a form, exact)
//   call LAUNCHER                call a launcher of kernels.h with the arguments by name
//   save NAME PATH               write buffer NAME (all NBYTES) to the file PATH
//   selftest NAME                run a kernel of selftest.cpp (deliberate CUDA mistakes)
// A launcher returning an error exits with status 3; a bad request with status 2.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/kernels.h"

int run_selftest(const std::string& name);

namespace {

struct Buffer {
  char* base = nullptr;
  size_t nbytes = 0;
  size_t offset = 0;
};

std::map<std::string, Buffer> g_bufs;
std::vector<char*> g_owned;
std::map<std::string, long long> g_ints;
std::map<std::string, float> g_floats;

[[noreturn]] void bad(const std::string& msg) {
  std::fprintf(stderr, "tpx_kernels_emu: %s\n", msg.c_str());
  std::exit(2);
}

void* ptr(const std::string& name) {
  auto it = g_bufs.find(name);
  if (it == g_bufs.end()) bad("no buffer " + name);
  return it->second.base + it->second.offset;
}
template <typename T>
T* p(const std::string& name) {
  return static_cast<T*>(ptr(name));
}
long long i(const std::string& name) {
  auto it = g_ints.find(name);
  if (it == g_ints.end()) bad("no int " + name);
  return it->second;
}
float f(const std::string& name) {
  auto it = g_floats.find(name);
  if (it == g_floats.end()) bad("no float " + name);
  return it->second;
}
tpx::cuda::DType dt() { return static_cast<tpx::cuda::DType>(i("dtype")); }

cudaError_t call(const std::string& op) {
  using namespace tpx::cuda;
  if (op == "ce_forward_stats")
    return ce_forward_stats(ptr("logits"), dt(), i("rows"), i("width"), i("row_stride"),
                            p<const int64_t>("target"), i("vocab_start"), i("ignore_index"),
                            i("with_sum_logits") != 0, p<float>("stats"), nullptr);
  if (op == "ce_backward")
    return ce_backward(ptr("logits"), i("logits_row_stride"), ptr("grad"), i("grad_row_stride"),
                       dt(), i("rows"), i("width"), p<const int64_t>("target"),
                       p<const float>("lse"), p<const float>("grad_loss"), i("vocab_start"),
                       i("vocab_size"), i("ignore_index"), f("label_smoothing"), nullptr);
  if (op == "embedding_forward")
    return embedding_forward(ptr("weight"), i("weight_row_stride"), dt(), i("num_local"),
                             i("dim"), p<const int64_t>("ids"), i("count"), i("vocab_start"),
                             ptr("out"), nullptr);
  if (op == "embedding_backward_atomic")
    return embedding_backward_atomic(ptr("grad"), i("grad_row_stride"), dt(), i("count"),
                                     i("dim"), p<const int64_t>("ids"), i("vocab_start"),
                                     i("num_local"), i("padding_idx"), p<float>("grad_weight"),
                                     nullptr);
  if (op == "embedding_backward_sorted") {
    // Scratch as the torch glue allocates it: uninitialised (here NaN), exactly this size.
    const int64_t ws = embedding_backward_sorted_workspace(i("count"), i("dim"));
    float* workspace = nullptr;
    if (ws > 0) {
      workspace = static_cast<float*>(std::malloc(static_cast<size_t>(ws) * sizeof(float)));
      for (int64_t k = 0; k < ws; ++k) workspace[k] = NAN;
    }
    const cudaError_t err = embedding_backward_sorted(
        ptr("grad"), i("grad_row_stride"), dt(), i("count"), i("dim"),
        p<const int64_t>("sorted_rows"), p<const int64_t>("perm"), i("num_local"),
        ptr("grad_weight"), workspace, nullptr);
    std::free(workspace);
    return err;
  }
  bad("unknown launcher " + op);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) bad("usage: tpx_kernels_emu REQUEST");
  std::ifstream req(argv[1]);
  if (!req) bad(std::string("cannot read ") + argv[1]);
  std::string line;
  while (std::getline(req, line)) {
    std::istringstream in(line);
    std::string cmd, name;
    if (!(in >> cmd)) continue;
    if (cmd == "buf") {
      Buffer b;
      std::string path;
      if (!(in >> name >> b.nbytes >> b.offset >> path)) bad("bad line: " + line);
      void* mem = nullptr;
      if (posix_memalign(&mem, 64, b.nbytes > 0 ? b.nbytes : 1) != 0) bad("out of memory");
      b.base = static_cast<char*>(mem);
      std::ifstream data(path, std::ios::binary);
      if (!data.read(b.base, static_cast<std::streamsize>(b.nbytes))) bad("short file " + path);
      g_owned.push_back(b.base);
      g_bufs[name] = b;
    } else if (cmd == "alias") {
      std::string other;
      if (!(in >> name >> other)) bad("bad line: " + line);
      auto it = g_bufs.find(other);
      if (it == g_bufs.end()) bad("no buffer " + other);
      g_bufs[name] = it->second;
    } else if (cmd == "int") {
      long long v;
      if (!(in >> name >> v)) bad("bad line: " + line);
      g_ints[name] = v;
    } else if (cmd == "float") {
      std::string v;
      if (!(in >> name >> v)) bad("bad line: " + line);
      g_floats[name] = std::strtof(v.c_str(), nullptr);
    } else if (cmd == "call") {
      if (!(in >> name)) bad("bad line: " + line);
      const cudaError_t err = call(name);
      if (err != cudaSuccess) {
        std::fprintf(stderr, "tpx_kernels_emu: %s returned %s\n", name.c_str(),
                     cudaGetErrorString(err));
        return 3;
      }
    } else if (cmd == "save") {
      std::string path;
      if (!(in >> name >> path)) bad("bad line: " + line);
      auto it = g_bufs.find(name);
      if (it == g_bufs.end()) bad("no buffer " + name);
      std::ofstream out(path, std::ios::binary);
      out.write(it->second.base, static_cast<std::streamsize>(it->second.nbytes));
      if (!out) bad("cannot write " + path);
    } else if (cmd == "selftest") {
      if (!(in >> name)) bad("bad line: " + line);
      const int rc = run_selftest(name);
      if (rc != 0) return rc;
    } else {
      bad("unknown command " + cmd);
    }
  }
  for (char* b : g_owned) std::free(b);
  return 0;
}
