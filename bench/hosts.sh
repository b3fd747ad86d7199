#!/bin/bash
# Multi-host figures on network-namespace hosts, muster against torchrun (bench/README.md,
# "Multi-host (network-namespace hosts)"). Needs root. Builds what it needs into $BUILD.
#   bench/hosts.sh [--reps N] [--only formation|ddp|slowlink|partition|blips ...]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
export BUILD=${BUILD:-/work/build-bench}
if [ "${HOSTS_NO_BUILD:-0}" != 1 ]; then
  cmake -S "$here" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
  cmake --build "$BUILD" -j2 --target launch rdzvd hostnet fault_proxy test_worker >/dev/null
fi
exec /usr/bin/python3 "$here/bench/hosts.py" "$@"
