// --numa-binding (torchrun 2.x): which CPUs and which memory node each local rank is bound
// to. The plan is pure (a topology in, one binding per local rank out) so that every mode is
// unit-tested on fake machines; read_topology() reads the real one from /sys.
#pragma once

#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace muster::agent {

// torchrun's affinity modes (torch/numa/binding.py), as launch applies them; docs/launch.md.
enum class NumaMode {
  kNode,         // every CPU of the rank's NUMA node
  kSocket,       // every CPU of every NUMA node on the socket of the rank's node
  kExclusive,    // a disjoint share of the node's physical cores, split among its ranks
  kCoreComplex,  // one group of CPUs sharing the highest-level cache, a different one per rank
};
absl::StatusOr<NumaMode> parse_numa_mode(std::string_view text);  // node, socket, ...
const char* numa_mode_name(NumaMode mode);

// What binding needs to know about the host.
struct CpuTopology {
  std::map<int, std::set<int>> node_cpus;  // NUMA node -> its CPUs
  std::map<int, int> cpu_package;          // CPU -> physical_package_id (absent: 0)
  std::map<int, int> cpu_core;             // CPU -> lowest CPU of its physical core (absent: itself)
  std::map<int, int> cpu_cache;            // CPU -> lowest CPU sharing its last-level cache
                                           // (absent: the whole node is one group)
  std::set<int> allowed;                   // launch's own CPU affinity
  // The NUMA node of each CUDA device, by the index workers use (launch's
  // CUDA_VISIBLE_DEVICES order); empty on a host without CUDA devices.
  std::vector<int> gpu_nodes;
};

// One local rank's binding: the CPUs it may run on and the memory node it prefers.
struct NumaBinding {
  std::set<int> cpus;
  int memory_node = -1;
};

// The binding of each of `nproc` local ranks. Local rank r belongs to the node of GPU r when
// the host has CUDA devices, else to the r-th node (round-robin) among the nodes with allowed
// CPUs. Fails when a rank would get no CPU (exclusive: fewer CPUs than ranks on a node) or
// has no GPU.
absl::StatusOr<std::vector<NumaBinding>> plan_numa_binding(NumaMode mode, const CpuTopology& topo,
                                                           int nproc);

// This host's topology: /sys/devices/system/node/node*/cpulist (no such folder: one node 0),
// /sys/devices/system/cpu/cpu*/topology and cache, sched_getaffinity, and for CUDA devices
// (through the driver, libcuda.so.1, when it loads) /sys/bus/pci/devices/<addr>/numa_node.
CpuTopology read_topology();

// sysfs lists: "0-3,8,10-11" <-> {0,1,2,3,8,10,11}.
std::set<int> parse_cpu_list(std::string_view text);
std::string cpu_list_text(const std::set<int>& cpus);

}  // namespace muster::agent
