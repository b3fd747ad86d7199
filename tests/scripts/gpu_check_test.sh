#!/usr/bin/env bash
# scripts/gpu-check over fake bundles (tests/scripts/gpu_check_test.sh SCRIPT): a failing step
# fails the script and is named in its last line, a skipped (77) step is a failure there too,
# every step still runs after one fails, and a bundle whose steps all pass exits 0.
set -euo pipefail
script="$1"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# bundle DIR NCCL_RC CUDA_RC TRAIN_RC: stub programs that log their call and exit as told.
bundle() {
  mkdir -p "$1/bin" "$1/lib"
  printf '#!/bin/sh\necho ran nccl_test >>"%s/calls"\nexit %s\n' "$1" "$2" >"$1/bin/nccl_test"
  printf '#!/bin/sh\necho ran train_cuda_test >>"%s/calls"\nexit %s\n' "$1" "$3" \
    >"$1/bin/train_cuda_test"
  printf '#!/bin/sh\necho ran launch "$@" >>"%s/calls"\nexit %s\n' "$1" "$4" >"$1/bin/launch"
  printf '#!/bin/sh\nexit 0\n' >"$1/bin/train"
  chmod +x "$1"/bin/*
}
fail() { echo "gpu_check_test: $*" >&2; exit 1; }

# run NAME: runs the script on bundle NAME; sets rc and last (its last line of output).
run() {
  rc=0
  MUSTER_GPU_CHECK_DIR="$tmp/$1" OUT="$tmp/$1" "$script" >"$tmp/$1.out" 2>&1 || rc=$?
  last="$(tail -n 1 "$tmp/$1.out")"
}

bundle "$tmp/nccl_fails" 1 0 0
run nccl_fails
[ "$rc" -ne 0 ] || fail "a failing nccl_test exited 0"
[ "$last" = "gpu-check: FAILED 1 of 5 steps: nccl_test (rc=1)" ] || fail "last line: $last"
[ "$(grep -c '^ran' "$tmp/nccl_fails/calls")" -eq 5 ] || fail "not every step ran after the failure"
grep -q "FAILED 1 of 5" "$tmp/nccl_fails/gpu-check.txt" || fail "no summary in \$OUT/gpu-check.txt"

bundle "$tmp/skips" 77 0 3
run skips
[ "$rc" -ne 0 ] || fail "a skipped nccl_test and failing runs exited 0"
[ "$last" = "gpu-check: FAILED 4 of 5 steps: nccl_test (skipped), train --precision bf16 (rc=3), train --precision fp16 (rc=3), train --precision fp32 (rc=3)" ] ||
  fail "last line: $last"

bundle "$tmp/passes" 0 0 0
run passes
[ "$rc" -eq 0 ] || fail "all steps passed but the script exited $rc: $(cat "$tmp/passes.out")"
[ "$last" = "gpu-check: all 5 steps passed" ] || fail "last line: $last"

mkdir -p "$tmp/missing"
run missing
[ "$rc" -ne 0 ] || fail "a missing bundle exited 0"
[ "$last" = "gpu-check: FAILED 1 of 1 steps: bundle (missing)" ] || fail "last line: $last"
echo "gpu_check_test: ok"
