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

// tpx's own groups, counted under the name of the user's group they stand for.
std::map<std::string, std::string>& aliases() {
  static std::map<std::string, std::string> a;
  return a;
}

}  // namespace

void set_stats_alias(const std::string& owned_name, const std::string& user_name) {
  std::lock_guard<std::mutex> lock(counters_mutex());
  aliases()[owned_name] = user_name;
}

const char* collective_name(Collective kind) {
  switch (kind) {
    case Collective::kAllGather: return "all_gather";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kAllReduce: return "all_reduce";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kReduce: return "reduce";
    case Collective::kScatter: return "scatter";
  }
  return "unknown";
}

void count_collective(const std::string& group_name, Collective kind, int64_t bytes) {
  std::lock_guard<std::mutex> lock(counters_mutex());
  auto alias = aliases().find(group_name);
  const std::string& name = alias == aliases().end() ? group_name : alias->second;
  CommCounter& c = counters()[{name, collective_name(kind)}];
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

}  // namespace tpx
