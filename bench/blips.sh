#!/bin/bash
# Blips of a share of the liveness window across two namespace hosts (bench/README.md, "Blips
# shorter than the window"). Needs root. Builds what it needs into $BUILD.
#   bench/blips.sh [--trials N] [--fractions 0.5,0.7,0.9] [--conf 0.5,4] [--launch PATH ...]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
export BUILD=${BUILD:-/work/build-bench}
if [ "${BLIPS_NO_BUILD:-0}" != 1 ]; then
  cmake -S "$here" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
  cmake --build "$BUILD" -j2 --target launch hostnet test_worker >/dev/null
fi
exec /usr/bin/python3 "$here/bench/blips.py" "$@"
