#!/bin/bash
# The straggler watch: its cost, how soon it names a slowed rank, and no name under noise
# (bench/README.md, "Stragglers"). Needs python3-torch. Builds launch and rdzvd into $BUILD.
#   bench/stragglers.sh [--only overhead,named,noise,exclude] [--trials N] [--noise-seconds S]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
export BUILD=${BUILD:-/work/build-bench}
if [ "${STRAGGLERS_NO_BUILD:-0}" != 1 ]; then
  cmake -S "$here" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
  cmake --build "$BUILD" -j2 --target launch rdzvd >/dev/null
fi
exec /usr/bin/python3 "$here/bench/stragglers.py" "$@"
