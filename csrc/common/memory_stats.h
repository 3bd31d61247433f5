// Accounting of CPU tensor memory, for tests and diagnostics: a counting wrapper around the
// CPU allocator that every at::empty on the CPU goes through (process groups' own temporaries
// included, on whatever thread they are made). Off until enabled; enabling installs it for
// the rest of the process.
#pragma once

#include <cstdint>
#include <utility>

namespace tpx {

void enable_cpu_memory_stats();
bool cpu_memory_stats_enabled();
// (bytes allocated now, the most allocated at once since the last reset)
std::pair<int64_t, int64_t> cpu_memory_stats();
void reset_cpu_memory_peak();

}  // namespace tpx
