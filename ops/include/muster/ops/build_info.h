// What a binary was built from: the release version (CMake's project version) and the commit
// (git's short hash, "-dirty" for uncommitted changes, or "unknown" outside a checkout; a
// packager may set it with -DMUSTER_COMMIT=...). Shown by `launch --version`, `rdzvd
// --version`, `rdzvd status --json` and the muster_build_info metric (docs/operations.md).
#pragma once

#include <string>
#include <string_view>

namespace muster::ops {

std::string_view build_version();
std::string_view build_commit();
// "<program> <version> (commit <commit>)", the --version line.
std::string version_line(std::string_view program);

}  // namespace muster::ops
