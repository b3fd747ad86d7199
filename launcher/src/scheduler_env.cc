#include "muster/launcher/scheduler_env.h"

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <tuple>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "muster/rendezvous/limits.h"

namespace muster::launcher {

namespace limits = muster::rendezvous::limits;
namespace {

using Env = std::map<std::string, std::string>;

// A variable may hold anything; errors quote at most this much of it.
constexpr std::size_t kMaxQuoted = 120;
// Digits of one number in a host list (no host name needs more; keeps the arithmetic exact).
constexpr std::size_t kMaxHostNumberDigits = 18;

std::string quoted_cut(absl::string_view text) {
  if (text.size() <= kMaxQuoted) return absl::StrCat("'", text, "'");
  return absl::StrCat("'", text.substr(0, kMaxQuoted), "...' (", text.size(), " bytes)");
}

absl::Status bad_hostlist(absl::string_view text, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("host list ", quoted_cut(text), ": ", why));
}

struct Range {
  std::uint64_t lo = 0, hi = 0;
  int width = 0;  // of the lower bound: its zero padding is kept
};

// One bracket group's contents, "01-04,07".
absl::StatusOr<std::vector<Range>> parse_group(absl::string_view text, absl::string_view group) {
  std::vector<Range> out;
  std::size_t start = 0;
  while (true) {
    std::size_t comma = group.find(',', start);
    absl::string_view item = group.substr(start, comma == absl::string_view::npos
                                                    ? absl::string_view::npos
                                                    : comma - start);
    std::size_t dash = item.find('-');
    absl::string_view lo = item.substr(0, dash);
    absl::string_view hi = dash == absl::string_view::npos ? lo : item.substr(dash + 1);
    for (absl::string_view n : {lo, hi}) {
      if (n.empty()) return bad_hostlist(text, absl::StrCat("empty number in [", group, "]"));
      for (char ch : n) {
        if (!absl::ascii_isdigit(static_cast<unsigned char>(ch))) {
          return bad_hostlist(text, absl::StrCat("'", item, "' in [", group,
                                                 "] is not a number or a range N-M"));
        }
      }
      if (n.size() > kMaxHostNumberDigits) {
        return bad_hostlist(text, absl::StrCat("number '", n, "' is too long"));
      }
    }
    Range r;
    r.width = static_cast<int>(lo.size());
    if (!absl::SimpleAtoi(lo, &r.lo) || !absl::SimpleAtoi(hi, &r.hi)) {
      return bad_hostlist(text, absl::StrCat("'", item, "' is not a number or a range N-M"));
    }
    if (r.hi < r.lo) {
      return bad_hostlist(text, absl::StrCat("range ", item, " runs backwards"));
    }
    out.push_back(r);
    if (comma == absl::string_view::npos) break;
    start = comma + 1;
  }
  return out;
}

// A name: literal text around bracket groups. literals.size() == groups.size() + 1.
struct Pattern {
  std::vector<absl::string_view> literals;
  std::vector<std::vector<std::string>> groups;  // each group expanded (bounded by the count)
  std::vector<std::vector<Range>> ranges;
  std::uint64_t count = 1;
};

// Hosts a group names, or any number above `max` once it passes it (never overflows: each
// range is below 10^18).
std::uint64_t range_count(const std::vector<Range>& g, std::uint64_t max) {
  std::uint64_t n = 0;
  for (const Range& r : g) {
    n += r.hi - r.lo + 1;
    if (n > max) return n;
  }
  return n;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> expand_slurm_hostlist(absl::string_view text) {
  if (text.empty()) return bad_hostlist(text, "is empty");
  const std::uint64_t max = limits::kMaxSlurmHosts;
  auto too_many = [&] {
    return bad_hostlist(text, absl::StrCat("names more than ", max, " hosts"));
  };
  // Split at top-level commas into patterns; count before making anything.
  std::vector<Pattern> patterns;
  std::uint64_t total = 0;
  std::size_t i = 0;
  while (i <= text.size()) {
    Pattern p;
    std::size_t lit_start = i;
    bool any = false;
    while (i < text.size() && text[i] != ',') {
      if (text[i] == ']') return bad_hostlist(text, "has a ']' without its '['");
      if (text[i] != '[') {
        ++i;
        any = true;
        continue;
      }
      std::size_t close = text.find_first_of("[]", i + 1);
      if (close == absl::string_view::npos || text[close] != ']') {
        return bad_hostlist(text, close == absl::string_view::npos ? "has a '[' without its ']'"
                                                                   : "has a '[' inside brackets");
      }
      absl::string_view group = text.substr(i + 1, close - i - 1);
      if (group.empty()) return bad_hostlist(text, "has an empty []");
      auto ranges = parse_group(text, group);
      if (!ranges.ok()) return ranges.status();
      const std::uint64_t n = range_count(*ranges, max);
      if (n > max || p.count > max / n) return too_many();
      p.count *= n;
      p.literals.push_back(text.substr(lit_start, i - lit_start));
      p.ranges.push_back(std::move(*ranges));
      i = close + 1;
      lit_start = i;
      any = true;
    }
    if (!any) return bad_hostlist(text, "has an empty name");
    p.literals.push_back(text.substr(lit_start, i - lit_start));
    total += p.count;
    if (total > max) return too_many();
    patterns.push_back(std::move(p));
    ++i;  // past the comma (or the end)
  }
  std::vector<std::string> hosts;
  hosts.reserve(total);
  for (Pattern& p : patterns) {
    for (const auto& g : p.ranges) {
      std::vector<std::string> values;
      for (const Range& r : g) {
        for (std::uint64_t v = r.lo; v <= r.hi; ++v) {
          values.push_back(absl::StrFormat("%0*d", r.width, v));
        }
      }
      p.groups.push_back(std::move(values));
    }
    // An odometer over the groups, the rightmost fastest.
    std::vector<std::size_t> at(p.groups.size(), 0);
    for (std::uint64_t k = 0; k < p.count; ++k) {
      std::string host(p.literals[0]);
      for (std::size_t g = 0; g < p.groups.size(); ++g) {
        absl::StrAppend(&host, p.groups[g][at[g]], p.literals[g + 1]);
      }
      hosts.push_back(std::move(host));
      for (std::size_t g = p.groups.size(); g-- > 0;) {
        if (++at[g] < p.groups[g].size()) break;
        at[g] = 0;
      }
    }
  }
  return hosts;
}

namespace {

const std::string* find(const Env& env, const char* key) {
  auto it = env.find(key);
  return it == env.end() ? nullptr : &it->second;
}

// The first of `keys` that is set, with its name.
std::pair<const char*, const std::string*> first_of(const Env& env,
                                                    std::initializer_list<const char*> keys) {
  for (const char* k : keys) {
    if (const std::string* v = find(env, k)) return {k, v};
  }
  return {nullptr, nullptr};
}

absl::StatusOr<std::int64_t> number(const char* var, const std::string& v, std::int64_t lo,
                                    std::int64_t hi) {
  std::int64_t n = 0;
  if (!absl::SimpleAtoi(v, &n) || n < lo || n > hi) {
    return absl::InvalidArgumentError(absl::StrCat(var, ": expected a whole number from ", lo,
                                                   " to ", hi, ", got ", quoted_cut(v)));
  }
  return n;
}

// MASTER_ADDR / MASTER_PORT as the user set them around the scheduler (sbatch scripts do).
absl::StatusOr<std::optional<int>> master_port_env(const Env& env) {
  const std::string* v = find(env, "MASTER_PORT");
  if (v == nullptr || v->empty()) return std::nullopt;
  auto p = number("MASTER_PORT", *v, 1, 65535);
  if (!p.ok()) return p.status();
  return static_cast<int>(*p);
}

std::string master_addr_env(const Env& env) {
  const std::string* v = find(env, "MASTER_ADDR");
  return v == nullptr ? std::string() : *v;
}

// Slurm's reserved step ids (slurm.h): the batch script, the extern step, an interactive
// salloc step, ... None of them is an srun step.
constexpr std::uint64_t kSlurmFirstReservedStep = 0xfffffff0ULL;

// The step's (or job's) node count and list, as srun gave them.
struct SlurmNodes {
  const char* count_var;
  const char* list_var;
  const std::string* list;  // null: no list
  std::int64_t count;
};

// MASTER_ADDR, else the list's first host; the list must name `count` hosts. Says where the
// master came from.
absl::StatusOr<std::string> slurm_master(const Env& env, const SlurmNodes& n, SchedulerJob& j) {
  std::string from = "MASTER_ADDR";
  j.master_addr = master_addr_env(env);
  if (n.list != nullptr) {
    // Expanded even when MASTER_ADDR is set: a list that disagrees with the count is wrong.
    auto hosts = expand_slurm_hostlist(*n.list);
    if (!hosts.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(n.list_var, ": ", hosts.status().message()));
    }
    if (static_cast<std::int64_t>(hosts->size()) != n.count) {
      return absl::InvalidArgumentError(absl::StrCat(n.list_var, " names ", hosts->size(),
                                                     " hosts but ", n.count_var, " is ", n.count));
    }
    if (j.master_addr.empty()) {
      j.master_addr = hosts->front();
      from = absl::StrCat("first host of ", n.list_var);
    }
  } else if (j.master_addr.empty()) {
    return absl::InvalidArgumentError(
        "under srun but no SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or SLURM_NODELIST names the "
        "nodes; set MASTER_ADDR to the first node's host");
  }
  return from;
}

// launch runs once per node: srun must have started one task per node.
absl::Status check_slurm_tasks(const Env& env, std::int64_t nnodes) {
  auto [tasks_var, tasks_text] =
      first_of(env, {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"});
  if (tasks_text == nullptr) return absl::OkStatus();
  auto tasks = number(tasks_var, *tasks_text, 1, std::numeric_limits<std::int32_t>::max());
  if (!tasks.ok()) return tasks.status();
  if (*tasks > nnodes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "srun started ", *tasks, " tasks on ", nnodes,
        " nodes; launch needs one per node (srun --ntasks-per-node=1), or set "
        "MUSTER_SCHEDULER_ENV=0 to ignore Slurm"));
  }
  return absl::OkStatus();
}

// Workers per node from the GPUs Slurm gave the node; its CPUs for --nproc_per_node=cpu.
void slurm_sizes(const Env& env, SchedulerJob& j) {
  if (const std::string* g = find(env, "SLURM_GPUS_ON_NODE")) {
    int n = 0;
    if (absl::SimpleAtoi(*g, &n) && n > 0) {
      j.nproc_per_node = n;
      j.nproc_from = "SLURM_GPUS_ON_NODE";
    }
  }
  if (const std::string* c = find(env, "SLURM_CPUS_ON_NODE")) {
    int n = 0;
    if (absl::SimpleAtoi(*c, &n) && n > 0) j.cpus_on_node = n;
  }
}

absl::StatusOr<std::optional<SchedulerJob>> derive_slurm(const Env& env) {
  auto [job_var, job_id] = first_of(env, {"SLURM_JOB_ID", "SLURM_JOBID"});
  auto [step_var, step_id] = first_of(env, {"SLURM_STEP_ID", "SLURM_STEPID"});
  const std::string* node_id = find(env, "SLURM_NODEID");
  if (job_id == nullptr || step_id == nullptr || node_id == nullptr) return std::nullopt;
  const std::string step_name = absl::AsciiStrToLower(*step_id);
  if (step_name == "batch" || step_name == "extern" || step_name == "interactive") {
    return std::nullopt;
  }
  std::uint64_t step = 0;
  if (!absl::SimpleAtoi(*step_id, &step)) {
    return absl::InvalidArgumentError(
        absl::StrCat(step_var, ": expected a step number, got ", quoted_cut(*step_id)));
  }
  if (step >= kSlurmFirstReservedStep) return std::nullopt;
  std::uint64_t job = 0;
  if (!absl::SimpleAtoi(*job_id, &job)) {
    return absl::InvalidArgumentError(
        absl::StrCat(job_var, ": expected a job number, got ", quoted_cut(*job_id)));
  }
  const auto max_nodes = static_cast<std::int64_t>(limits::kMaxSlurmHosts);

  // The step's own numbers, else the job's (an older srun, or a step over the whole job).
  const char* nodes_var = nullptr;
  const std::string* nodes_text = nullptr;
  const char* list_var = nullptr;
  const std::string* list_text = nullptr;
  if (const std::string* v = find(env, "SLURM_STEP_NUM_NODES")) {
    nodes_var = "SLURM_STEP_NUM_NODES";
    nodes_text = v;
    // srun sets SLURM_NODELIST to the step's list too; the count check below confirms it.
    std::tie(list_var, list_text) = first_of(env, {"SLURM_STEP_NODELIST", "SLURM_NODELIST"});
  } else {
    std::tie(nodes_var, nodes_text) = first_of(env, {"SLURM_JOB_NUM_NODES", "SLURM_NNODES"});
    std::tie(list_var, list_text) = first_of(env, {"SLURM_JOB_NODELIST", "SLURM_NODELIST"});
  }
  if (nodes_text == nullptr) {
    return absl::InvalidArgumentError(
        "under srun (SLURM_STEP_ID is set) but no SLURM_STEP_NUM_NODES, SLURM_JOB_NUM_NODES or "
        "SLURM_NNODES says how many nodes");
  }
  auto nnodes = number(nodes_var, *nodes_text, 1, max_nodes);
  if (!nnodes.ok()) return nnodes.status();
  auto rank = number("SLURM_NODEID", *node_id, 0, max_nodes - 1);
  if (!rank.ok()) return rank.status();
  if (*rank >= *nnodes) {
    return absl::InvalidArgumentError(
        absl::StrCat("SLURM_NODEID: ", *rank, " is not below ", nodes_var, "=", *nnodes));
  }
  SchedulerJob j;
  j.source = "slurm";
  j.nnodes = static_cast<int>(*nnodes);
  j.node_rank = static_cast<int>(*rank);
  const SlurmNodes nodes{nodes_var, list_var, list_text, *nnodes};
  auto master_from = slurm_master(env, nodes, j);
  if (!master_from.ok()) return master_from.status();
  if (absl::Status s = check_slurm_tasks(env, *nnodes); !s.ok()) return s;
  auto port = master_port_env(env);
  if (!port.ok()) return port.status();
  std::string port_from = "MASTER_PORT";
  if (port->has_value()) {
    j.master_port = **port;
  } else {
    j.master_port = kSlurmPortBase + 2 * static_cast<int>(job % kSlurmPortJobs);
    port_from = absl::StrCat("from job ", job);
  }
  j.run_id = absl::StrCat("slurm-", job, ".", step);
  slurm_sizes(env, j);
  j.summary = absl::StrCat("slurm: job ", job, " step ", step, ", node ", j.node_rank, " of ",
                           j.nnodes);
  if (list_text != nullptr) absl::StrAppend(&j.summary, " (", quoted_cut(*list_text), ")");
  absl::StrAppend(&j.summary, ", master ", j.master_addr, ":", j.master_port, " (", *master_from,
                  ", port ", port_from, ")");
  if (j.nproc_per_node) {
    absl::StrAppend(&j.summary, ", ", *j.nproc_per_node, " workers per node from ", j.nproc_from);
  }
  return j;
}

absl::StatusOr<std::optional<SchedulerJob>> derive_mpi(const Env& env) {
  const char* source = nullptr;
  const char* size_var = nullptr;
  const char* rank_var = nullptr;
  std::pair<const char*, const std::string*> local{nullptr, nullptr};
  if (find(env, "OMPI_COMM_WORLD_SIZE") && find(env, "OMPI_COMM_WORLD_RANK")) {
    source = "openmpi";
    size_var = "OMPI_COMM_WORLD_SIZE";
    rank_var = "OMPI_COMM_WORLD_RANK";
    local = first_of(env, {"OMPI_COMM_WORLD_LOCAL_SIZE"});
  } else if (find(env, "PMI_SIZE") && find(env, "PMI_RANK")) {
    source = "pmi";
    size_var = "PMI_SIZE";
    rank_var = "PMI_RANK";
    local = first_of(env, {"MPI_LOCALNRANKS"});
  } else if (find(env, "PMIX_RANK")) {
    auto size = first_of(env, {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"});
    if (size.first == nullptr) return std::nullopt;  // a rank without a size: nothing to form
    source = "pmix";
    size_var = size.first;
    rank_var = "PMIX_RANK";
    local = first_of(env, {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"});
  } else {
    return std::nullopt;
  }
  const auto max_nodes = static_cast<std::int64_t>(limits::kMaxSlurmHosts);
  auto size = number(size_var, *find(env, size_var), 1, max_nodes);
  if (!size.ok()) return size.status();
  auto rank = number(rank_var, *find(env, rank_var), 0, max_nodes - 1);
  if (!rank.ok()) return rank.status();
  if (*rank >= *size) {
    return absl::InvalidArgumentError(
        absl::StrCat(rank_var, ": ", *rank, " is not below ", size_var, "=", *size));
  }
  std::optional<std::int64_t> local_size;
  if (local.second != nullptr) {
    auto l = number(local.first, *local.second, 1, *size);
    if (!l.ok()) return l.status();
    local_size = *l;
  }
  SchedulerJob j;
  j.source = source;
  j.nnodes = static_cast<int>(*size);
  j.node_rank = static_cast<int>(*rank);
  std::string where;
  if (local_size && *local_size == *size) {
    j.master_addr = "127.0.0.1";
    where = "all on this host";
  } else if (local_size && *local_size > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mpirun started ", *local_size, " processes on one host of ", *size,
        "; launch needs one per node (mpirun --map-by ppr:1:node), or set "
        "MUSTER_SCHEDULER_ENV=0 to ignore MPI"));
  } else {
    j.master_addr = master_addr_env(env);
    where = local_size ? "one per host" : "hosts unknown";
    if (j.master_addr.empty()) {
      j.missing_master =
          "under mpirun, set MASTER_ADDR to the host of rank 0 (mpirun -x MASTER_ADDR=HOST) or "
          "give --rdzv_endpoint";
    }
  }
  auto port = master_port_env(env);
  if (!port.ok()) return port.status();
  j.master_port = port->value_or(kMpiDefaultPort);
  auto id = first_of(env, {"OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"});
  j.run_id = id.second != nullptr && !id.second->empty() ? absl::StrCat("mpi-", *id.second)
                                                         : std::string("mpi");
  j.summary = absl::StrCat(source, ": rank ", j.node_rank, " of ", j.nnodes, " (", where,
                           "), master ",
                           j.master_addr.empty() ? std::string("unknown") : j.master_addr, ":",
                           j.master_port, port->has_value() ? " (MASTER_PORT)" : " (default port)",
                           ", run id ", j.run_id);
  return j;
}

}  // namespace

absl::StatusOr<std::optional<SchedulerJob>> derive_scheduler_job(const Env& env) {
  auto slurm = derive_slurm(env);
  if (!slurm.ok() || slurm->has_value()) return slurm;
  return derive_mpi(env);
}

bool scheduler_env_enabled(const Env& env) {
  const std::string* v = find(env, "MUSTER_SCHEDULER_ENV");
  if (v == nullptr) return true;
  const std::string s = absl::AsciiStrToLower(absl::StripAsciiWhitespace(*v));
  return !(s == "0" || s == "false" || s == "no" || s == "off");
}

}  // namespace muster::launcher
