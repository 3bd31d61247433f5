#include "common/comm_stats.h"

#include <mutex>

namespace tpx {
namespace {

std::mutex& counters_mutex() {
  static std::mutex m;
  return m;
}

std::map<std::pair<std::string, std::string>, CommCounter>& counters() {
  static std::map<std::pair<std::string, std::string>, CommCounter> c;
  return c;
}

}  // namespace

const char* collective_name(Collective kind) {
  switch (kind) {
    case Collective::kAllGather: return "all_gather";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kAllReduce: return "all_reduce";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kReduce: return "reduce";
  }
  return "unknown";
}

void count_collective(const std::string& group_name, Collective kind, int64_t bytes) {
  std::lock_guard<std::mutex> lock(counters_mutex());
  CommCounter& c = counters()[{group_name, collective_name(kind)}];
  c.calls += 1;
  c.bytes += bytes;
}

void count_collective(const c10d::ProcessGroup& pg, Collective kind, int64_t bytes) {
  count_collective(pg.getGroupName(), kind, bytes);
}

std::map<std::pair<std::string, std::string>, CommCounter> comm_counters() {
  std::lock_guard<std::mutex> lock(counters_mutex());
  return counters();
}

void reset_comm_counters() {
  std::lock_guard<std::mutex> lock(counters_mutex());
  counters().clear();
}

}  // namespace tpx
