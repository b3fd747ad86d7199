#!/usr/bin/env bash
# The wheel (docs/operations.md, "Installing: pip"): scripts/wheel makes it from this build;
# every ELF file in it needs only the manylinux libraries and no glibc symbol newer than
# GLIBC_2.34; pip installs it, with no index, into a fresh venv, whose muster-launch runs a
# standalone job and a 2-agent c10d job against the venv's muster-rdzvd, whose Python finds
# the helpers, and whose launch finds its hang hook; the torchrun stand-in installs, refuses a
# torchrun it did not write, and is removed.
#     wheel_test.sh BUILD_DIR SOURCE_DIR VERSION
set -euo pipefail
build="$1" src="$2" version="$3"
work="$(mktemp -d)"
rdzvd_pid=""
cleanup() {
  if [ -n "$rdzvd_pid" ]; then kill -TERM "$rdzvd_pid" 2>/dev/null || true; wait "$rdzvd_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "wheel_test: FAILED: $*" >&2
  exit 1
}
[ -x /usr/bin/python3 ] && /usr/bin/python3 -c 'import ensurepip' 2>/dev/null || {
  echo "MUSTER-TEST-SKIPPED: no python3-venv (scripts/setup --tests installs it)"
  exit 0
}

# 1. Made, named and sized as the docs say.
wheel="$(MUSTER_BUILD_DIR="$build" MUSTER_WHEEL_DIR="$work/dist" "$src/scripts/wheel" 2>"$work/wheel.log" | tail -n 1)" ||
  { cat "$work/wheel.log" >&2; fail "scripts/wheel"; }
[ "$(basename "$wheel")" = "muster-$version-py3-none-manylinux_2_34_x86_64.whl" ] || fail "wheel name: $wheel"
size=$(stat -c %s "$wheel")
[ "$size" -le $((25 * 1024 * 1024)) ] || fail "the wheel is $size bytes, over 25 MB"

# 2. Every ELF file within the tag.
/usr/bin/python3 -m zipfile -e "$wheel" "$work/unpacked"
elves=0
while IFS= read -r -d '' f; do
  head -c 4 "$f" | grep -q $'\x7fELF' || continue
  elves=$((elves + 1))
  problems="$(/usr/bin/python3 -c 'import sys; sys.path.insert(0, sys.argv[1])
import muster_wheel; print("\n".join(muster_wheel.check_elf(sys.argv[2])))' "$src/packaging/wheel" "$f")"
  [ -z "$problems" ] || fail "$problems"
done < <(find "$work/unpacked" -type f -print0)
[ "$elves" = 2 ] || fail "$elves ELF files in the wheel, not 2 (launch, rdzvd)"
# The checker names what it should: Debian's python3 needs libz and libexpat.
bad="$(/usr/bin/python3 -c 'import sys; sys.path.insert(0, sys.argv[1])
import muster_wheel; print(len(muster_wheel.check_elf(sys.argv[2])))' "$src/packaging/wheel" "$(readlink -f /usr/bin/python3)")"
[ "$bad" -gt 0 ] || fail "check_elf passes python3, which needs libz/libexpat outside the manylinux set"

# 3. Installed into a fresh venv, without an index.
/usr/bin/python3 -m venv "$work/v"
"$work/v/bin/pip" install -q --no-index "$wheel" >"$work/pip.log" 2>&1 || { cat "$work/pip.log" >&2; fail "pip install"; }
v="$work/v/bin"
for cmd in muster-launch muster-rdzvd muster-torchrun-standin; do [ -x "$v/$cmd" ] || fail "no $cmd in the venv"; done
[ ! -e "$v/launch" ] && [ ! -e "$v/torchrun" ] || fail "the wheel installed a bare launch or a torchrun"
"$v/muster-launch" --version | grep -qE "^launch $version " || fail "muster-launch --version"
out="$("$v/muster-launch" --standalone --nproc_per_node=2 /bin/sh -c 'echo "rank $RANK of $WORLD_SIZE"')" ||
  fail "a standalone job: $out"
[ "$(grep -c 'rank [01] of 2' <<<"$out")" = 2 ] || fail "standalone job output: $out"
"$v/python" -c 'import muster_inplace, muster_progress, muster_progress_auto' || fail "the helpers do not import"
# The hang hook is found beside the venv's launch: a Python worker under --hang_timeout gets it.
echo 'import os; print("PYTHONPATH=" + os.environ.get("PYTHONPATH", ""))' >"$work/hook.py"
out="$(PYTHON_EXEC="$v/python" "$v/muster-launch" --standalone --nproc_per_node=1 --hang_timeout=30 \
  "$work/hook.py")" || fail "python worker: $out"
grep -q "PYTHONPATH=$work/v/bin/../lib/muster/python/muster_hook" <<<"$out" ||
  fail "the hang hook is not the venv's: $out"

# 4. Two agents (c10d) against the venv's rdzvd.
mkfifo "$work/rdzvd.out"
"$v/muster-rdzvd" --listen 127.0.0.1:0 >"$work/rdzvd.out" 2>"$work/rdzvd.err" &
rdzvd_pid=$!
exec {fd}<"$work/rdzvd.out"
port=""
while IFS= read -r -t 30 line <&"$fd"; do
  if [[ "$line" =~ port\ ([0-9]+) ]]; then port="${BASH_REMATCH[1]}"; break; fi
done
[ -n "$port" ] || fail "muster-rdzvd did not listen: $(cat "$work/rdzvd.err")"
agent() {
  "$v/muster-launch" --nnodes=2 --nproc_per_node=1 --rdzv_backend=c10d \
    --rdzv_endpoint="127.0.0.1:$port" --rdzv_id=wheel /bin/sh -c 'echo "rank $RANK of $WORLD_SIZE"'
}
agent >"$work/a.out" 2>&1 &
a=$!
agent >"$work/b.out" 2>&1 || fail "agent b: $(cat "$work/b.out")"
wait "$a" || fail "agent a: $(cat "$work/a.out")"
cat "$work/a.out" "$work/b.out" | grep -q "rank 0 of 2" && cat "$work/a.out" "$work/b.out" | grep -q "rank 1 of 2" ||
  fail "c10d job output: $(cat "$work/a.out" "$work/b.out")"
kill -TERM "$rdzvd_pid"
wait "$rdzvd_pid" || fail "muster-rdzvd did not exit 0 on SIGTERM"
rdzvd_pid=""
exec {fd}<&-

# 5. PyTorch in place under the wheel's launcher: a venv that sees the host's torch, a worker
# killed (SIGKILL, by its pid) mid-run; the survivor re-forms in place and both ranks finish.
if /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  /usr/bin/python3 -m venv --system-site-packages "$work/tv"
  "$work/tv/bin/pip" install -q --no-index "$wheel" >"$work/pip2.log" 2>&1 || { cat "$work/pip2.log" >&2; fail "pip install (torch venv)"; }
  mkfifo "$work/ddp.fifo"
  PYTHON_EXEC="$work/tv/bin/python" PYTHONPATH="" "$work/tv/bin/muster-launch" --standalone \
    --nproc_per_node=2 --in_place --max_restarts=1 "$src/examples/python/ddp_in_place.py" \
    --steps 200 --log-every 50 --step-sleep-ms 20 >"$work/ddp.fifo" 2>&1 &
  job=$!
  exec {dfd}<"$work/ddp.fifo"
  while IFS= read -r -t 60 line <&"$dfd"; do  # until rank 0 logs step 50
    echo "$line" >>"$work/ddp.out"
    [[ "$line" == "[default0]:step 50:"* ]] && break
  done
  cat <&"$dfd" >>"$work/ddp.out" &
  drain=$!
  victim=""
  for child in $(cat /proc/"$job"/task/*/children 2>/dev/null); do
    if tr '\0' '\n' <"/proc/$child/environ" 2>/dev/null | grep -qx "RANK=1"; then victim=$child; fi
  done
  [ -n "$victim" ] || { kill -TERM "$job" 2>/dev/null; wait "$job" || true; wait "$drain"; fail "no rank 1 worker to kill: $(cat "$work/ddp.out")"; }
  kill -KILL "$victim"
  rc=0
  wait "$job" || rc=$?
  wait "$drain"
  exec {dfd}<&-
  [ "$rc" = 0 ] || fail "the in-place job exited $rc: $(cat "$work/ddp.out")"
  grep -q "re-formed in place as rank 0 of 2" "$work/ddp.out" || fail "no in-place re-form: $(cat "$work/ddp.out")"
  [ "$(grep -c "final loss .* steps 200" "$work/ddp.out")" = 2 ] || fail "not both ranks finished: $(cat "$work/ddp.out")"
fi

# 6. The torchrun stand-in: in a chosen folder; never over a torchrun it did not write.
mkdir "$work/bin" "$work/torchbin"
"$v/muster-torchrun-standin" install "$work/bin" >/dev/null || fail "stand-in install"
out="$("$work/bin/torchrun" --standalone --nproc_per_node=2 /bin/sh -c 'echo "rank $RANK"')" ||
  fail "torchrun (the stand-in): $out"
[ "$(grep -c 'rank [01]' <<<"$out")" = 2 ] || fail "the stand-in's job: $out"
"$v/muster-torchrun-standin" install "$work/bin" >/dev/null || fail "a second install over its own link"
printf '#!/bin/sh\necho torch\n' >"$work/torchbin/torchrun"
chmod +x "$work/torchbin/torchrun"
set +e
err="$("$v/muster-torchrun-standin" install "$work/torchbin" 2>&1)"
rc=$?
set -e
[ "$rc" = 2 ] || fail "installing over torch's torchrun exited $rc"
[ "$(wc -l <<<"$err")" = 1 ] && [[ "$err" == "muster-torchrun-standin: error: $work/torchbin/torchrun exists"* ]] ||
  fail "the refusal is not one line: $err"
[ "$("$work/torchbin/torchrun")" = torch ] || fail "torch's torchrun was changed"
set +e
"$v/muster-torchrun-standin" remove "$work/torchbin" 2>/dev/null
rc=$?
set -e
[ "$rc" = 2 ] && [ -x "$work/torchbin/torchrun" ] || fail "remove took a torchrun it did not write"
"$v/muster-torchrun-standin" remove "$work/bin" >/dev/null || fail "stand-in remove"
[ ! -e "$work/bin/torchrun" ] && [ ! -L "$work/bin/torchrun" ] || fail "the stand-in is still there"
echo "wheel_test: ok ($((size / 1024 / 1024)) MB)"
