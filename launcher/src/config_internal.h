// What launch's flag parsing (launch_flags.cc) shares with the rest of the configuration
// (config.cc) and nothing else includes.
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "muster/launcher/config.h"
#include "muster/launcher/scheduler_env.h"

namespace muster::launcher::internal {

// The flags a scheduler's job may fill; one given (on the command line or by PET_*: CLI11
// counts both) wins.
struct SchedulerFlags {
  CLI::Option* nnodes = nullptr;
  CLI::Option* nproc = nullptr;
  CLI::Option* rdzv_endpoint = nullptr;
  CLI::Option* rdzv_id = nullptr;
  CLI::Option* node_rank = nullptr;
  CLI::Option* master_addr = nullptr;
  CLI::Option* master_port = nullptr;
};

// Fills from `job` what no flag gave, and says so in c.scheduler_summary.
absl::Status apply_scheduler_job(const SchedulerJob& job, const SchedulerFlags& given,
                                 LaunchConfig& c, std::string& nnodes, HostInfo& counted);
// --nnodes N or MIN:MAX.
absl::Status parse_nnodes(const std::string& v, LaunchConfig& c);
// --nproc_per_node: a number, or counted on `host` (cpu, gpu, xpu, auto).
absl::Status resolve_nproc(LaunchConfig& c, const HostInfo& host);
// A CLI11 message on one line.
std::string one_line(std::string s);
// Seconds as given to a duration, at most `max` (an error names `what`).
absl::StatusOr<std::chrono::milliseconds> to_duration(absl::string_view what, double secs,
                                                      std::chrono::milliseconds max);
// torchrun's prefix matching of long flags (--nproc → --nproc_per_node), except for the
// groups launch adds (own_groups).
absl::StatusOr<std::vector<std::string>> expand_long_flags(const CLI::App& app,
                                                           const std::vector<std::string>& args,
                                                           const std::set<std::string>& own_groups);
// A number flag given as '' is an error, not 0.
CLI::Validator not_empty();
absl::Status resolve_rdzv_conf(LaunchConfig& c, const std::map<std::string, std::string>& env);
absl::Status resolve_rendezvous(LaunchConfig& c);
absl::Status resolve_output(LaunchConfig& c);
// ${hostname} in a prefix template, as torchrun substitutes it.
std::string substitute_hostname(const std::string& tmpl);

}  // namespace muster::launcher::internal
