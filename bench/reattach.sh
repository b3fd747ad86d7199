#!/bin/bash
# rdzvd killed -9 and restarted on the same --state_dir while a job runs: time per phase until
# every agent has re-attached, and how many workers restarted (bench/README.md, "Restarting
# rdzvd without restarting workers"). Builds what it needs into $BUILD (Release when it
# configures it; an existing build folder is used as it is).
#   bench/reattach.sh [--reps N] [--agents N] [--nproc N]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
export BUILD=${BUILD:-/work/build-bench}
[ -f "$BUILD/CMakeCache.txt" ] ||
  cmake -S "$here" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
cmake --build "$BUILD" -j2 --target launch rdzvd test_worker >/dev/null
exec /usr/bin/python3 "$here/bench/reattach.py" "$@"
