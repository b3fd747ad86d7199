#!/usr/bin/env bash
# A Debian root with that release's python3-torch, for the suite's PyTorch cases on torch 2.x:
#     torch_root.sh forky    -> /var/cache/muster/torch-forky   (torch 2.14, Python 3.14)
#     torch_root.sh trixie   -> /var/cache/muster/torch-trixie  (torch 2.6, Python 3.13)
# Made once (debootstrap --variant=minbase, then apt-get install python3-torch, 3-8 minutes,
# about 2.5 GB) and kept for the next run; built under ROOT.part and renamed when whole, so an
# interrupted build is never taken for a root. Prints the root's path on its last line; exits
# 77 with one line saying why when it cannot be made (no root, no debootstrap, no archive).
set -euo pipefail
suite="${1:?usage: torch_root.sh forky|trixie}"
case "$suite" in forky | trixie | sid) ;; *) echo "torch_root: unknown suite '$suite'" >&2; exit 2 ;; esac
cache="${MUSTER_ROOT_CACHE:-/var/cache/muster}"
root="$cache/torch-$suite"
cannot() {
  echo "torch_root: $*" >&2
  exit 77
}
here="$(cd "$(dirname "$0")" && pwd)"
ready() { [ -x "$root/usr/bin/python3" ] && chroot "$root" python3 -c 'import torch, ensurepip' >/dev/null 2>&1; }
# Debian builds torch 2.x without libuv; torch's own rendezvous code asks for it regardless.
# The root's torch honours USE_LIBUV there as a libuv build run with USE_LIBUV=0 behaves
# (torch_libuv_patch.py, idempotent: a marker line in each file it changed).
patched() { grep -q "muster test root: USE_LIBUV" "$root/usr/lib/python3/dist-packages/torch/distributed/rendezvous.py" 2>/dev/null; }
if ready && patched; then
  echo "$root"
  exit 0
fi
[ "$(id -u)" = 0 ] || cannot "not root (debootstrap, chroot)"
command -v debootstrap >/dev/null || cannot "no debootstrap (scripts/setup --tests installs it)"
mkdir -p "$cache"
# One builder at a time: the suite's cases for one root may ask for it together.
exec 9>"$cache/torch-$suite.lock"
flock 9
if ready; then
  chroot "$root" python3 - /usr/lib/python3/dist-packages/torch <"$here/torch_libuv_patch.py" >&2
  echo "$root"
  exit 0
fi
log="$cache/torch-$suite.log"
mirror="$(sed -n 's/^URIs: *\(http[^ ]*\/debian\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n 1)"
mirror="${mirror:-http://deb.debian.org/debian}"
rm -rf "$root.part"
# Debian 12's debootstrap has no script named forky: every Debian suite's script is sid's.
debootstrap --variant=minbase --include=python3,python3-venv "$suite" "$root.part" "$mirror" \
  /usr/share/debootstrap/scripts/sid >"$log" 2>&1 ||
  cannot "debootstrap $suite could not make the root: $(tail -n 1 "$log")"
cp /etc/resolv.conf "$root.part/etc/resolv.conf" 2>/dev/null || true
# The archive's Release files for these suites may have expired on a snapshot mirror.
chroot "$root.part" apt-get -o Acquire::Check-Valid-Until=false -q update >>"$log" 2>&1 ||
  cannot "apt-get update in the $suite root failed: $(tail -n 1 "$log")"
DEBIAN_FRONTEND=noninteractive chroot "$root.part" apt-get -o Acquire::Check-Valid-Until=false -q -y \
  install --no-install-recommends python3-torch >>"$log" 2>&1 ||
  cannot "apt-get install python3-torch in the $suite root failed: $(tail -n 1 "$log")"
chroot "$root.part" apt-get clean >>"$log" 2>&1 || true
chroot "$root.part" python3 - /usr/lib/python3/dist-packages/torch <"$here/torch_libuv_patch.py" >>"$log" 2>&1 ||
  cannot "torch_libuv_patch.py failed in the $suite root: $(tail -n 1 "$log")"
rm -rf "$root"
mv "$root.part" "$root"
ready || cannot "the $suite root has no importable torch: $(tail -n 1 "$log")"
echo "$root"
