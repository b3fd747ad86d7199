#!/bin/bash
# A hang of one of 4 ranks: muster's --hang_timeout reports and restarts it (timeline per
# phase); torchrun, for the same hang, does nothing (bench/README.md, "Hangs (--hang_timeout,
# issue 14)"). Builds what it needs into $BUILD (Release).
#   bench/hang.sh [--reps N] [--only muster|torchrun] [--torchrun-wait S]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
export BUILD=${BUILD:-/work/build-bench}
cmake -S "$here" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
cmake --build "$BUILD" -j2 --target launch train >/dev/null
exec /usr/bin/python3 "$here/bench/hang.py" "$@"
