#!/bin/bash
# launch --hosts against one ssh + torchrun per host, on network-namespace hosts with sshd
# (bench/README.md, "One command for many hosts"). Needs root, openssh-server. Builds into $BUILD.
#   bench/cluster.sh [--reps N]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
export BUILD=${BUILD:-/work/build-bench}
cmake -S "$here" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
cmake --build "$BUILD" -j2 --target launch hostnet >/dev/null
exec "$BUILD/tests/hostnet" run 4 -- /usr/bin/python3 "$here/bench/cluster.py" "$@"
