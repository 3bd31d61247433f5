// Communication accounting: every collective a tpx op issues is counted per process group
// and kind, with the size of this rank's message. Always on: one mutex-protected map update
// per collective, negligible next to the collective itself. Python reads the counters through
// tpx.comm_stats().
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <utility>

namespace tpx {

enum class Collective { kAllGather, kReduceScatter, kAllReduce, kBroadcast, kReduce, kScatter };

const char* collective_name(Collective kind);

// Records one collective issued on `pg`. `bytes` is this rank's message: its input for an
// all-gather, its output for a reduce-scatter, the whole buffer for an all-reduce or a
// broadcast, and a reduce to one root (on every rank, the root included).
void count_collective(const c10d::ProcessGroup& pg, Collective kind, int64_t bytes);
void count_collective(const std::string& group_name, Collective kind, int64_t bytes);

// Collectives on tpx's own group `owned_name` are counted under `user_name`, the group the
// user passed (see resolve_group in process_group.h).
void set_stats_alias(const std::string& owned_name, const std::string& user_name);

struct CommCounter {
  int64_t calls = 0;
  int64_t bytes = 0;
};

// (group name, kind name) -> cumulative counter since the process started.
std::map<std::pair<std::string, std::string>, CommCounter> comm_counters();

}  // namespace tpx
