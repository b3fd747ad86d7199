#!/usr/bin/env bash
# Runs one of the suite's test commands against another release's PyTorch, with muster
# installed there from the wheel as a user would (docs/testing.md, "PyTorch 2.x"):
#     in_torch_root.sh SUITE BUILD_DIR SOURCE_DIR -- TEST_COMMAND [ARG...]
# SUITE is forky (torch 2.14) or trixie (torch 2.6): the root tests/support/torch_root.sh
# makes and keeps. In the root: a venv (--system-site-packages, so Debian's torch is seen) at
# /opt/muster with the build's wheel installed by pip (made and installed again when the
# build's launch or rdzvd or python/ changed). TEST_COMMAND runs on this machine in a mount
# namespace of its own in which the root has /proc, /dev, /sys, /tmp, this machine's
# /etc/hosts and SOURCE_DIR and BUILD_DIR at their own paths, and it is told
# (MUSTER_TEST_LAUNCH, MUSTER_TEST_PYTHON, MUSTER_TEST_TORCH) to run launch as `chroot ROOT
# /opt/muster/bin/muster-launch` and Python as the root's /usr/bin/python3: the workers, their
# torch and muster's Python modules are the root's, the test's checks, its sockets and its
# processes (same pid and network namespaces) are this machine's. Skipped (exit 77) where the
# root cannot be made.
set -euo pipefail
suite="$1" build="$2" src="$3"
shift 3
[ "${1:-}" = "--" ] && shift
here="$(cd "$(dirname "$0")" && pwd)"
# Exit 77 (ctest's SKIP_RETURN_CODE), not the skip marker: the command's own output may hold a
# marker from one case of many that skipped, which must not make the whole test read Skipped.
skip() {
  echo "in_torch_root: skipped: $*"
  exit 77
}
[ "$(id -u)" = 0 ] || skip "not root (chroot, mount namespaces)"
root_out="$("$here/torch_root.sh" "$suite" 2>&1)" || skip "no torch root for $suite: $root_out"
root="$(tail -n 1 <<<"$root_out")"

# The wheel, installed once per build: a stamp of what went into it decides.
stamp="$(cat "$build/launcher/launch" "$build/rendezvous/rdzvd" "$src"/python/*.py "$src"/python/*/*.py 2>/dev/null | sha256sum | cut -c1-16)"
exec 9>"$root.wheel.lock"
flock 9
if [ "$(cat "$root/opt/muster/.stamp" 2>/dev/null)" != "$stamp" ]; then
  work="$(mktemp -d)"
  # scripts/wheel's packing step alone: the suite's build is whole, and building here would
  # race the package tests that build in this tree.
  wheel="$(/usr/bin/python3 "$src/packaging/wheel/muster_wheel.py" "$build" "$work" 2>"$work/wheel.log" | tail -n 1)" ||
    { cat "$work/wheel.log" >&2; rm -rf "$work"; echo "in_torch_root: the wheel could not be made" >&2; exit 1; }
  rm -rf "$root/opt/muster" "$root/opt/wheel"
  mkdir -p "$root/opt/wheel"
  cp "$wheel" "$root/opt/wheel/"
  rm -rf "$work"
  chroot "$root" sh -c 'python3 -m venv --system-site-packages /opt/muster &&
    /opt/muster/bin/pip install -q --no-index /opt/wheel/*.whl' >&2 ||
    { echo "in_torch_root: pip install of the wheel in the $suite root failed" >&2; exit 1; }
  echo "$stamp" >"$root/opt/muster/.stamp"
fi
flock -u 9

# The commands the test runs: chroot into the root, from outside it or (a worker's launch
# execs MUSTER_TEST_PYTHON's path, which /tmp carries inside) from within it.
tools="$(mktemp -d)"
trap 'rm -rf "$tools"' EXIT
# launch sees the /etc/hosts of the mount namespace it is started in (a namespace host's own,
# tests/support/hostnet.h, names node0...), bound over the root's in a namespace of its own.
cat >"$tools/launch" <<SH
#!/bin/sh
exec /usr/bin/unshare -m --propagation private /bin/sh -c 'mount --bind /etc/hosts "\$0/etc/hosts" &&
  exec /usr/sbin/chroot "\$0" /opt/muster/bin/muster-launch "\$@"' "$root" "\$@"
SH
cat >"$tools/python3" <<SH
#!/bin/sh
[ -e /opt/muster/.stamp ] && exec /usr/bin/python3 "\$@"
exec /usr/sbin/chroot "$root" /usr/bin/python3 "\$@"
SH
chmod 755 "$tools/launch" "$tools/python3"
torch_version="$(chroot "$root" /usr/bin/python3 -c 'import torch; print(torch.__version__)' 2>/dev/null | tail -n 1)"
export MUSTER_TEST_LAUNCH="$tools/launch" MUSTER_TEST_PYTHON="$tools/python3" MUSTER_TEST_TORCH="$torch_version"
# Debian builds torch 2.x without libuv, and its TCPStore asks for libuv by default.
export USE_LIBUV=0
echo "in_torch_root: torch $torch_version in $root, muster from its wheel" >&2
rc=0
unshare -m --propagation private sh -c '
  root="$1" src="$2" build="$3"; shift 3
  set -e
  mount -t proc proc "$root/proc"
  mount --rbind /dev "$root/dev"
  mount --rbind /sys "$root/sys"
  mount --rbind /tmp "$root/tmp"
  for d in "$src" "$build"; do mkdir -p "$root$d"; mount --rbind "$d" "$root$d"; done
  # This machine'"'"'s names (MASTER_ADDR is its host name, as torchrun'"'"'s would be).
  for f in /etc/hosts /etc/resolv.conf; do if [ -f "$f" ]; then mount --bind "$f" "$root$f"; fi; done
  exec "$@"' sh "$root" "$src" "$build" "$@" || rc=$?
exit "$rc"  # the EXIT trap removes the commands' folder
