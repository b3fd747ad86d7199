// One error convention for both binaries (launch, rdzvd): a bad flag, config or file given on
// the command line is a usage error, exit 2; a failure while running (a port taken, a server
// unreachable, a disk full) exits 1. Either way one line on stderr, "PROGRAM: error: MESSAGE".
// Errors travel as absl::Status values up to main; nothing throws across a module boundary.
#pragma once

#include <string_view>

#include "absl/status/status.h"

namespace muster::ops {

inline constexpr int kExitRuntime = 1;
inline constexpr int kExitUsage = 2;

// Prints "PROGRAM: error: MESSAGE" and returns kExitUsage.
int usage_error(std::string_view program, const absl::Status& status);
// Prints "PROGRAM: error: MESSAGE" and returns kExitRuntime.
int runtime_error(std::string_view program, const absl::Status& status);

// A failure on its way to main: the status and the exit code it ends with.
struct ExitError {
  int code = kExitRuntime;
  absl::Status status;
};
// Prints it and returns its code.
int report(std::string_view program, const ExitError& error);

}  // namespace muster::ops
