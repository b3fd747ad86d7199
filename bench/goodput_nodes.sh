#!/bin/bash
# What a node lost and back costs a PyTorch DDP job on four namespace hosts (bench/README.md,
# "Goodput under failures"). Needs root and python3-torch. Builds what it needs into $BUILD.
#   bench/goodput_nodes.sh [--trials N] [--only spares,in_place,full,torchrun] [--seconds S]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
export BUILD=${BUILD:-/work/build-bench}
if [ "${GOODPUT_NO_BUILD:-0}" != 1 ]; then
  cmake -S "$here" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
  cmake --build "$BUILD" -j2 --target launch rdzvd hostnet >/dev/null
fi
exec /usr/bin/python3 "$here/bench/goodput_nodes.py" "$@"
