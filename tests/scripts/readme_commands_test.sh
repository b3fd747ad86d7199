#!/usr/bin/env bash
# The README's commands stay true: every command in its code blocks is either run here as
# written (build/ being this build folder; a fixed port becomes a free one, 127.0.0.1:0, and a
# file or folder it names is made in a scratch folder) and checked, or listed below with why it
# cannot run on one machine. A command the README gains that is in neither list fails the test.
# Usage: readme_commands_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src="$1" build="$2"
fail() { echo "readme_commands_test: FAILED: $*" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# The commands: indented lines of README.md starting with build/, scripts/ or srun, a trailing
# backslash joining the next line, a trailing "# comment" dropped.
mapfile -t commands < <(awk '
  /^    / { line = substr($0, 5)
    if (joined != "") { sub(/^ +/, "", line); line = joined " " line; joined = "" }
    if (line ~ /\\$/) { sub(/ *\\$/, "", line); joined = line; next }
    if (line ~ /^(build\/|scripts\/|srun )/) { sub(/ +# .*$/, "", line); print line } }
' "$src/README.md")
[ "${#commands[@]}" -ge 20 ] || fail "found only ${#commands[@]} commands in README.md"

# Not run here, and why.
not_here() {
  case "$1" in
    scripts/demo) echo "run by its own test, scripts/demo_test.sh" ;;
    scripts/test) echo "the suite's own set-up: what CI runs" ;;
    *"--nproc_per_node=gpu"*) echo "needs a GPU" ;;
    *"--rdzv_endpoint=node0:29400"* | *"--hosts node1:8"* | *"--hostfile hosts.txt"* | srun*)
      echo "needs other machines (or Slurm's)" ;;
    *"--etcd e1:2379"*) echo "needs an etcd cluster on other machines" ;;
    *"..."* | *"["*) echo "a template (... or [optional] parts), not a command" ;;
    *) return 1 ;;
  esac
}

source "$src/tests/support/serve.sh"  # serve_then_stop

ran=0
skipped=0
missing=""  # tools a runnable command needs and this machine lacks: the test is then Skipped
for c in "${commands[@]}"; do
  if why="$(not_here "$c")"; then
    echo "readme: not run ($why): $c"
    skipped=$((skipped + 1))
    continue
  fi
  # As written, with build/ this build and the changes the header names.
  cmd="${c//build\//$build/}"
  cmd="${cmd//0.0.0.0:29400/127.0.0.1:0}"
  cmd="${cmd//--http_port 8080/--http_port 0}"
  cmd="${cmd//\/var\/lib\/rdzvd/$work\/state}"
  read -r -a argv <<<"$cmd"
  echo "readme: run: $c"
  case "$c" in
    "build/launcher/launch --help")
      out="$("${argv[@]}")" || fail "$c"
      grep -q -- '--nproc_per_node' <<<"$out" || fail "$c: no --nproc_per_node in: $out" ;;
    "build/launcher/launch --version")
      "${argv[@]}" | grep -qE '^launch [0-9]+\.[0-9]+\.[0-9]+ \(commit ' || fail "$c" ;;
    *examples/train/train*)
      out="$(cd "$work" && "${argv[@]}" 2>&1)" || fail "$c: $out"
      grep -q 'loss' <<<"$out" || fail "$c: no loss in: $out" ;;
    *examples/python/ddp.py*)
      if ! /usr/bin/python3 -c 'import torch.distributed' 2>/dev/null; then
        missing+="python3-torch "
        continue
      fi
      out="$(cd "$src" && "${argv[@]}" 2>&1)" || fail "$c: $out"
      grep -qE 'fitted y = (2\.9[5-9]|3\.0[0-5])[0-9]*x -(0\.9[5-9]|1\.0[0-5])[0-9]* on 4 ranks' <<<"$out" ||
        fail "$c: not the fitted line: $out" ;;
    build/rendezvous/rdzvd*)
      [[ "$cmd" == *--listen* ]] || argv+=(--listen 127.0.0.1:0)
      [[ "$c" != *--token_file* ]] || echo "job secret" >"$work/tokens.txt"
      [[ "$c" != *--state_dir* ]] || mkdir -p "$work/state"
      serve_then_stop "$work" "${argv[@]}" ||
        fail "$c: did not listen, or did not exit 0 on SIGTERM: $(cat "$work/serve.err")" ;;
    *) fail "a README command neither run nor listed as not runnable here: $c" ;;
  esac
  ran=$((ran + 1))
done
# The GPU line, on a machine without one: one clear error line, exit 2.
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  set +e
  err="$("$build/launcher/launch" --standalone --nproc_per_node=gpu -m mypkg.train 2>&1 >/dev/null)"
  rc=$?
  set -e
  [ "$rc" = 2 ] || fail "--nproc_per_node=gpu without a GPU exited $rc"
  [ "$err" = "launch: error: --nproc_per_node=gpu: no CUDA device is visible" ] ||
    fail "--nproc_per_node=gpu without a GPU said: $err"
fi
echo "readme_commands_test: ok ($ran run, $skipped not runnable on one machine)"
# Everything else passed; a command that could not run for a missing tool makes it Skipped.
[ -z "$missing" ] || echo "MUSTER-TEST-SKIPPED: missing ${missing% } (scripts/setup --tests)"
