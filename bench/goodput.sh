#!/bin/bash
# What a worker crash costs a PyTorch DDP job, launch --in_place with and without spares, the
# full restart and torchrun side by side (bench/README.md, "Goodput under failures"). Needs
# python3-torch. Builds launch into $BUILD.
#   bench/goodput.sh [--trials N] [--only spares,in_place,full,torchrun] [--seconds S] [--every S]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
export BUILD=${BUILD:-/work/build-bench}
if [ "${GOODPUT_NO_BUILD:-0}" != 1 ]; then
  cmake -S "$here" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
  cmake --build "$BUILD" -j2 --target launch >/dev/null
fi
exec /usr/bin/python3 "$here/bench/goodput.py" "$@"
