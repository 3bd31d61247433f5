#include "common/memory_stats.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace tpx {
namespace {

// Wraps torch's CPU allocator and counts the bytes it holds. The DataPtr it returns keeps the
// data pointer as its context (as the default allocator does): oneDNN's engine allocates
// through raw_allocate(), which requires that, and frees through raw_deleter(). The wrapped
// allocation lives in a table keyed by the data pointer until it is freed.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;  // empty allocations hold nothing to count
    const c10::Device device = inner.device();
    {
      std::lock_guard<std::mutex> lock(table_mutex_);
      live_.emplace(data, Entry{std::move(inner), static_cast<int64_t>(n)});
    }
    add(static_cast<int64_t>(n));
    return {data, data, &release, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  std::pair<int64_t, int64_t> stats() const { return {current_.load(), peak_.load()}; }
  void reset_peak() { peak_.store(current_.load()); }

 private:
  struct Entry {
    c10::DataPtr inner;  // frees the memory through the wrapped allocator's deleter
    int64_t bytes = 0;
  };

  static void release(void* data);

  void add(int64_t delta) {
    const int64_t now = current_.fetch_add(delta) + delta;
    int64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
  }

  c10::Allocator* base_;
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
  std::mutex table_mutex_;
  std::unordered_map<void*, Entry> live_;
};

CountingAllocator* counting = nullptr;
std::mutex install_mutex;

void CountingAllocator::release(void* data) {
  Entry entry;
  bool found = true;
  {
    std::lock_guard<std::mutex> lock(counting->table_mutex_);
    auto it = counting->live_.find(data);
    if (it != counting->live_.end()) {
      entry = std::move(it->second);
      counting->live_.erase(it);
    } else {
      found = false;
    }
  }
  if (!found) {
    // Memory taken through raw_allocate() before the wrapper was installed, freed through
    // raw_deallocate() after it: it belongs to the wrapped allocator.
    c10::DeleterFnPtr base_delete = counting->base_->raw_deleter();
    TORCH_INTERNAL_ASSERT(base_delete != nullptr, "tpx memory stats: freeing an unknown pointer");
    base_delete(data);
    return;
  }
  counting->add(-entry.bytes);
  // entry.inner frees the memory here, outside the lock.
}

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
