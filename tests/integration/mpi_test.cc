// launch under a real mpirun (Open MPI): every rank is one node's agent, and the agents form
// one job from the MPI environment alone (scheduler_env.h), on one host.
//
// Exits 77 (ctest: Skipped) where there is no mpirun on PATH.
#include <sys/socket.h>
#include <netinet/in.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <regex>
#include <set>
#include <string>
#include <vector>

#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "helpers.h"
#include "proc.h"

using namespace muster::testing;

namespace {

// What each worker prints: its place in the job.
const char* kReport =
    "echo \"worker RANK=$RANK WORLD_SIZE=$WORLD_SIZE GROUP_RANK=$GROUP_RANK "
    "LOCAL_RANK=$LOCAL_RANK MASTER=$MASTER_ADDR:$MASTER_PORT RUN=$TORCHELASTIC_RUN_ID\"";

std::vector<std::string> mpirun(int np, const std::vector<std::string>& exports,
                                const std::vector<std::string>& launch_flags) {
  std::vector<std::string> argv{find_on_path("mpirun"), "--allow-run-as-root", "--oversubscribe",
                                "-np", std::to_string(np)};
  for (const std::string& x : exports) {
    argv.push_back("-x");
    argv.push_back(x);
  }
  argv.push_back(kLaunch);
  argv.insert(argv.end(), launch_flags.begin(), launch_flags.end());
  for (const char* a : {"/bin/sh", "-c", kReport}) argv.push_back(a);
  return argv;
}

struct Report {
  int rank, world, group, local;
  std::string master, run;
};

std::vector<Report> reports(const std::string& out) {
  static const std::regex re(
      R"(worker RANK=(\d+) WORLD_SIZE=(\d+) GROUP_RANK=(\d+) LOCAL_RANK=(\d+) MASTER=(\S*) RUN=(\S*))");
  std::vector<Report> r;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator();
       ++it) {
    r.push_back({std::stoi((*it)[1]), std::stoi((*it)[2]), std::stoi((*it)[3]),
                 std::stoi((*it)[4]), (*it)[5], (*it)[6]});
  }
  return r;
}

// mpirun must not see an MPI or Slurm job around the test itself.
std::map<std::string, std::optional<std::string>> clean_env() {
  std::map<std::string, std::optional<std::string>> env;
  for (const char* k : {"MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID", "SLURM_JOBID",
                        "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_NODEID", "MUSTER_SCHEDULER_ENV",
                        "PET_NNODES", "PET_NODE_RANK", "PET_NPROC_PER_NODE"}) {
    env[k] = std::nullopt;
  }
  env["MUSTER_LOG_LEVEL"] = "info";
  return env;
}

}  // namespace

TEST_CASE("mpirun -np 2: two agents form one 2-node job from Open MPI's ranks", "[mpi]") {
  const int port = free_port_pair();
  REQUIRE(port > 0);
  Proc p(mpirun(2, {"MASTER_PORT=" + std::to_string(port), "MUSTER_LOG_LEVEL"},
                {"--nproc_per_node=1"}),
         clean_env());
  auto rc = p.wait(60s);
  if (!rc) {  // mpirun ends its launches on SIGTERM (a SIGKILL would orphan them)
    ::kill(p.pid(), SIGTERM);
    p.wait(10s);
  }
  INFO("stdout:\n" << p.out() << "\nstderr:\n" << p.err());
  REQUIRE(rc.has_value());
  CHECK(*rc == 0);
  auto r = reports(p.out());
  REQUIRE(r.size() == 2);
  std::set<int> ranks, groups;
  for (const Report& w : r) {
    ranks.insert(w.rank);
    groups.insert(w.group);
    CHECK(w.world == 2);
    CHECK(w.rank == w.group);  // one worker per node: rank = node rank
    CHECK(w.local == 0);
    CHECK(w.master == "127.0.0.1:" + std::to_string(port));
    CHECK_THAT(w.run, Catch::StartsWith("mpi-"));
    CHECK(w.run == r.front().run);
  }
  CHECK(ranks == std::set<int>{0, 1});
  CHECK(groups == std::set<int>{0, 1});
  // Each agent says where its job came from.
  CHECK_THAT(p.err(), Catch::Contains("openmpi: rank 0 of 2 (all on this host)") &&
                          Catch::Contains("openmpi: rank 1 of 2 (all on this host)") &&
                          Catch::Contains("static rendezvous"));
}

TEST_CASE("mpirun -np 2 --nproc_per_node=2: ranks contiguous per node, in MPI rank order",
          "[mpi]") {
  const int port = free_port_pair();
  REQUIRE(port > 0);
  Proc p(mpirun(2, {"MASTER_PORT=" + std::to_string(port), "MUSTER_LOG_LEVEL"},
                {"--nproc_per_node=2"}),
         clean_env());
  auto rc = p.wait(60s);
  if (!rc) {  // mpirun ends its launches on SIGTERM (a SIGKILL would orphan them)
    ::kill(p.pid(), SIGTERM);
    p.wait(10s);
  }
  INFO("stdout:\n" << p.out() << "\nstderr:\n" << p.err());
  REQUIRE(rc.has_value());
  CHECK(*rc == 0);
  auto r = reports(p.out());
  REQUIRE(r.size() == 4);
  std::set<int> ranks;
  for (const Report& w : r) {
    ranks.insert(w.rank);
    CHECK(w.world == 4);
    CHECK(w.rank == 2 * w.group + w.local);
  }
  CHECK(ranks == std::set<int>{0, 1, 2, 3});
}

TEST_CASE("mpirun -np 2 with MUSTER_SCHEDULER_ENV=0: two separate one-node jobs", "[mpi]") {
  Proc p(mpirun(2, {"MUSTER_SCHEDULER_ENV=0", "MUSTER_LOG_LEVEL"}, {"--nproc_per_node=1"}),
         clean_env());
  auto rc = p.wait(60s);
  if (!rc) {  // mpirun ends its launches on SIGTERM (a SIGKILL would orphan them)
    ::kill(p.pid(), SIGTERM);
    p.wait(10s);
  }
  INFO("stdout:\n" << p.out() << "\nstderr:\n" << p.err());
  REQUIRE(rc.has_value());
  CHECK(*rc == 0);
  auto r = reports(p.out());
  REQUIRE(r.size() == 2);
  for (const Report& w : r) {
    CHECK(w.world == 1);
    CHECK(w.rank == 0);
  }
  CHECK_THAT(p.err(), !Catch::Contains("openmpi:"));
}

int main(int argc, char** argv) {
  if (find_on_path("mpirun").empty()) {
    std::fprintf(stderr, "mpi_tests: no mpirun on PATH (Open MPI: apt-get install openmpi-bin); "
                         "skipped\n");
    return kSkipExit;
  }
  return catch_exit(Catch::Session().run(argc, argv));
}
