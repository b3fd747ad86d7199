#include "muster/agent/numa.h"

#include <dlfcn.h>
#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace muster::agent {
namespace {

std::set<int> cpus_of_node(const CpuTopology& t, int node) {
  std::set<int> out;
  auto it = t.node_cpus.find(node);
  if (it == t.node_cpus.end()) return out;
  for (int cpu : it->second) {
    if (t.allowed.count(cpu) != 0) out.insert(cpu);
  }
  return out;
}

int lookup(const std::map<int, int>& m, int key, int fallback) {
  auto it = m.find(key);
  return it == m.end() ? fallback : it->second;
}

// Groups `cpus` by key(cpu), groups ordered by key.
template <typename Key>
std::map<int, std::set<int>> group_by(const std::set<int>& cpus, Key key) {
  std::map<int, std::set<int>> groups;
  for (int cpu : cpus) groups[key(cpu)].insert(cpu);
  return groups;
}

// Share `index` of `n` of `items`, the first (size % n) shares one larger (torchrun's split).
template <typename T>
std::vector<T> share(const std::vector<T>& items, int index, int n) {
  const int each = static_cast<int>(items.size()) / n;
  const int extra = static_cast<int>(items.size()) % n;
  const int start = index * each + std::min(index, extra);
  const int end = start + each + (index < extra ? 1 : 0);
  return std::vector<T>(items.begin() + start, items.begin() + end);
}

std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return std::string(absl::StripAsciiWhitespace(s));
}

// The NUMA node of each CUDA device, through the driver API (no link-time dependency):
// cuDeviceGetPCIBusId, then the PCI device's numa_node (-1 on one-node hosts: node 0).
std::vector<int> gpu_numa_nodes() {
  std::vector<int> nodes;
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return nodes;
  using InitFn = int (*)(unsigned);
  using CountFn = int (*)(int*);
  using GetFn = int (*)(int*, int);
  using BusIdFn = int (*)(char*, int, int);
  auto init = reinterpret_cast<InitFn>(::dlsym(lib, "cuInit"));
  auto count = reinterpret_cast<CountFn>(::dlsym(lib, "cuDeviceGetCount"));
  auto get = reinterpret_cast<GetFn>(::dlsym(lib, "cuDeviceGet"));
  auto bus_id = reinterpret_cast<BusIdFn>(::dlsym(lib, "cuDeviceGetPCIBusId"));
  int n = 0;
  if (init == nullptr || count == nullptr || get == nullptr || bus_id == nullptr || init(0) != 0 ||
      count(&n) != 0) {
    return nodes;
  }
  for (int i = 0; i < n; ++i) {
    int dev = 0;
    char id[64] = {};
    unsigned domain = 0, bus = 0, device = 0, function = 0;
    int node = 0;
    if (get(&dev, i) == 0 && bus_id(id, sizeof id, dev) == 0 &&
        std::sscanf(id, "%x:%x:%x.%x", &domain, &bus, &device, &function) == 4) {
      const std::string addr = absl::StrFormat("%04x:%02x:%02x.%x", domain, bus, device, function);
      int v = 0;
      if (absl::SimpleAtoi(read_text("/sys/bus/pci/devices/" + addr + "/numa_node"), &v)) {
        node = std::max(v, 0);
      }
    }
    nodes.push_back(node);
  }
  return nodes;
}

}  // namespace

absl::StatusOr<NumaMode> parse_numa_mode(std::string_view text) {
  for (NumaMode m : {NumaMode::kNode, NumaMode::kSocket, NumaMode::kExclusive,
                     NumaMode::kCoreComplex}) {
    if (text == numa_mode_name(m)) return m;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "--numa_binding: '", std::string(text), "' is not a mode (node, socket, exclusive, core-complex)"));
}

const char* numa_mode_name(NumaMode mode) {
  switch (mode) {
    case NumaMode::kNode:
      return "node";
    case NumaMode::kSocket:
      return "socket";
    case NumaMode::kExclusive:
      return "exclusive";
    case NumaMode::kCoreComplex:
      return "core-complex";
  }
  return "?";
}

absl::StatusOr<std::vector<NumaBinding>> plan_numa_binding(NumaMode mode, const CpuTopology& t,
                                                           int nproc) {
  const std::string what = absl::StrCat("--numa_binding=", numa_mode_name(mode));
  std::vector<int> usable;  // nodes with CPUs launch may use
  for (const auto& [node, cpus] : t.node_cpus) {
    if (!cpus_of_node(t, node).empty()) usable.push_back(node);
  }
  if (usable.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": no NUMA node has a CPU launch may use"));
  }
  std::vector<int> node_of(nproc);
  for (int r = 0; r < nproc; ++r) {
    if (t.gpu_nodes.empty()) {
      node_of[r] = usable[r % usable.size()];
    } else if (r < static_cast<int>(t.gpu_nodes.size())) {
      node_of[r] = t.gpu_nodes[r];
    } else {
      return absl::FailedPreconditionError(absl::StrCat(
          what, ": local rank ", r, " has no GPU (", t.gpu_nodes.size(), " visible)"));
    }
  }
  std::vector<NumaBinding> plan(nproc);
  for (int r = 0; r < nproc; ++r) {
    const int node = node_of[r];
    const std::set<int> mine = cpus_of_node(t, node);
    std::vector<int> peers;  // the local ranks on this node, in order
    for (int q = 0; q < nproc; ++q) {
      if (node_of[q] == node) peers.push_back(q);
    }
    const int index = static_cast<int>(std::find(peers.begin(), peers.end(), r) - peers.begin());
    const int n = static_cast<int>(peers.size());
    NumaBinding& b = plan[r];
    b.memory_node = node;
    switch (mode) {
      case NumaMode::kNode:
        b.cpus = mine;
        break;
      case NumaMode::kSocket: {
        auto package_of_node = [&t](int nd) {
          const std::set<int> c = cpus_of_node(t, nd);
          return c.empty() ? -1 : lookup(t.cpu_package, *c.begin(), 0);
        };
        const int package = package_of_node(node);
        for (int nd : usable) {
          if (package_of_node(nd) != package) continue;
          const std::set<int> c = cpus_of_node(t, nd);
          b.cpus.insert(c.begin(), c.end());
        }
        break;
      }
      case NumaMode::kExclusive: {
        auto cores = group_by(mine, [&t](int cpu) { return lookup(t.cpu_core, cpu, cpu); });
        std::vector<std::set<int>> units;
        if (static_cast<int>(cores.size()) >= n) {
          for (auto& [core, cpus] : cores) units.push_back(cpus);
        } else if (static_cast<int>(mine.size()) >= n) {
          // Fewer physical cores than ranks: share out the logical CPUs instead.
          for (int cpu : mine) units.push_back({cpu});
        } else {
          return absl::FailedPreconditionError(
              absl::StrCat(what, ": NUMA node ", node, " has ", mine.size(), " CPUs for ", n,
                           " local ranks; each needs one of its own"));
        }
        for (const std::set<int>& u : share(units, index, n)) b.cpus.insert(u.begin(), u.end());
        break;
      }
      case NumaMode::kCoreComplex: {
        const int whole = mine.empty() ? 0 : *mine.begin();
        auto groups = group_by(mine, [&](int cpu) { return lookup(t.cpu_cache, cpu, whole); });
        std::vector<std::pair<int, std::set<int>>> ordered(groups.begin(), groups.end());
        // Larger groups first, then by lowest CPU (torchrun's order).
        std::stable_sort(ordered.begin(), ordered.end(), [](const auto& a, const auto& b) {
          return a.second.size() > b.second.size();
        });
        if (!ordered.empty()) b.cpus = ordered[index % ordered.size()].second;
        break;
      }
    }
    if (b.cpus.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": local rank ", r, " would get no CPU on NUMA node ", node));
    }
  }
  return plan;
}

CpuTopology read_topology() {
  namespace fs = std::filesystem;
  CpuTopology t;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) == 0) {
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
      if (CPU_ISSET(cpu, &set)) t.allowed.insert(cpu);
    }
  }
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/sys/devices/system/node", ec)) {
    const std::string name = e.path().filename().string();
    int node = 0;
    if (name.rfind("node", 0) != 0 || !absl::SimpleAtoi(name.substr(4), &node)) continue;
    std::set<int> cpus = parse_cpu_list(read_text(e.path() / "cpulist"));
    if (!cpus.empty()) t.node_cpus[node] = std::move(cpus);
  }
  if (t.node_cpus.empty()) t.node_cpus[0] = t.allowed;  // a kernel without NUMA: one node
  for (const auto& [node, cpus] : t.node_cpus) {
    for (int cpu : cpus) {
      const fs::path dir = fs::path("/sys/devices/system/cpu") / ("cpu" + std::to_string(cpu));
      int package = 0;
      if (absl::SimpleAtoi(read_text(dir / "topology/physical_package_id"), &package)) {
        t.cpu_package[cpu] = package;
      }
      const std::set<int> siblings = parse_cpu_list(read_text(dir / "topology/thread_siblings_list"));
      if (!siblings.empty()) t.cpu_core[cpu] = *siblings.begin();
      int best_level = -1;
      for (const auto& c : fs::directory_iterator(dir / "cache", ec)) {
        const std::string cname = c.path().filename().string();
        if (cname.rfind("index", 0) != 0) continue;
        const std::string type = read_text(c.path() / "type");
        if (type != "Unified" && type != "Data") continue;
        int level = 0;
        if (!absl::SimpleAtoi(read_text(c.path() / "level"), &level) || level <= best_level) continue;
        const std::set<int> shared = parse_cpu_list(read_text(c.path() / "shared_cpu_list"));
        if (shared.empty()) continue;
        best_level = level;
        t.cpu_cache[cpu] = *shared.begin();
      }
    }
  }
  t.gpu_nodes = gpu_numa_nodes();
  return t;
}

std::set<int> parse_cpu_list(std::string_view text) {
  std::set<int> out;
  for (absl::string_view item :
       absl::StrSplit(absl::string_view(text.data(), text.size()), ',', absl::SkipWhitespace())) {
    item = absl::StripAsciiWhitespace(item);
    std::vector<absl::string_view> range = absl::StrSplit(item, '-');
    int lo = 0, hi = 0;
    if (range.size() == 1 && absl::SimpleAtoi(range[0], &lo)) {
      out.insert(lo);
    } else if (range.size() == 2 && absl::SimpleAtoi(range[0], &lo) &&
               absl::SimpleAtoi(range[1], &hi) && lo <= hi && hi - lo < (1 << 20)) {
      for (int c = lo; c <= hi; ++c) out.insert(c);
    }
  }
  return out;
}

std::string cpu_list_text(const std::set<int>& cpus) {
  std::string out;
  for (auto it = cpus.begin(); it != cpus.end();) {
    const int lo = *it;
    int hi = lo;
    for (++it; it != cpus.end() && *it == hi + 1; ++it) hi = *it;
    if (!out.empty()) out += ',';
    out += hi == lo ? std::to_string(lo) : absl::StrCat(lo, "-", hi);
  }
  return out;
}

}  // namespace muster::agent
