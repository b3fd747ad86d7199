#!/usr/bin/env bash
# scripts/demo, the README's main job, end to end in a build folder of its own: its set-up
# (a no-op where the packages are present), its MinSizeRel unity build of launch and train
# (a unity source that no longer compiles fails here, not on a user's first run), and a short
# training run whose loss falls.
# Usage: demo_test.sh SOURCE_DIR
set -euo pipefail
src="$1"
build="$(mktemp -d)"
trap 'rm -rf "$build"' EXIT
out="$(MUSTER_BUILD_DIR="$build" MUSTER_DEMO_STEPS=150 "$src/scripts/demo" 2>&1)" || {
  printf '%s\n' "$out" | tail -40 >&2
  echo "demo_test: FAILED: scripts/demo exited non-zero" >&2
  exit 1
}
grep -qE '^CMAKE_BUILD_TYPE:[A-Z]+=MinSizeRel' "$build/CMakeCache.txt" || {
  echo "demo_test: FAILED: not the demo's build type" >&2; exit 1; }
grep -qE '^CMAKE_UNITY_BUILD:[A-Z]+=ON' "$build/CMakeCache.txt" || {
  echo "demo_test: FAILED: not a unity build" >&2; exit 1; }
first="$(grep -oE 'step 50 loss [0-9.]+' <<<"$out" | head -1 | awk '{print $4}')"
final="$(grep -oE 'final loss [0-9.]+ steps 150' <<<"$out" | awk '{print $3}')"
[ -n "$first" ] && [ -n "$final" ] || {
  printf '%s\n' "$out" | tail -20 >&2
  echo "demo_test: FAILED: no loss at step 50 or no final loss after 150 steps" >&2
  exit 1
}
awk -v a="$first" -v b="$final" 'BEGIN { exit !(b < a) }' || {
  echo "demo_test: FAILED: the loss did not fall ($first at step 50, $final at the end)" >&2
  exit 1
}
echo "demo_test: ok (loss $first at step 50, $final after 150 steps)"
