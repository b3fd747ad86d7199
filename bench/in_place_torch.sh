#!/bin/bash
# A PyTorch DDP job in place against the full restart and torchrun on four namespace hosts
# (bench/README.md, "PyTorch in place"). Needs root and python3-torch. Builds what it needs
# into $BUILD.
#   bench/in_place_torch.sh [--trials N] [--only in_place,full,torchrun] [--step_ms MS]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
export BUILD=${BUILD:-/work/build-bench}
if [ "${IN_PLACE_NO_BUILD:-0}" != 1 ]; then
  cmake -S "$here" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
  cmake --build "$BUILD" -j2 --target launch rdzvd hostnet >/dev/null
fi
exec /usr/bin/python3 "$here/bench/in_place_torch.py" "$@"
