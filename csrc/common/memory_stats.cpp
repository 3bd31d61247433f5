#include "common/memory_stats.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <mutex>

namespace tpx {
namespace {

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    const c10::Device device = inner.device();
    add(static_cast<int64_t>(n));
    auto* ctx = new Context{std::move(inner), static_cast<int64_t>(n), this};
    return {data, ctx, &Context::release, device};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  std::pair<int64_t, int64_t> stats() const { return {current_.load(), peak_.load()}; }
  void reset_peak() { peak_.store(current_.load()); }

 private:
  struct Context {
    c10::DataPtr inner;
    int64_t bytes;
    CountingAllocator* owner;
    static void release(void* p) {
      auto* ctx = static_cast<Context*>(p);
      ctx->owner->add(-ctx->bytes);
      delete ctx;  // frees the memory through the wrapped allocator's deleter
    }
  };

  void add(int64_t delta) {
    const int64_t now = current_.fetch_add(delta) + delta;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }

  c10::Allocator* base_;
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
};

CountingAllocator* counting = nullptr;
std::mutex install_mutex;

}  // namespace

void enable_cpu_memory_stats() {
  std::lock_guard<std::mutex> lock(install_mutex);
  if (counting != nullptr) return;
  // Never freed: tensors allocated through it may outlive any scope.
  counting = new CountingAllocator(c10::GetAllocator(c10::DeviceType::CPU));
  c10::SetAllocator(c10::DeviceType::CPU, counting, /*priority=*/100);
}

bool cpu_memory_stats_enabled() { return counting != nullptr; }

std::pair<int64_t, int64_t> cpu_memory_stats() {
  return counting != nullptr ? counting->stats() : std::pair<int64_t, int64_t>{0, 0};
}

void reset_cpu_memory_peak() {
  if (counting != nullptr) counting->reset_peak();
}

}  // namespace tpx
