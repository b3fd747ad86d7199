#!/bin/bash
# launch --preflight on namespace hosts: its cost, no false name in uncapped runs, a capped link
# named (bench/README.md, "Stragglers"). Needs root. Builds launch, rdzvd, test_worker and
# hostnet into $BUILD first.
#   bench/preflight.sh [--uncapped N] [--capped N] [--kbit K]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
export BUILD=${BUILD:-/work/build-bench}
if [ "${PREFLIGHT_NO_BUILD:-0}" != 1 ]; then
  cmake -S "$here" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
  cmake --build "$BUILD" -j2 --target launch rdzvd test_worker hostnet >/dev/null
fi
exec /usr/bin/python3 "$here/bench/preflight.py" "$@"
