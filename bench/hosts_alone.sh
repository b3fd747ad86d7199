#!/usr/bin/env bash
# The hosting host cut off from both peers (--nnodes=1:3, default 2 s rule): seconds from the
# cut until its worker runs again in a world of 1. Needs root; run through hostnet:
#   build/tests/hostnet run 3 -- bench/hosts_alone.sh
# (prints "alone after cut: S s"). The peers give up after read_timeout=3 and exit 1.
set -u
B=${BUILD:-$(cd "$(dirname "$0")/.." && pwd)/build}
L=$B/launcher/launch; W=$B/tests/test_worker
out=$(mktemp -d)
for i in 0 1 2; do
  eval "wrap=\$HOSTNET_WRAP_$i"
  $wrap "$L" --nnodes=1:3 --nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint=node0:29400 \
    --rdzv_id=alone --rdzv_conf=read_timeout=3 "$W" wait >"$out/$i.out" 2>"$out/$i.err" &
  eval "p$i=\$!"
done
for _ in $(seq 1 400); do
  [ "$(cat "$out"/*.out | grep -c 'world 3')" = 3 ] && break
  sleep 0.05
done
t0=$(date +%s.%N)
"$HOSTNET_CTL" cut "$HOSTNET_NS_0"
for _ in $(seq 1 3000); do grep -q 'world 1' "$out/0.out" && break; sleep 0.01; done
t1=$(date +%s.%N)
echo "alone after cut: $(echo "$t1 - $t0" | bc) s"
kill "$p0"; wait "$p0"; wait "$p1" "$p2"
rm -rf "$out"
