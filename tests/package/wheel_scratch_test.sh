#!/usr/bin/env bash
# The wheel where nothing of ours (and no gRPC, protobuf, abseil, spdlog, fmt, c-ares or re2)
# is around it: a Debian 12 root made by `debootstrap --variant=minbase` with python3 and
# python3-venv only (kept under /var/cache/muster for the next run); in it, a venv, pip install
# of the wheel with no index, a 2-worker standalone job, and a 2-agent c10d job against the
# wheel's muster-rdzvd. Skipped, saying why, without root, debootstrap or the Debian archive.
#     wheel_scratch_test.sh BUILD_DIR SOURCE_DIR [VERSION]
set -euo pipefail
build="$1" src="$2"
skip() {
  echo "MUSTER-TEST-SKIPPED: $*"
  exit 0
}
fail() {
  echo "wheel_scratch_test: FAILED: $*" >&2
  exit 1
}
[ "$(id -u)" = 0 ] || skip "not root (debootstrap, chroot)"
command -v debootstrap >/dev/null || skip "no debootstrap (scripts/setup --tests installs it)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

root=/var/cache/muster/wheel-root
if [ ! -x "$root/usr/bin/python3" ] || ! chroot "$root" python3 -c 'import ensurepip' 2>/dev/null; then
  rm -rf "$root.part"
  mkdir -p "$(dirname "$root")"
  mirror="$(sed -n 's/^URIs: *\(http[^ ]*\/debian\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n 1)"
  debootstrap --variant=minbase --include=python3,python3-venv bookworm "$root.part" \
    "${mirror:-http://deb.debian.org/debian}" >"$work/debootstrap.log" 2>&1 ||
    skip "debootstrap could not make the root: $(tail -n 1 "$work/debootstrap.log")"
  rm -rf "$root"
  mv "$root.part" "$root"
fi
# Nothing of ours, nor what the build links, in the root.
for lib in libgrpc libprotobuf libabsl libspdlog libfmt libcares libre2; do
  ! ls "$root"/usr/lib/x86_64-linux-gnu/"$lib"* >/dev/null 2>&1 || fail "the scratch root has $lib"
done

wheel="$(MUSTER_BUILD_DIR="$build" MUSTER_WHEEL_DIR="$work/dist" "$src/scripts/wheel" 2>"$work/wheel.log" | tail -n 1)" ||
  { cat "$work/wheel.log" >&2; fail "scripts/wheel"; }
rm -rf "$root/t"
mkdir -p "$root/t"
cp "$wheel" "$root/t/"
cat >"$root/t/run.sh" <<'SH'
set -eu
python3 -m venv /t/v
/t/v/bin/pip install -q --no-index /t/*.whl
/t/v/bin/muster-launch --standalone --nproc_per_node=2 /bin/sh -c 'echo "standalone rank $RANK of $WORLD_SIZE"'
mkfifo /t/rdzvd.out
/t/v/bin/muster-rdzvd --listen 127.0.0.1:0 >/t/rdzvd.out 2>/t/rdzvd.err &
rdzvd=$!
exec 3</t/rdzvd.out
port=""
while IFS= read -r line <&3; do
  case "$line" in *"port "*) port="${line#*port }"; port="${port%%[!0-9]*}"; break ;; esac
done
[ -n "$port" ] || { cat /t/rdzvd.err; exit 1; }
agent() {
  /t/v/bin/muster-launch --nnodes=2 --nproc_per_node=1 --rdzv_backend=c10d \
    --rdzv_endpoint="127.0.0.1:$port" --rdzv_id=scratch /bin/sh -c 'echo "c10d rank $RANK of $WORLD_SIZE"'
}
agent >/t/a.out 2>&1 &
a=$!
agent >/t/b.out 2>&1
wait "$a"
cat /t/a.out /t/b.out
kill -TERM "$rdzvd"
wait "$rdzvd"
SH
out="$(unshare -m sh -c "mount -t proc proc '$root/proc' && exec chroot '$root' /bin/sh /t/run.sh" 2>&1)" ||
  fail "in the scratch root: $out"
rm -rf "$root/t"
for want in "standalone rank 0 of 2" "standalone rank 1 of 2" "c10d rank 0 of 2" "c10d rank 1 of 2"; do
  grep -q "$want" <<<"$out" || fail "no '$want' in: $out"
done
echo "wheel_scratch_test: ok"
