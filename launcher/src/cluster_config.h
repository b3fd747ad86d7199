// launch --hosts / --hostfile: the flags' checks and resolution, after parsing (config.cc).
#pragma once

#include <functional>
#include <string_view>

#include "absl/status/status.h"
#include "muster/launcher/config.h"

namespace muster::launcher {

// The flags launch --hosts sets for each host's agent itself (dropped from agent_args), and
// its own flags, which no agent gets: canonical long names.
bool driver_sets_flag(std::string_view name);

// Reads --hostfile, applies --include/--exclude, checks the flags that cannot go with
// --hosts and sets the node counts (default: every host); config.cc has parsed --rdzv_conf.
// `given(name)` says whether a flag (canonical long name) was given on
// the command line or through its PET_ variable.
absl::Status resolve_cluster(LaunchConfig& c, const std::function<bool(std::string_view)>& given);

}  // namespace muster::launcher
