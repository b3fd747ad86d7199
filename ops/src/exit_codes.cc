#include "muster/ops/exit_codes.h"

#include <cstdio>
#include <string>

namespace muster::ops {

int report(std::string_view program, const ExitError& e) {
  std::fprintf(stderr, "%.*s: error: %s\n", static_cast<int>(program.size()), program.data(),
               std::string(e.status.message()).c_str());
  return e.code;
}

int usage_error(std::string_view program, const absl::Status& status) {
  return report(program, {kExitUsage, status});
}

int runtime_error(std::string_view program, const absl::Status& status) {
  return report(program, {kExitRuntime, status});
}

}  // namespace muster::ops
