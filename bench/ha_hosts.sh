#!/bin/bash
# The replicated rendezvous under silent faults on seven namespace hosts (bench/README.md, "High
# availability on namespace hosts"). Needs root and etcd. Builds what it needs into $BUILD.
#   bench/ha_hosts.sh [--trials N] [--only etcd-leader,etcd-follower,leader,leader-etcd,kill9]
#                     [--launch PATH --rdzvd PATH] [--finish]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
export BUILD=${BUILD:-/work/build-bench}
if [ "${HA_NO_BUILD:-0}" != 1 ]; then
  cmake -S "$here" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
  cmake --build "$BUILD" -j2 --target launch rdzvd hostnet test_worker >/dev/null
fi
exec /usr/bin/python3 "$here/bench/ha_hosts.py" "$@"
