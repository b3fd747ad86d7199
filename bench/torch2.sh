#!/usr/bin/env bash
# A bench against torch 2.x (bench/README.md, "Today's PyTorch"): COMMAND runs inside the Debian
# root of SUITE (tests/support/torch_root.sh: forky = torch 2.14, trixie = torch 2.6) with
# muster installed there from this build's wheel, and is told to use the wheel's launch, the
# root's python3 and that torch's own torchrun (LAUNCH, PYTHON, TORCHRUN; USE_LIBUV=0, since
# Debian builds torch 2.x without libuv):
#     bench/torch2.sh forky python3 bench/goodput.py --only spares,in_place,full,torchrun
#     bench/torch2.sh trixie python3 bench/run --only startup,restart
# Relative paths are the source tree's. BUILD: the build tree (default build/).
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
suite="${1:?usage: bench/torch2.sh forky|trixie COMMAND [ARG...]}"
shift
build="${BUILD:-$src/build}"
root="$("$src/tests/support/torch_root.sh" "$suite" | tail -n 1)"
exec "$src/tests/support/in_torch_root.sh" "$suite" "$build" "$src" -- \
  /usr/sbin/chroot "$root" /usr/bin/env -C "$src" LAUNCH=/opt/muster/bin/muster-launch \
  PYTHON=/usr/bin/python3 TORCHRUN=/usr/bin/torchrun USE_LIBUV=0 BUILD="$build" "$@"
