// --numa-binding plans on fake machines (agent/numa.h).
#include "muster/agent/numa.h"

#include <catch2/catch.hpp>

using muster::agent::cpu_list_text;
using muster::agent::CpuTopology;
using muster::agent::NumaMode;
using muster::agent::parse_cpu_list;
using muster::agent::plan_numa_binding;

namespace {

// `nodes` NUMA nodes of `cores` physical cores with 2 hyperthreads each (CPU c and c+total),
// nodes_per_socket nodes per socket, and one last-level cache per `ccx` cores.
CpuTopology fake(int nodes, int cores, int nodes_per_socket, int ccx) {
  CpuTopology t;
  const int total = nodes * cores;
  for (int n = 0; n < nodes; ++n) {
    for (int k = 0; k < cores; ++k) {
      const int c = n * cores + k;
      for (int cpu : {c, c + total}) {
        t.node_cpus[n].insert(cpu);
        t.cpu_package[cpu] = n / nodes_per_socket;
        t.cpu_core[cpu] = c;
        t.cpu_cache[cpu] = n * cores + (k / ccx) * ccx;
        t.allowed.insert(cpu);
      }
    }
  }
  return t;
}

std::vector<std::string> cpus_of(NumaMode mode, const CpuTopology& t, int nproc) {
  auto plan = plan_numa_binding(mode, t, nproc);
  INFO(plan.status().message());
  REQUIRE(plan.ok());
  std::vector<std::string> out;
  for (const auto& b : *plan) out.push_back(cpu_list_text(b.cpus) + "@" + std::to_string(b.memory_node));
  return out;
}

using V = std::vector<std::string>;

}  // namespace

TEST_CASE("numa: cpu lists as sysfs writes them", "[numa]") {
  CHECK(parse_cpu_list("0-3,8,10-11\n") == std::set<int>{0, 1, 2, 3, 8, 10, 11});
  CHECK(parse_cpu_list("") == std::set<int>{});
  CHECK(parse_cpu_list("5") == std::set<int>{5});
  CHECK(cpu_list_text({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11");
  CHECK(cpu_list_text({}) == "");
}

TEST_CASE("numa: modes parse as torchrun names them", "[numa]") {
  CHECK(*muster::agent::parse_numa_mode("core-complex") == NumaMode::kCoreComplex);
  CHECK(*muster::agent::parse_numa_mode("exclusive") == NumaMode::kExclusive);
  CHECK(std::string(muster::agent::parse_numa_mode("numa").status().message()) ==
        "--numa_binding: 'numa' is not a mode (node, socket, exclusive, core-complex)");
}

TEST_CASE("numa: without GPUs, local ranks go round-robin over the nodes", "[numa]") {
  const CpuTopology t = fake(2, 4, 1, 2);  // node 0: 0-3,8-11; node 1: 4-7,12-15
  CHECK(cpus_of(NumaMode::kNode, t, 3) == V{"0-3,8-11@0", "4-7,12-15@1", "0-3,8-11@0"});
  // exclusive: the node's physical cores are split among its ranks, hyperthreads together.
  CHECK(cpus_of(NumaMode::kExclusive, t, 4) ==
        V{"0-1,8-9@0", "4-5,12-13@1", "2-3,10-11@0", "6-7,14-15@1"});
  // 3 ranks on node 0 (ranks 0, 2, 4) share 4 cores: the first gets the extra one.
  CHECK(cpus_of(NumaMode::kExclusive, t, 5) ==
        V{"0-1,8-9@0", "4-5,12-13@1", "2,10@0", "6-7,14-15@1", "3,11@0"});
  // core-complex: one last-level-cache group each, a different one per rank on a node.
  CHECK(cpus_of(NumaMode::kCoreComplex, t, 6) ==
        V{"0-1,8-9@0", "4-5,12-13@1", "2-3,10-11@0", "6-7,14-15@1", "0-1,8-9@0", "4-5,12-13@1"});
}

TEST_CASE("numa: socket binds to every node of the socket", "[numa]") {
  const CpuTopology t = fake(4, 2, 2, 2);  // sockets: nodes {0,1} and {2,3}
  CHECK(cpus_of(NumaMode::kSocket, t, 4) ==
        V{"0-3,8-11@0", "0-3,8-11@1", "4-7,12-15@2", "4-7,12-15@3"});
  CHECK(cpus_of(NumaMode::kNode, t, 1) == V{"0-1,8-9@0"});
}

TEST_CASE("numa: with GPUs, local rank r follows GPU r's node", "[numa]") {
  CpuTopology t = fake(2, 4, 1, 4);
  t.gpu_nodes = {1, 1, 0, 1};
  CHECK(cpus_of(NumaMode::kNode, t, 4) == V{"4-7,12-15@1", "4-7,12-15@1", "0-3,8-11@0", "4-7,12-15@1"});
  // Three GPUs on node 1 split its 4 cores: 2, 1, 1.
  CHECK(cpus_of(NumaMode::kExclusive, t, 4) ==
        V{"4-5,12-13@1", "6,14@1", "0-3,8-11@0", "7,15@1"});
  auto past = plan_numa_binding(NumaMode::kNode, t, 5);
  REQUIRE_FALSE(past.ok());
  CHECK(std::string(past.status().message()) ==
        "--numa_binding=node: local rank 4 has no GPU (4 visible)");
}

TEST_CASE("numa: only CPUs launch may use, exclusive needs a CPU per rank", "[numa]") {
  CpuTopology t = fake(1, 2, 1, 2);  // CPUs 0-3, cores {0,2} {1,3}
  CHECK(cpus_of(NumaMode::kExclusive, t, 2) == V{"0,2@0", "1,3@0"});
  // More ranks than cores: the logical CPUs are shared out instead.
  CHECK(cpus_of(NumaMode::kExclusive, t, 4) == V{"0@0", "1@0", "2@0", "3@0"});
  auto too_many = plan_numa_binding(NumaMode::kExclusive, t, 5);
  REQUIRE_FALSE(too_many.ok());
  CHECK(std::string(too_many.status().message()) ==
        "--numa_binding=exclusive: NUMA node 0 has 4 CPUs for 5 local ranks; each needs one of "
        "its own");
  t.allowed = {1, 3};  // launch itself runs on two CPUs only
  CHECK(cpus_of(NumaMode::kNode, t, 2) == V{"1,3@0", "1,3@0"});
  CHECK(cpus_of(NumaMode::kExclusive, t, 2) == V{"1@0", "3@0"});
}

TEST_CASE("numa: core-complex prefers larger cache groups, no cache info is one group", "[numa]") {
  CpuTopology t;
  t.node_cpus[0] = {0, 1, 2, 3, 4, 5};
  t.allowed = t.node_cpus[0];
  for (int c : {0, 1}) t.cpu_cache[c] = 0;
  for (int c : {2, 3, 4, 5}) t.cpu_cache[c] = 2;
  CHECK(cpus_of(NumaMode::kCoreComplex, t, 3) == V{"2-5@0", "0-1@0", "2-5@0"});
  t.cpu_cache.clear();
  CHECK(cpus_of(NumaMode::kCoreComplex, t, 2) == V{"0-5@0", "0-5@0"});
}

TEST_CASE("numa: this host's topology reads", "[numa]") {
  const CpuTopology t = muster::agent::read_topology();
  CHECK_FALSE(t.node_cpus.empty());
  CHECK_FALSE(t.allowed.empty());
  REQUIRE(plan_numa_binding(NumaMode::kNode, t, 1).ok());
}
