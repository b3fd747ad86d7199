#!/usr/bin/env bash
# A resolver that does not answer (host 2's address, host 2 cut off) in the resolv.conf of
# hosts 0 and 1, every name in /etc/hosts: seconds for a 2-host job started by name. Needs
# root; run through hostnet:  build/tests/hostnet run 3 -- bench/hosts_dns.sh
set -u
B=${BUILD:-$(cd "$(dirname "$0")/.." && pwd)/build}
L=$B/launcher/launch
"$HOSTNET_CTL" cut "$HOSTNET_NS_2"
for i in 0 1; do
  eval "ns=\$HOSTNET_NS_$i"
  echo "nameserver $HOSTNET_ADDR_2" >"/etc/netns/$ns/resolv.conf"  # removed with the hosts
done
flags=(--nnodes=2 --rdzv_backend=c10d --rdzv_endpoint=node0:29400 --rdzv_id=dns --no_python)
t0=$(date +%s.%N)
$HOSTNET_WRAP_0 "$L" "${flags[@]}" /bin/true & a=$!
$HOSTNET_WRAP_1 "$L" "${flags[@]}" /bin/true & b=$!
wait "$a"; ra=$?; wait "$b"; rb=$?
t1=$(date +%s.%N)
echo "dead resolver, 2-host job by name: $(echo "$t1 - $t0" | bc) s (exit $ra $rb)"
