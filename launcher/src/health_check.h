// launch --health_check CMD (docs/launch.md, "Health checks"; issue 42's pre-flight): a command
// the user gives, run on this node before it first joins the rendezvous. Exit 0: healthy, the
// node joins. Anything else (a non-zero exit, a signal, no end within the timeout, a command
// that cannot start): the node is not admitted; launch says why in one line and exits 1, and
// the job goes on with the other nodes within --nnodes MIN:MAX.
#pragma once

#include <chrono>
#include <map>
#include <string>

#include "absl/status/status.h"

namespace muster::launcher {

struct HealthCheck {
  std::string command;  // run by /bin/sh -c; empty: no check
  std::chrono::milliseconds timeout{0};
  std::string host;     // named in the error line
};

// Runs the check with `env` as its environment (MUSTER_HEALTH_CHECK=1 added), in a process
// group of its own, its output (stdout and stderr) copied to launch's stderr line by line with
// the prefix "[health_check] ". On a timeout the group is killed (SIGKILL) and reaped. OK when
// it exited 0; otherwise FailedPrecondition with the one line to print.
absl::Status run_health_check(const HealthCheck& check, const std::map<std::string, std::string>& env);

}  // namespace muster::launcher
