#!/usr/bin/python3
"""A Python worker that hangs, under launch --hang_timeout and under torchrun (bench/README.md,
"Hangs"). tests/interop/hang_in_sleep.py, 4 ranks: rank 1 sleeps forever at step 3 in
wait_for_batch_forever() while the others wait in that step's "all_reduce". No restarts: the
job should fail, naming the rank. Each output line is timestamped as it is read.

  bench/hang_py.py [--reps N] [--torchrun-wait S]     (run bench/hang.sh first: it builds launch)
"""
import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("BUILD", "/work/build-bench")
LAUNCH = os.path.join(BUILD, "launcher/launch")
TORCHRUN = "/work/shared/peer/torchrun311"
SCRIPT = os.path.join(ROOT, "tests/interop/hang_in_sleep.py")
ENV = dict(os.environ, PYTHON_EXEC="/usr/bin/python3", PYTHONPATH=os.path.join(ROOT, "python"))


def run(argv, wait_after_hang):
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV,
                         start_new_session=True)
    lines = []

    def read():
        for raw in iter(p.stdout.readline, b""):
            lines.append((time.monotonic() - t0, raw.decode(errors="replace").rstrip()))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    hang_at = None
    deadline = time.monotonic() + 60
    while p.poll() is None and time.monotonic() < deadline:
        hang_at = next((t for t, l in lines if "hanging at step 3" in l), None)
        if hang_at is not None and time.monotonic() - t0 > hang_at + wait_after_hang:
            break
        time.sleep(0.02)
    ended = p.poll() is not None
    if not ended:
        os.killpg(p.pid, signal.SIGKILL)  # its own session: the launcher and its workers
        p.wait()
    reader.join(5)
    return hang_at, ended, p.returncode, lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--torchrun-wait", type=float, default=30.0)
    args = ap.parse_args()
    found, ends = [], []
    for _ in range(args.reps):
        hang_at, ended, rc, lines = run([LAUNCH, "--standalone", "--nproc_per_node=4",
                                         "--hang_timeout=2", SCRIPT], 30)
        named = next((t for t, l in lines if "hang: rank 1" in l), None)
        if hang_at is None or named is None or not ended or rc != 1:
            sys.exit("launch run went wrong:\n" + "\n".join(l for _, l in lines[-30:]))
        found.append(named - hang_at)
        ends.append(lines[-1][0] - hang_at)
    med = lambda xs: f"{statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"
    print(f"launch --hang_timeout=2, {args.reps} runs: hang -> rank 1 named {med(found)}; "
          f"hang -> job ended (exit 1, traceback in the summary) {med(ends)}")
    hang_at, ended, rc, lines = run([TORCHRUN, "--standalone", "--nproc_per_node=4",
                                     "--monitor_interval=0.1", SCRIPT], args.torchrun_wait)
    after = [l for t, l in lines if hang_at is not None and t > hang_at]
    print(f"torchrun (1.13), once: hang line at {hang_at if hang_at is None else round(hang_at, 2)} s; "
          f"{len(after)} lines in the {args.torchrun_wait:.0f} s after it; ended by itself: {ended}")


if __name__ == "__main__":
    main()
