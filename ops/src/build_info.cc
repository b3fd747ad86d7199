#include "muster/ops/build_info.h"

#include "muster/ops/build_commit.h"  // generated: MUSTER_BUILD_COMMIT

namespace muster::ops {

std::string_view build_version() { return MUSTER_BUILD_VERSION; }
std::string_view build_commit() { return MUSTER_BUILD_COMMIT; }

std::string version_line(std::string_view program) {
  std::string line(program);
  line.append(" ").append(build_version()).append(" (commit ").append(build_commit()).append(")");
  return line;
}

}  // namespace muster::ops
