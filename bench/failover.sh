#!/bin/bash
# Two rdzvd replicas on a 3-member etcd cluster; the leader is killed -9 (and, in one row,
# stopped cleanly) while a job runs: time per phase until every agent has re-attached to the
# standby, how many workers restarted, and the same for 1,000 simulated agents (bench/README.md,
# "Replicated rdzvd on etcd (issue 13)"). Needs /usr/bin/etcd (scripts/setup). Builds what it
# needs into $BUILD (Release when it configures it; an existing build folder is used as it is).
#   bench/failover.sh [--reps N] [--agents N] [--nproc N] [--sim_agents N] [--sim_procs N]
#                     [--only agents|clean|sim]...
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
export BUILD=${BUILD:-/work/build-bench}
[ -f "$BUILD/CMakeCache.txt" ] ||
  cmake -S "$here" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache >/dev/null
cmake --build "$BUILD" -j2 --target launch rdzvd test_worker rdzv_sim >/dev/null
exec /usr/bin/python3 "$here/bench/failover.py" "$@"
