#!/bin/bash
# In-place recovery against today's full restart on four namespace hosts (bench/README.md,
# "In-place recovery"). Needs root. Builds what it needs into $BUILD.
#   bench/in_place.sh [--trials N] [--only kill,crash,cut,curve,goodput] [--duration S] [--period S]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
export BUILD=${BUILD:-/work/build-bench}
if [ "${IN_PLACE_NO_BUILD:-0}" != 1 ]; then
  cmake -S "$here" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
  cmake --build "$BUILD" -j2 --target launch rdzvd hostnet fault_proxy train >/dev/null
fi
exec /usr/bin/python3 "$here/bench/in_place.py" "$@"
