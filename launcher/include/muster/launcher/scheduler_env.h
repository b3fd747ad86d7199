// The job as a scheduler step describes it: Slurm's srun, or an MPI launcher (Open MPI's
// mpirun, MPICH / Intel MPI hydra, a PMIx launcher). Pure: environment maps in, values out;
// nothing here reads the process environment or the network.
//
// parse_launch_args applies a derived job under the flags (an explicit flag or PET_* always
// wins); MUSTER_SCHEDULER_ENV=0 turns derivation off. docs/cluster.md ("Slurm", "MPI").
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "muster/ops/endpoint.h"

namespace muster::launcher {

// Slurm's compact host list: top-level commas separate names; a name may hold bracket groups
// of comma-separated numbers and ranges, each expanded in order, several groups as a
// cartesian product with the rightmost varying fastest:
//   "node[01-04,07],gpu-a[1-2]" -> node01 node02 node03 node04 node07 gpu-a1 gpu-a2
//   "r[1-2]-n[01-02]"           -> r1-n01 r1-n02 r2-n01 r2-n02
// A range keeps the zero padding of its lower bound ([08-10] -> 08 09 10). Malformed text
// (empty, an empty name, an unbalanced or nested bracket, [4-2], a non-digit in a group) is
// InvalidArgumentError naming the text; so is a list of more than limits::kMaxSlurmHosts
// hosts, refused before any of it is made.
absl::StatusOr<std::vector<std::string>> expand_slurm_hostlist(absl::string_view text);

// One launch per node, as the scheduler placed it.
struct SchedulerJob {
  std::string source;  // "slurm", "openmpi", "pmi" (MPICH / Intel MPI hydra) or "pmix"
  int nnodes = 1;
  int node_rank = 0;
  // Where node 0 is (workers' MASTER_ADDR; the static rendezvous server is on it). Empty when
  // the environment does not say (mpirun over several hosts without MASTER_ADDR): then
  // `missing_master` is the one-line error for a caller that needs it.
  std::string master_addr;
  std::string missing_master;
  int master_port = 0;  // workers' MASTER_PORT; the static rendezvous server takes the next
  std::string run_id;   // the same on every node of the job
  std::optional<int> nproc_per_node;  // workers per node, when the scheduler says
  std::string nproc_from;             // the variable that gave nproc_per_node
  std::optional<int> cpus_on_node;    // what --nproc_per_node=cpu (and auto without GPUs) counts
  std::string summary;                // one line for launch's log
};

// Ports derived when MASTER_PORT is unset. Under Slurm each job gets its own pair (MASTER_PORT
// even, the rendezvous server on the odd one above it) so jobs that share their first node
// do not meet: kSlurmPortBase + 2 * (SLURM_JOB_ID % kSlurmPortJobs).
inline constexpr int kSlurmPortBase = ops::kDefaultRendezvousPort;
inline constexpr int kSlurmPortJobs = 1000;
inline constexpr int kMpiDefaultPort = ops::kDefaultRendezvousPort;

// nullopt when the environment is no scheduler step: no srun step (a batch script or an
// salloc shell alone is not one) and no MPI rank. Slurm wins over MPI when both are present.
// Errors (InvalidArgumentError, one line naming the variable): numbers that are not numbers
// or out of range, a node list that disagrees with the node count, more than one task or
// process per node, and SLURM_JOB_ID / MPI sizes beyond the bounds.
//
// Slurm (SLURM_JOB_ID, SLURM_STEP_ID or SLURM_STEPID, SLURM_NODEID): nodes and hosts from
// SLURM_STEP_NUM_NODES / SLURM_STEP_NODELIST, else SLURM_JOB_NUM_NODES or SLURM_NNODES /
// SLURM_JOB_NODELIST or SLURM_NODELIST; node rank SLURM_NODEID; master the first host (or
// $MASTER_ADDR); port $MASTER_PORT, else the rule above; run id "slurm-<job>.<step>";
// workers per node SLURM_GPUS_ON_NODE when a positive number; cpus SLURM_CPUS_ON_NODE.
//
// MPI (OMPI_COMM_WORLD_{SIZE,RANK,LOCAL_SIZE}; PMI_SIZE, PMI_RANK, MPI_LOCALNRANKS; PMIX_RANK
// with one of those sizes): nodes = size, node rank = rank; all ranks on one host: master
// 127.0.0.1; one per host: $MASTER_ADDR (else missing_master); port $MASTER_PORT, else
// kMpiDefaultPort; run id "mpi-" + OMPI_MCA_ess_base_jobid or PMIX_NAMESPACE, else "mpi".
absl::StatusOr<std::optional<SchedulerJob>> derive_scheduler_job(
    const std::map<std::string, std::string>& env);

// False when MUSTER_SCHEDULER_ENV is 0, false, no or off (any case): derivation is off.
bool scheduler_env_enabled(const std::map<std::string, std::string>& env);

}  // namespace muster::launcher
