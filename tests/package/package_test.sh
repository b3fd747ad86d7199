#!/usr/bin/env bash
# The Debian packages as a user gets them (packaging/): cpack builds them from this build, their
# contents and control fields are checked with dpkg-deb, they are unpacked into a scratch root
# and the installed binaries run from there: --version, a standalone job, the man pages, the
# bash completion, the systemd unit (systemd-analyze verify), the Python helpers, and a C++
# project outside the tree that find_package(muster)s the worker runtime, built and run under
# the installed launch.
# Usage: package_test.sh BUILD_DIR SOURCE_DIR VERSION
set -euo pipefail
build="$1" src="$2" version="$3"
skip() { echo "MUSTER-TEST-SKIPPED: $*"; exit 0; }
fail() { echo "package_test: FAILED: $*" >&2; exit 1; }
for tool in cpack dpkg-deb dpkg help2man systemd-analyze pkg-config bash; do
  command -v "$tool" >/dev/null || skip "$tool not found (scripts/setup --tests installs it)"
done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# 1. Build the packages.
(cd "$build" && cpack -G DEB -B "$work/out") >"$work/cpack.log" 2>&1 || {
  cat "$work/cpack.log" >&2
  fail "cpack -G DEB"
}
arch="$(dpkg --print-architecture)"
tools_deb="$work/out/muster_${version}_${arch}.deb"
dev_deb="$work/out/muster-dev_${version}_${arch}.deb"
[ -f "$tools_deb" ] && [ -f "$dev_deb" ] || fail "expected $tools_deb and $dev_deb; got: $(ls "$work/out")"

# 2. Their contents and control fields.
dpkg-deb -c "$tools_deb" | awk '{print $6}' | sed 's|^\./|/|' >"$work/tools.list"
dpkg-deb -c "$dev_deb" | awk '{print $6}' | sed 's|^\./|/|' >"$work/dev.list"
expect() {  # expect LIST PATH...
  local list="$1"
  shift
  for p in "$@"; do grep -qxF "$p" "$work/$list" || fail "$p is not in the $list package"; done
}
expect tools.list /usr/bin/launch /usr/bin/rdzvd /usr/share/man/man1/launch.1.gz \
  /usr/share/man/man1/rdzvd.1.gz /usr/share/bash-completion/completions/launch \
  /usr/share/bash-completion/completions/rdzvd /usr/lib/systemd/system/rdzvd.service \
  /etc/default/rdzvd /usr/lib/python3/dist-packages/muster_progress.py \
  /usr/lib/python3/dist-packages/muster_progress_auto.py \
  /usr/lib/muster/python/muster_hook/sitecustomize.py /usr/share/doc/muster/README.md \
  /usr/share/doc/muster/launch.md
expect dev.list /usr/include/muster/worker/runtime.h /usr/include/muster/worker/comm/communicator.h \
  /usr/include/muster/rendezvous/store.h /usr/lib/libmuster_worker.a /usr/lib/libmuster_rendezvous_client.a \
  /usr/lib/cmake/muster/musterConfig.cmake /usr/lib/cmake/muster/musterConfigVersion.cmake \
  /usr/lib/cmake/muster/musterTargets.cmake /usr/lib/pkgconfig/muster.pc
grep -q '^/usr/local' "$work/tools.list" "$work/dev.list" && fail "a file under /usr/local"
# Nothing of the tests, benches or examples.
grep -E 'test|bench|/train$|/hello$' "$work/tools.list" "$work/dev.list" | grep -v '/docs\?/\|/doc/' &&
  fail "test, bench or example files in a package"
[ "$(dpkg-deb -f "$tools_deb" Package)" = muster ] || fail "Package of $tools_deb"
[ "$(dpkg-deb -f "$tools_deb" Version)" = "$version" ] || fail "Version of $tools_deb"
depends="$(dpkg-deb -f "$tools_deb" Depends)"
# The binaries are self-contained (docs/launch.md, "What start-up costs"): glibc is all they need.
[[ "$depends" == *libc6* ]] || fail "muster's Depends lacks libc6: $depends"
for lib in libgrpc libprotobuf libabsl libspdlog libfmt libssl libstdc++; do
  [[ "$depends" != *"$lib"* ]] || fail "muster's Depends names $lib (linked in): $depends"
done
[[ "$(dpkg-deb -f "$dev_deb" Depends)" == *libgrpc++-dev* ]] || fail "muster-dev's Depends"
dpkg-deb --ctrl-tarfile "$tools_deb" | tar -xO ./conffiles 2>/dev/null | grep -qx /etc/default/rdzvd ||
  fail "/etc/default/rdzvd is not a conffile"

# 3. Unpacked into a scratch root, run from there.
root="$work/root"
dpkg-deb -x "$tools_deb" "$root"
dpkg-deb -x "$dev_deb" "$root"
launch="$root/usr/bin/launch" rdzvd="$root/usr/bin/rdzvd"
"$launch" --version | grep -qE "^launch $version \(commit [0-9a-f]{7,}(-dirty)?\)$" ||
  fail "launch --version: $("$launch" --version 2>&1)"
"$rdzvd" --version | grep -qE "^rdzvd $version \(commit " || fail "rdzvd --version"
# The branded names beside them, and the torchrun stand-in (docs/operations.md, "Installing").
for tool in launch rdzvd; do
  [ "$(readlink "$root/usr/bin/muster-$tool")" = "$tool" ] || fail "muster-$tool is not a link to $tool"
done
"$root/usr/bin/muster-launch" --version | grep -qE "^launch $version " || fail "muster-launch --version"
[ -x "$root/usr/bin/muster-torchrun-standin" ] || fail "no muster-torchrun-standin"
[ ! -e "$root/usr/bin/torchrun" ] || fail "the package installs a torchrun"
out="$("$launch" --standalone --nproc_per_node=2 /bin/sh -c 'echo "rank $RANK of $WORLD_SIZE"')" ||
  fail "a standalone job under the installed launch"
[ "$(grep -c 'rank [01] of 2' <<<"$out")" = 2 ] || fail "standalone job output: $out"

# Man pages: troff from --help, naming the flags.
zcat "$root/usr/share/man/man1/launch.1.gz" | grep -q '^\.TH LAUNCH "1"' || fail "launch.1's .TH"
zcat "$root/usr/share/man/man1/launch.1.gz" | grep -q 'nproc_per_node' || fail "launch.1 lacks flags"
zcat "$root/usr/share/man/man1/rdzvd.1.gz" | grep -q 'state_dir' || fail "rdzvd.1 lacks flags"

# Bash completion: flags from --help; after the program, files.
comp="$root/usr/share/bash-completion/completions/launch"
got="$(bash -c 'source "$1"; COMP_WORDS=("$2" --nproc); COMP_CWORD=1; _muster_complete
  printf "%s\n" "${COMPREPLY[@]}"' _ "$comp" "$launch")"
grep -qx -- --nproc_per_node <<<"$got" || fail "completion of --nproc: $got"
touch "$work/progfile"
got="$(cd "$work" && bash -c 'source "$1"; COMP_WORDS=("$2" --nproc_per_node 2 prog --np); COMP_CWORD=4
  _muster_complete; printf "%s\n" "${COMPREPLY[@]}"' _ "$comp" "$launch")"
[ -z "$got" ] || fail "after the program launch completed its flags: $got"
got="$(bash -c 'source "$1"; COMP_WORDS=("$2" --state); COMP_CWORD=1; _muster_complete
  printf "%s\n" "${COMPREPLY[@]}"' _ "$comp" "$rdzvd")"
grep -qx -- --state_dir <<<"$got" || fail "rdzvd completion of --state: $got"

# The unit: ExecStart names the packaged rdzvd; systemd-analyze verifies it (the copy checked
# names the scratch root's rdzvd, which systemd-analyze requires to exist).
unit="$root/usr/lib/systemd/system/rdzvd.service"
grep -qx 'ExecStart=/usr/bin/rdzvd --state_dir /var/lib/rdzvd $RDZVD_OPTS' "$unit" ||
  fail "rdzvd.service's ExecStart: $(grep ExecStart "$unit")"
grep -qx 'Restart=always' "$unit" || fail "rdzvd.service is not Restart=always"
grep -qx 'EnvironmentFile=-/etc/default/rdzvd' "$unit" || fail "rdzvd.service's EnvironmentFile"
mkdir -p "$work/units"
sed "s|=/usr/bin/rdzvd|=$rdzvd|" "$unit" >"$work/units/rdzvd.service"
systemd-analyze verify "$work/units/rdzvd.service" >"$work/verify.log" 2>&1 || {
  cat "$work/verify.log" >&2
  fail "systemd-analyze verify rdzvd.service"
}
# What the unit runs, as it runs it: the flags from /etc/default/rdzvd, its state folder.
source "$src/tests/support/serve.sh"  # serve_then_stop
(
  set -a
  source "$root/etc/default/rdzvd"
  set +a
  mkdir -p "$work/state"
  # shellcheck disable=SC2086
  serve_then_stop "$work" "$rdzvd" --state_dir "$work/state" ${RDZVD_OPTS/0.0.0.0:29400/127.0.0.1:0}
) || fail "rdzvd as the unit runs it did not listen or exit 0 on SIGTERM: $(cat "$work/serve.err")"

# Python helpers: where Debian's python3 (/usr/bin/python3) looks, importable from there.
/usr/bin/python3 -c 'import sys; sys.exit("/usr/lib/python3/dist-packages" not in sys.path)' ||
  fail "python3 does not search /usr/lib/python3/dist-packages"
PYTHONPATH="$root/usr/lib/python3/dist-packages" /usr/bin/python3 -c \
  'import muster_progress, muster_progress_auto; muster_progress.step(1, "x")' ||
  fail "import muster_progress from the package"

# 4. A C++ project outside the tree: find_package(muster), then pkg-config; run under launch.
cmake -S "$src/tests/package/consumer" -B "$work/consumer" -DCMAKE_PREFIX_PATH="$root/usr" \
  -DCMAKE_BUILD_TYPE=Release >"$work/consumer.log" 2>&1 &&
  cmake --build "$work/consumer" -j "$(nproc)" >>"$work/consumer.log" 2>&1 || {
  cat "$work/consumer.log" >&2
  fail "the out-of-tree project did not build against the package"
}
grep -q "$root/usr/lib/cmake/muster" "$work/consumer/CMakeCache.txt" || fail "not the package's muster"
out="$("$launch" --standalone --nproc_per_node=3 "$work/consumer/consumer")" || fail "consumer: $out"
for r in 0 1 2; do grep -q "consumer rank $r/3 sum=6" <<<"$out" || fail "consumer rank $r: $out"; done
grep -q "consumer rank 0/3 sum=6 others=2" <<<"$out" || fail "consumer's store: $out"
flags="$(PKG_CONFIG_PATH="$root/usr/lib/pkgconfig" pkg-config --cflags --libs muster)" ||
  fail "pkg-config muster"
[[ "$flags" == *"-I$root/usr/lib/pkgconfig/../../include"* || "$flags" == *"-I$root/usr/include"* ]] ||
  fail "pkg-config's include folder is not the package's: $flags"
# shellcheck disable=SC2086
g++ -std=c++20 -O1 "$src/tests/package/consumer/main.cc" -o "$work/consumer_pc" $flags \
  >"$work/pc.log" 2>&1 || {
  cat "$work/pc.log" >&2
  fail "building with pkg-config's flags"
}
out="$("$launch" --standalone --nproc_per_node=2 "$work/consumer_pc")" || fail "consumer_pc: $out"
grep -q "consumer rank 1/2 sum=3" <<<"$out" || fail "consumer_pc: $out"
echo "package_test: ok ($(wc -l <"$work/tools.list") paths in muster, $(wc -l <"$work/dev.list") in muster-dev)"
