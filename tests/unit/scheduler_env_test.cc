// The job from a scheduler's environment (scheduler_env.h) over recorded environments: what
// srun (Slurm 22.05), Open MPI 4's mpirun and MPICH's hydra give a task, and how
// parse_launch_args applies it under the flags.
#include "muster/launcher/scheduler_env.h"

#include <stdlib.h>

#include <catch2/catch.hpp>
#include <map>
#include <string>
#include <vector>

#include "muster/launcher/config.h"
#include "muster/rendezvous/limits.h"

using muster::launcher::derive_scheduler_job;
using muster::launcher::expand_slurm_hostlist;
using muster::launcher::HostInfo;
using muster::launcher::LaunchConfig;
using muster::launcher::parse_launch_args;
using muster::launcher::RdzvMode;
using muster::launcher::SchedulerJob;
using Env = std::map<std::string, std::string>;
using Hosts = std::vector<std::string>;

namespace {

// `srun -N4 --ntasks-per-node=1 --gpus-per-node=8 launch ...` inside `sbatch -N4` (job 123),
// as the task on the second node sees it.
Env srun_step() {
  return {
      {"SLURM_CLUSTER_NAME", "cluster"},
      {"SLURM_CONF", "/etc/slurm/slurm.conf"},
      {"SLURM_CPUS_ON_NODE", "64"},
      {"SLURM_CPU_BIND", "quiet,mask_cpu:0xFFFFFFFFFFFFFFFF"},
      {"SLURM_CPU_BIND_LIST", "0xFFFFFFFFFFFFFFFF"},
      {"SLURM_CPU_BIND_TYPE", "mask_cpu:"},
      {"SLURM_CPU_BIND_VERBOSE", "quiet"},
      {"SLURM_DISTRIBUTION", "cyclic"},
      {"SLURM_GPUS_ON_NODE", "8"},
      {"SLURM_GPUS_PER_NODE", "8"},
      {"SLURM_GTIDS", "1"},
      {"SLURM_JOBID", "123"},
      {"SLURM_JOB_ACCOUNT", "research"},
      {"SLURM_JOB_CPUS_PER_NODE", "64(x4)"},
      {"SLURM_JOB_GID", "1000"},
      {"SLURM_JOB_GPUS", "0,1,2,3,4,5,6,7"},
      {"SLURM_JOB_ID", "123"},
      {"SLURM_JOB_NAME", "train"},
      {"SLURM_JOB_NODELIST", "node[01-04]"},
      {"SLURM_JOB_NUM_NODES", "4"},
      {"SLURM_JOB_PARTITION", "gpu"},
      {"SLURM_JOB_QOS", "normal"},
      {"SLURM_JOB_UID", "1000"},
      {"SLURM_JOB_USER", "alice"},
      {"SLURM_LAUNCH_NODE_IPADDR", "10.0.0.1"},
      {"SLURM_LOCALID", "0"},
      {"SLURM_NNODES", "4"},
      {"SLURM_NODEID", "1"},
      {"SLURM_NODELIST", "node[01-04]"},
      {"SLURM_NPROCS", "4"},
      {"SLURM_NTASKS", "4"},
      {"SLURM_NTASKS_PER_NODE", "1"},
      {"SLURM_PRIO_PROCESS", "0"},
      {"SLURM_PROCID", "1"},
      {"SLURM_SRUN_COMM_HOST", "10.0.0.1"},
      {"SLURM_SRUN_COMM_PORT", "41355"},
      {"SLURM_STEPID", "0"},
      {"SLURM_STEP_GPUS", "0,1,2,3,4,5,6,7"},
      {"SLURM_STEP_ID", "0"},
      {"SLURM_STEP_LAUNCHER_PORT", "41355"},
      {"SLURM_STEP_NODELIST", "node[01-04]"},
      {"SLURM_STEP_NUM_NODES", "4"},
      {"SLURM_STEP_NUM_TASKS", "4"},
      {"SLURM_STEP_TASKS_PER_NODE", "1(x4)"},
      {"SLURM_SUBMIT_DIR", "/home/alice"},
      {"SLURM_SUBMIT_HOST", "login1"},
      {"SLURM_TASKS_PER_NODE", "1(x4)"},
      {"SLURM_TASK_PID", "51234"},
      {"SLURM_TOPOLOGY_ADDR", "node02"},
      {"SLURM_TOPOLOGY_ADDR_PATTERN", "node"},
      {"SLURM_UMASK", "0022"},
      {"SLURMD_NODENAME", "node02"},
      {"CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7"},
      {"PATH", "/usr/bin:/bin"},
  };
}

// The batch script of that job (sbatch -N4): the job's variables, no step.
Env sbatch_script() {
  return {
      {"SLURM_CLUSTER_NAME", "cluster"},
      {"SLURM_CPUS_ON_NODE", "64"},
      {"SLURM_GPUS_ON_NODE", "8"},
      {"SLURM_GTIDS", "0"},
      {"SLURM_JOBID", "123"},
      {"SLURM_JOB_CPUS_PER_NODE", "64(x4)"},
      {"SLURM_JOB_ID", "123"},
      {"SLURM_JOB_NAME", "train"},
      {"SLURM_JOB_NODELIST", "node[01-04]"},
      {"SLURM_JOB_NUM_NODES", "4"},
      {"SLURM_JOB_PARTITION", "gpu"},
      {"SLURM_LOCALID", "0"},
      {"SLURM_NNODES", "4"},
      {"SLURM_NODEID", "0"},
      {"SLURM_NODELIST", "node[01-04]"},
      {"SLURM_PROCID", "0"},
      {"SLURM_SUBMIT_DIR", "/home/alice"},
      {"SLURM_SUBMIT_HOST", "login1"},
      {"SLURM_TASKS_PER_NODE", "64(x4)"},
      {"SLURM_TASK_PID", "50001"},
      {"SLURM_TOPOLOGY_ADDR", "node01"},
      {"SLURMD_NODENAME", "node01"},
      {"PATH", "/usr/bin:/bin"},
  };
}

// Open MPI 4.1.4's `mpirun -np 2` on one host, rank 1 (recorded here, trimmed of URIs).
Env ompi_one_host() {
  return {
      {"OMPI_APP_CTX_NUM_PROCS", "2"},
      {"OMPI_COMMAND", "launch"},
      {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
      {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
      {"OMPI_COMM_WORLD_NODE_RANK", "1"},
      {"OMPI_COMM_WORLD_RANK", "1"},
      {"OMPI_COMM_WORLD_SIZE", "2"},
      {"OMPI_FIRST_RANKS", "0"},
      {"OMPI_MCA_ess", "^singleton"},
      {"OMPI_MCA_ess_base_jobid", "437518337"},
      {"OMPI_MCA_ess_base_vpid", "1"},
      {"OMPI_MCA_initial_wdir", "/tmp"},
      {"OMPI_MCA_orte_app_num", "0"},
      {"OMPI_MCA_orte_ess_node_rank", "1"},
      {"OMPI_MCA_orte_ess_num_procs", "2"},
      {"OMPI_MCA_orte_launch", "1"},
      {"OMPI_MCA_orte_num_nodes", "1"},
      {"OMPI_MCA_pmix", "^s1,s2,cray,isolated"},
      {"OMPI_NUM_APP_CTX", "1"},
      {"OMPI_UNIVERSE_SIZE", "2"},
      {"PMIX_HOSTNAME", "vm"},
      {"PMIX_ID", "437518337.1"},
      {"PMIX_NAMESPACE", "437518337"},
      {"PMIX_RANK", "1"},
      {"PMIX_SECURITY_MODE", "native"},
      {"PMIX_VERSION", "4.2.2rc2"},
      {"PATH", "/usr/bin:/bin"},
  };
}

// The same mpirun over 4 hosts, one per node (--map-by ppr:1:node), rank 2.
Env ompi_four_hosts() {
  Env e = ompi_one_host();
  e["OMPI_COMM_WORLD_SIZE"] = "4";
  e["OMPI_COMM_WORLD_RANK"] = "2";
  e["OMPI_COMM_WORLD_LOCAL_SIZE"] = "1";
  e["OMPI_COMM_WORLD_LOCAL_RANK"] = "0";
  e["OMPI_MCA_orte_num_nodes"] = "4";
  e["PMIX_RANK"] = "2";
  return e;
}

// MPICH 4 hydra (`mpiexec -n 3 -ppn 1 -hosts a,b,c`), rank 2.
Env hydra() {
  return {
      {"PMI_RANK", "2"},
      {"PMI_SIZE", "3"},
      {"PMI_FD", "6"},
      {"MPI_LOCALNRANKS", "1"},
      {"MPI_LOCALRANKID", "0"},
      {"MASTER_ADDR", "a"},
      {"PATH", "/usr/bin:/bin"},
  };
}

SchedulerJob derive_ok(const Env& env) {
  auto j = derive_scheduler_job(env);
  INFO(j.status().message());
  REQUIRE(j.ok());
  REQUIRE(j->has_value());
  return **j;
}

std::string derive_err(const Env& env) {
  auto j = derive_scheduler_job(env);
  REQUIRE_FALSE(j.ok());
  CHECK(j.status().code() == absl::StatusCode::kInvalidArgument);
  return std::string(j.status().message());
}

HostInfo fake_host(int cpus, int gpus) {
  HostInfo h;
  h.cpu_count = cpus;
  h.gpu_count = [gpus] { return gpus; };
  return h;
}

LaunchConfig parse_ok(const std::vector<std::string>& args, const Env& env,
                      HostInfo host = fake_host(2, 0)) {
  auto r = parse_launch_args(args, host, env);
  INFO(r.error.message());
  REQUIRE(r.error.ok());
  REQUIRE(r.config.has_value());
  return *r.config;
}

std::string parse_err(const std::vector<std::string>& args, const Env& env) {
  auto r = parse_launch_args(args, fake_host(2, 0), env);
  REQUIRE_FALSE(r.config.has_value());
  REQUIRE_FALSE(r.error.ok());
  return std::string(r.error.message());
}

// Sets process variables (PET_* is read by CLI11 from the process) for one scope, and puts
// back what was there.
class ScopedSetenv {
 public:
  ScopedSetenv(const char* key, const char* value) : key_(key) {
    if (const char* old = ::getenv(key)) old_ = old;
    ::setenv(key, value, 1);
  }
  ~ScopedSetenv() {
    if (old_) {
      ::setenv(key_.c_str(), old_->c_str(), 1);
    } else {
      ::unsetenv(key_.c_str());
    }
  }

 private:
  std::string key_;
  std::optional<std::string> old_;
};

}  // namespace

TEST_CASE("slurm host lists: ranges, lists, padding, several groups", "[scheduler]") {
  CHECK(*expand_slurm_hostlist("node[01-04,07],gpu-a[1-2]") ==
        Hosts{"node01", "node02", "node03", "node04", "node07", "gpu-a1", "gpu-a2"});
  CHECK(*expand_slurm_hostlist("n1") == Hosts{"n1"});
  CHECK(*expand_slurm_hostlist("a,b.example.com,c-1") == Hosts{"a", "b.example.com", "c-1"});
  CHECK(*expand_slurm_hostlist("n[08-10]") == Hosts{"n08", "n09", "n10"});
  CHECK(*expand_slurm_hostlist("n[9-11]") == Hosts{"n9", "n10", "n11"});
  CHECK(*expand_slurm_hostlist("n[007]") == Hosts{"n007"});
  CHECK(*expand_slurm_hostlist("r[1-2]-n[01-02]") ==
        Hosts{"r1-n01", "r1-n02", "r2-n01", "r2-n02"});
  CHECK(*expand_slurm_hostlist("[1-2]x") == Hosts{"1x", "2x"});
  CHECK(*expand_slurm_hostlist("a[3,1]b,c") == Hosts{"a3b", "a1b", "c"});  // order as given
  CHECK(expand_slurm_hostlist("n[0-99999]")->size() == 100000);
}

TEST_CASE("slurm host lists: malformed text is one error naming it", "[scheduler]") {
  const std::vector<std::pair<std::string, std::string>> cases{
      {"", "empty"},
      {"node[01-04", "without its ']'"},
      {"node01-04]", "without its '['"},
      {"n[1-[2]]", "inside brackets"},
      {"n[4-2]", "backwards"},
      {"n[a-b]", "not a number"},
      {"n[1-2x]", "not a number"},
      {"n[1--2]", "not a number"},
      {"n[1-]", "empty number"},
      {"n[,1]", "empty number"},
      {"n[]", "empty []"},
      {"a,,b", "empty name"},
      {"a,", "empty name"},
      {",a", "empty name"},
      {"n[1234567890123456789-1234567890123456790]", "too long"},
  };
  for (const auto& [text, why] : cases) {
    INFO(text);
    auto r = expand_slurm_hostlist(text);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(r.status().message()),
               Catch::Contains("'" + text + "'") && Catch::Contains(why));
  }
}

TEST_CASE("slurm host lists: refused above kMaxSlurmHosts, before expanding", "[scheduler]") {
  namespace limits = muster::rendezvous::limits;
  static_assert(limits::kMaxSlurmHosts == 100000);
  for (const char* text : {"n[0-100000]", "n[0-99999],x", "r[0-999]-n[0-999]",
                           "n[0-999999999999999999]", "a[0-99999999]b[0-99999999]c[0-9]"}) {
    INFO(text);
    auto r = expand_slurm_hostlist(text);
    REQUIRE_FALSE(r.ok());
    CHECK_THAT(std::string(r.status().message()), Catch::Contains("more than 100000 hosts"));
  }
  CHECK(expand_slurm_hostlist("n[0-99998],x")->size() == 100000);
}

TEST_CASE("slurm: an srun step gives nodes, rank, master, port, run id and GPUs", "[scheduler]") {
  SchedulerJob j = derive_ok(srun_step());
  CHECK(j.source == "slurm");
  CHECK(j.nnodes == 4);
  CHECK(j.node_rank == 1);
  CHECK(j.master_addr == "node01");
  CHECK(j.master_port == 29400 + 2 * 123);
  CHECK(j.run_id == "slurm-123.0");
  CHECK(j.nproc_per_node == 8);
  CHECK(j.nproc_from == "SLURM_GPUS_ON_NODE");
  CHECK(j.cpus_on_node == 64);
  CHECK(j.missing_master.empty());
  CHECK_THAT(j.summary, Catch::StartsWith("slurm: job 123 step 0, node 1 of 4 ('node[01-04]')") &&
                            Catch::Contains("master node01:29646") &&
                            Catch::Contains("8 workers per node from SLURM_GPUS_ON_NODE"));
}

TEST_CASE("slurm: the step's nodes, not the job's", "[scheduler]") {
  // `srun -N2 --ntasks-per-node=1` in a 4-node job, second step, on node03.
  Env e = srun_step();
  e["SLURM_STEP_ID"] = e["SLURM_STEPID"] = "1";
  e["SLURM_STEP_NUM_NODES"] = e["SLURM_NNODES"] = "2";
  e["SLURM_STEP_NODELIST"] = e["SLURM_NODELIST"] = "node[03-04]";
  e["SLURM_STEP_NUM_TASKS"] = e["SLURM_NTASKS"] = e["SLURM_NPROCS"] = "2";
  e["SLURM_NODEID"] = "0";
  SchedulerJob j = derive_ok(e);
  CHECK(j.nnodes == 2);
  CHECK(j.node_rank == 0);
  CHECK(j.master_addr == "node03");
  CHECK(j.run_id == "slurm-123.1");
  // No SLURM_STEP_NODELIST: srun's SLURM_NODELIST is the step's.
  e.erase("SLURM_STEP_NODELIST");
  CHECK(derive_ok(e).master_addr == "node03");
  // An older srun without the STEP_ variables: the job's numbers.
  Env old = srun_step();
  for (const char* k : {"SLURM_STEP_ID", "SLURM_STEP_NUM_NODES", "SLURM_STEP_NODELIST",
                        "SLURM_STEP_NUM_TASKS", "SLURM_JOB_NUM_NODES", "SLURM_JOB_NODELIST"}) {
    old.erase(k);
  }
  old["SLURM_NNODES"] = "3";
  old["SLURM_NODELIST"] = "gpu-a[7-9]";
  old["SLURM_NTASKS"] = old["SLURM_NPROCS"] = "3";
  SchedulerJob o = derive_ok(old);
  CHECK(o.nnodes == 3);
  CHECK(o.master_addr == "gpu-a7");
  CHECK(o.run_id == "slurm-123.0");
}

TEST_CASE("slurm: a batch script or salloc shell is no step", "[scheduler]") {
  auto j = derive_scheduler_job(sbatch_script());
  REQUIRE(j.ok());
  CHECK_FALSE(j->has_value());
  // The batch and extern steps' reserved ids (slurm.h) are not srun steps either.
  for (const char* id : {"4294967291", "4294967292", "4294967290", "batch", "extern"}) {
    INFO(id);
    Env e = srun_step();
    e["SLURM_STEP_ID"] = e["SLURM_STEPID"] = id;
    auto r = derive_scheduler_job(e);
    REQUIRE(r.ok());
    CHECK_FALSE(r->has_value());
  }
  for (const char* missing : {"SLURM_NODEID", "SLURM_JOB_ID"}) {
    INFO(missing);
    Env e = srun_step();
    e.erase(missing);
    e.erase("SLURM_JOBID");
    auto r = derive_scheduler_job(e);
    REQUIRE(r.ok());
    CHECK_FALSE(r->has_value());
  }
  auto none = derive_scheduler_job({{"PATH", "/bin"}, {"HOME", "/root"}});
  REQUIRE(none.ok());
  CHECK_FALSE(none->has_value());
}

TEST_CASE("slurm: more tasks than nodes is one clear error", "[scheduler]") {
  Env e = srun_step();  // srun -N4 -n32
  e["SLURM_STEP_NUM_TASKS"] = e["SLURM_NTASKS"] = e["SLURM_NPROCS"] = "32";
  CHECK_THAT(derive_err(e),
             Catch::StartsWith("srun started 32 tasks on 4 nodes; launch needs one per node "
                               "(srun --ntasks-per-node=1)"));
  e.erase("SLURM_STEP_NUM_TASKS");  // SLURM_NTASKS is read next
  CHECK_THAT(derive_err(e), Catch::Contains("32 tasks on 4 nodes"));
}

TEST_CASE("slurm: GPUs and CPUs on the node", "[scheduler]") {
  Env e = srun_step();
  for (const char* no : {"0", "", "gpu:4", "4(x2)", "-1"}) {
    INFO(no);
    e["SLURM_GPUS_ON_NODE"] = no;
    SchedulerJob j = derive_ok(e);
    CHECK_FALSE(j.nproc_per_node.has_value());
    CHECK_THAT(j.summary, !Catch::Contains("workers per node"));
  }
  e["SLURM_GPUS_ON_NODE"] = "4";
  CHECK(derive_ok(e).nproc_per_node == 4);
  e.erase("SLURM_GPUS_ON_NODE");
  CHECK_FALSE(derive_ok(e).nproc_per_node.has_value());
  e["SLURM_CPUS_ON_NODE"] = "many";
  CHECK_FALSE(derive_ok(e).cpus_on_node.has_value());
}

TEST_CASE("slurm: MASTER_ADDR and MASTER_PORT win, the port follows the job id", "[scheduler]") {
  Env e = srun_step();
  e["MASTER_ADDR"] = "10.1.1.1";
  e["MASTER_PORT"] = "12345";
  SchedulerJob j = derive_ok(e);
  CHECK(j.master_addr == "10.1.1.1");
  CHECK(j.master_port == 12345);
  e.erase("MASTER_PORT");
  e.erase("MASTER_ADDR");
  e["SLURM_JOB_ID"] = "7001";
  CHECK(derive_ok(e).master_port == 29400 + 2);
  e["SLURM_JOB_ID"] = "7002";  // the next job: its pair does not overlap (MASTER_PORT, +1)
  CHECK(derive_ok(e).master_port == 29400 + 4);
  e["SLURM_JOB_ID"] = "6999";
  CHECK(derive_ok(e).master_port == 29400 + 2 * 999);
  e["MASTER_PORT"] = "70000";
  CHECK_THAT(derive_err(e), Catch::StartsWith("MASTER_PORT: ") && Catch::Contains("'70000'"));
}

TEST_CASE("slurm: bad numbers are errors naming the variable", "[scheduler]") {
  const std::vector<std::tuple<std::string, std::string, std::string>> cases{
      {"SLURM_NODEID", "4", "SLURM_NODEID: 4 is not below SLURM_STEP_NUM_NODES=4"},
      {"SLURM_NODEID", "x", "SLURM_NODEID: "},
      {"SLURM_NODEID", "-1", "SLURM_NODEID: "},
      {"SLURM_STEP_NUM_NODES", "0", "SLURM_STEP_NUM_NODES: "},
      {"SLURM_STEP_NUM_NODES", "200000", "SLURM_STEP_NUM_NODES: "},
      {"SLURM_STEP_NUM_NODES", "3", "SLURM_STEP_NODELIST names 4 hosts but SLURM_STEP_NUM_NODES is 3"},
      {"SLURM_STEP_NODELIST", "node[01-04", "SLURM_STEP_NODELIST: host list 'node[01-04'"},
      {"SLURM_STEP_NUM_TASKS", "four", "SLURM_STEP_NUM_TASKS: "},
      {"SLURM_JOB_ID", "12a", "SLURM_JOB_ID: expected a job number, got '12a'"},
      {"SLURM_STEP_ID", "1x", "SLURM_STEP_ID: expected a step number, got '1x'"},
  };
  for (const auto& [var, value, message] : cases) {
    INFO(var << "=" << value);
    Env e = srun_step();
    e[var] = value;
    CHECK_THAT(derive_err(e), Catch::StartsWith(message));
  }
  Env e = srun_step();
  e.erase("SLURM_STEP_NUM_NODES");
  e.erase("SLURM_JOB_NUM_NODES");
  e.erase("SLURM_NNODES");
  CHECK_THAT(derive_err(e), Catch::Contains("how many nodes"));
  Env f = srun_step();
  for (const char* k : {"SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"}) f.erase(k);
  CHECK_THAT(derive_err(f), Catch::Contains("set MASTER_ADDR"));
  f["MASTER_ADDR"] = "head";
  CHECK(derive_ok(f).master_addr == "head");
}

TEST_CASE("mpi: Open MPI on one host, over hosts, and hydra", "[scheduler]") {
  SchedulerJob one = derive_ok(ompi_one_host());
  CHECK(one.source == "openmpi");
  CHECK(one.nnodes == 2);
  CHECK(one.node_rank == 1);
  CHECK(one.master_addr == "127.0.0.1");
  CHECK(one.master_port == 29400);
  CHECK(one.run_id == "mpi-437518337");
  CHECK_FALSE(one.nproc_per_node.has_value());
  CHECK_THAT(one.summary, Catch::StartsWith("openmpi: rank 1 of 2 (all on this host)"));

  Env four = ompi_four_hosts();
  SchedulerJob f = derive_ok(four);
  CHECK(f.nnodes == 4);
  CHECK(f.node_rank == 2);
  CHECK(f.master_addr.empty());
  CHECK_THAT(f.missing_master,
             Catch::Equals("under mpirun, set MASTER_ADDR to the host of rank 0 (mpirun -x "
                           "MASTER_ADDR=HOST) or give --rdzv_endpoint"));
  four["MASTER_ADDR"] = "head0";
  four["MASTER_PORT"] = "23456";
  f = derive_ok(four);
  CHECK(f.master_addr == "head0");
  CHECK(f.master_port == 23456);
  CHECK(f.missing_master.empty());

  SchedulerJob h = derive_ok(hydra());
  CHECK(h.source == "pmi");
  CHECK(h.nnodes == 3);
  CHECK(h.node_rank == 2);
  CHECK(h.master_addr == "a");
  CHECK(h.run_id == "mpi");

  // PMIx alone, a size from PMI_SIZE.
  SchedulerJob x = derive_ok({{"PMIX_RANK", "0"}, {"PMI_SIZE", "2"}, {"PMIX_NAMESPACE", "ns7"},
                              {"MASTER_ADDR", "h"}});
  CHECK(x.source == "pmix");
  CHECK(x.nnodes == 2);
  CHECK(x.run_id == "mpi-ns7");
  auto rank_only = derive_scheduler_job({{"PMIX_RANK", "0"}});
  REQUIRE(rank_only.ok());
  CHECK_FALSE(rank_only->has_value());
}

TEST_CASE("mpi: several processes on a host of several is one clear error", "[scheduler]") {
  Env e = ompi_four_hosts();
  e["OMPI_COMM_WORLD_SIZE"] = "8";
  e["OMPI_COMM_WORLD_LOCAL_SIZE"] = "2";
  CHECK_THAT(derive_err(e), Catch::StartsWith("mpirun started 2 processes on one host of 8; "
                                              "launch needs one per node (mpirun --map-by "
                                              "ppr:1:node)"));
  Env h = hydra();
  h["MPI_LOCALNRANKS"] = "2";
  CHECK_THAT(derive_err(h), Catch::StartsWith("mpirun started 2 processes on one host of 3"));
  for (const auto& [var, value] : std::vector<std::pair<std::string, std::string>>{
           {"OMPI_COMM_WORLD_RANK", "4"}, {"OMPI_COMM_WORLD_SIZE", "0"},
           {"OMPI_COMM_WORLD_LOCAL_SIZE", "9"}, {"OMPI_COMM_WORLD_RANK", "r"}}) {
    INFO(var << "=" << value);
    Env b = ompi_four_hosts();
    b[var] = value;
    CHECK_THAT(derive_err(b), Catch::StartsWith(var + ": "));
  }
}

TEST_CASE("slurm wins over mpi when both are present", "[scheduler]") {
  Env e = srun_step();
  for (const auto& [k, v] : ompi_one_host()) e.emplace(k, v);
  CHECK(derive_ok(e).source == "slurm");
  Env b = sbatch_script();  // mpirun inside a batch script: MPI's ranks
  for (const auto& [k, v] : ompi_one_host()) b.emplace(k, v);
  CHECK(derive_ok(b).source == "openmpi");
}

TEST_CASE("launch under srun: the job from Slurm, a static rendezvous on the first node",
          "[scheduler]") {
  LaunchConfig c = parse_ok({"train"}, srun_step());
  CHECK(c.min_nodes == 4);
  CHECK(c.max_nodes == 4);
  CHECK(c.node_rank == 1);
  CHECK(c.nproc_per_node == 8);
  CHECK(c.rdzv_backend == "static");
  CHECK(c.rdzv_id == "slurm-123.0");
  CHECK(c.master_addr == "node01");
  CHECK(c.master_port == 29646);
  CHECK(c.mode == RdzvMode::kStatic);
  CHECK(c.endpoint.host == "node01");
  CHECK(c.endpoint.port == 29647);
  CHECK_THAT(c.scheduler_summary,
             Catch::StartsWith("slurm: job 123 step 0") && Catch::EndsWith("; static rendezvous"));
  // --nproc_per_node=cpu counts the CPUs Slurm gave the step, not the machine's.
  CHECK(parse_ok({"--nproc_per_node=cpu", "train"}, srun_step(), fake_host(2, 0))
            .nproc_per_node == 64);
  Env no_cpus = srun_step();
  no_cpus.erase("SLURM_CPUS_ON_NODE");
  CHECK(parse_ok({"--nproc_per_node=cpu", "train"}, no_cpus, fake_host(2, 0)).nproc_per_node == 2);
  // Without a GPU count, launch's own default.
  Env no_gpus = srun_step();
  no_gpus.erase("SLURM_GPUS_ON_NODE");
  CHECK(parse_ok({"train"}, no_gpus).nproc_per_node == 1);
}

TEST_CASE("launch under srun: explicit flags and PET_* win", "[scheduler]") {
  LaunchConfig c = parse_ok({"--nnodes=2", "--node_rank=0", "--nproc_per_node=3",
                             "--master_addr=10.9.9.9", "--master_port=5000", "--rdzv_id=mine",
                             "train"},
                            srun_step());
  CHECK(c.max_nodes == 2);
  CHECK(c.node_rank == 0);
  CHECK(c.nproc_per_node == 3);
  CHECK(c.master_addr == "10.9.9.9");
  CHECK(c.master_port == 5000);
  CHECK(c.rdzv_id == "mine");
  CHECK(c.endpoint.port == 5001);
  CHECK_THAT(c.scheduler_summary,
             Catch::Contains("given, so kept: --nnodes, --nproc_per_node, --rdzv_id, "
                             "--node_rank, --master_addr, --master_port"));
  // One flag: only it is kept.
  LaunchConfig p = parse_ok({"--master-port", "6000", "train"}, srun_step());
  CHECK(p.master_port == 6000);
  CHECK(p.master_addr == "node01");
  CHECK(p.max_nodes == 4);
  CHECK_THAT(p.scheduler_summary, Catch::EndsWith("given, so kept: --master_port"));
  {
    ScopedSetenv pet("PET_NNODES", "4");  // counted as given, as on the command line
    ScopedSetenv pet2("PET_NPROC_PER_NODE", "2");
    LaunchConfig q = parse_ok({"train"}, srun_step());
    CHECK(q.nproc_per_node == 2);
    CHECK_THAT(q.scheduler_summary, Catch::Contains("kept: --nnodes, --nproc_per_node"));
  }
  {
    ScopedSetenv pet("PET_NODE_RANK", "3");
    CHECK(parse_ok({"train"}, srun_step()).node_rank == 3);
  }
}

TEST_CASE("launch under srun: c10d or an endpoint keeps the rendezvous the user's",
          "[scheduler]") {
  LaunchConfig c = parse_ok(
      {"--rdzv_backend=c10d", "--rdzv_endpoint=head:29400", "train"}, srun_step());
  CHECK(c.mode == RdzvMode::kC10d);
  CHECK(c.max_nodes == 4);
  CHECK(c.rdzv_id == "slurm-123.0");
  CHECK(c.nproc_per_node == 8);
  CHECK(c.endpoint.host == "head");
  CHECK(c.endpoint.port == 29400);
  CHECK(c.node_rank == -1);
  CHECK(c.master_addr.empty());
  CHECK_THAT(c.scheduler_summary, Catch::Contains("--rdzv_backend=c10d's"));
  // Static with an endpoint: the ranks still come from Slurm (every node needs its own).
  LaunchConfig s = parse_ok({"--rdzv_endpoint=head:7000", "train"}, srun_step());
  CHECK(s.mode == RdzvMode::kStatic);
  CHECK(s.node_rank == 1);
  CHECK(s.endpoint.host == "head");
  CHECK(s.endpoint.port == 7000);
  CHECK_THAT(s.scheduler_summary, Catch::Contains("--rdzv_endpoint's"));
}

TEST_CASE("launch under srun: --standalone and MUSTER_SCHEDULER_ENV=0 ignore it",
          "[scheduler]") {
  LaunchConfig s = parse_ok({"--standalone", "train"}, srun_step());
  CHECK(s.max_nodes == 1);
  CHECK(s.mode == RdzvMode::kEmbedded);
  CHECK(s.scheduler_summary.empty());
  for (const char* off : {"0", "false", "OFF", "no"}) {
    INFO(off);
    Env e = srun_step();
    e["MUSTER_SCHEDULER_ENV"] = off;
    LaunchConfig c = parse_ok({"train"}, e);
    CHECK(c.max_nodes == 1);
    CHECK(c.rdzv_id == "none");
    CHECK(c.scheduler_summary.empty());
    // Even a step launch would refuse is no error then.
    e["SLURM_STEP_NUM_TASKS"] = "32";
    CHECK(parse_ok({"train"}, e).max_nodes == 1);
  }
  Env on = srun_step();
  on["MUSTER_SCHEDULER_ENV"] = "1";
  CHECK(parse_ok({"train"}, on).max_nodes == 4);
  // Under a batch script alone, nothing changes.
  LaunchConfig b = parse_ok({"train"}, sbatch_script());
  CHECK(b.max_nodes == 1);
  CHECK(b.scheduler_summary.empty());
}

TEST_CASE("launch under mpirun: ranks from MPI, errors are usage errors", "[scheduler]") {
  LaunchConfig c = parse_ok({"--nproc_per_node=1", "w"}, ompi_one_host());
  CHECK(c.max_nodes == 2);
  CHECK(c.node_rank == 1);
  CHECK(c.master_addr == "127.0.0.1");
  CHECK(c.endpoint.port == 29401);
  CHECK(c.rdzv_id == "mpi-437518337");
  CHECK(c.mode == RdzvMode::kStatic);
  CHECK_THAT(parse_err({"w"}, ompi_four_hosts()),
             Catch::StartsWith("under mpirun, set MASTER_ADDR to the host of rank 0"));
  // The way out the message names, and --master_addr.
  LaunchConfig e = parse_ok({"--rdzv_backend=c10d", "--rdzv_endpoint=head0:29400", "w"},
                            ompi_four_hosts());
  CHECK(e.mode == RdzvMode::kC10d);
  CHECK(e.max_nodes == 4);
  LaunchConfig m = parse_ok({"--master_addr=head0", "w"}, ompi_four_hosts());
  CHECK(m.master_addr == "head0");
  CHECK(m.node_rank == 2);
  Env too_many = srun_step();
  too_many["SLURM_STEP_NUM_TASKS"] = "8";
  CHECK_THAT(parse_err({"w"}, too_many), Catch::StartsWith("srun started 8 tasks on 4 nodes"));
}
