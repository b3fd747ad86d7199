#!/usr/bin/env python3
"""Hang of one of 4 ranks (bench/README.md, "Hangs (--hang_timeout, issue 14)").

The example trainer blocks rank 2 in its data loader at step 15 (first attempt only). muster's
launch --hang_timeout=2 names it, dumps its stacks, fails the group and restarts it from the
step-10 checkpoint; each output line is timestamped as read (time.monotonic). torchrun (1.13,
no hang detection) runs the same job for 60 s after the injected hang; then it is ended by pid
(SIGTERM, then SIGKILL of its process group and of every descendant seen), and nothing is left.
"""
import argparse
import os
import re
import selectors
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

BUILD = os.environ.get("BUILD", "/work/build-bench")
TORCHRUN = "/work/shared/peer/torchrun311"
TRAIN_FLAGS = ["--steps", "40", "--checkpoint-every", "10", "--log-every", "1",
               "--hang-at-step", "15", "--hang-rank", "2"]


def descendants(root):
    """Pids whose parent chain reaches root, from /proc."""
    parent = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                s = f.read()
            parent[int(d)] = int(s[s.rfind(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            pass
    out, frontier = set(), {root}
    while frontier:
        nxt = {p for p, pp in parent.items() if pp in frontier and p not in out}
        out |= nxt
        frontier = nxt
    return out


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
        return s[s.rfind(")") + 2] != "Z"
    except OSError:
        return False


def run(argv, stop):
    """Runs argv (its own session); returns [(t, stream, line)], t from the start, and rc.
    stop(lines, now) -> True ends it by pid (SIGTERM, then SIGKILL of its group and of what
    it started)."""
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         start_new_session=True)
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ, "out")
    sel.register(p.stderr, selectors.EVENT_READ, "err")
    bufs = {"out": b"", "err": b""}
    lines, seen, open_streams, stopped = [], set(), 2, False
    while open_streams:
        for key, _ in sel.select(timeout=0.2):
            data = os.read(key.fileobj.fileno(), 65536)
            now = time.monotonic() - t0
            if not data:
                sel.unregister(key.fileobj)
                open_streams -= 1
                continue
            bufs[key.data] += data
            *whole, bufs[key.data] = bufs[key.data].split(b"\n")
            lines += [(now, key.data, l.decode(errors="replace")) for l in whole]
        if not stopped:
            seen |= descendants(p.pid)
        if not stopped and stop(lines, time.monotonic() - t0):
            stopped = True
            seen |= descendants(p.pid)
            os.kill(p.pid, signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
            for pid in seen:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
            break
    rc = p.wait()
    end = time.monotonic() - t0
    for pid in seen:  # nothing left behind, by pid
        for _ in range(100):
            if not alive(pid):
                break
            time.sleep(0.05)
        if alive(pid):
            sys.exit(f"pid {pid} was left behind")
    return lines, rc, end, len(seen)


def first(lines, pattern, after=0.0, stream=None):
    r = re.compile(pattern)
    for t, s, l in lines:
        if t >= after and (stream is None or s == stream) and r.search(l):
            return t
    return None


def muster_once(tmp):
    logs, ck = os.path.join(tmp, "logs"), os.path.join(tmp, "ck")
    argv = [f"{BUILD}/launcher/launch", "--standalone", "--nproc_per_node=4", "--max_restarts=1",
            "--hang_timeout=2", "--log_dir", logs, f"{BUILD}/examples/train/train",
            *TRAIN_FLAGS, "--checkpoint-dir", ck]
    lines, rc, end, _ = run(argv, lambda lines, now: now > 300)
    a = first(lines, r"rank 2: injected hang at step 15")
    b = first(lines, r"hang: rank 2 .*stuck at step 15", stream="err")
    c = first(lines, r"restarting workers")
    r = first(lines, r"resuming after step", after=c or 0)
    d = first(lines, r"step \d+ loss", after=r or 0)
    if rc != 0 or None in (a, b, c, r, d):
        sys.exit(f"muster run failed (rc {rc}):\n" + "\n".join(l for _, _, l in lines[-40:]))
    return {"hang line -> hang warning": b - a, "warning -> restarting": c - b,
            "restarting -> first step after resume": d - c, "first step -> job end": end - d,
            "hang line -> job end": end - a, "job start -> job end": end}


def torchrun_once(tmp, wait_after):
    ck = os.path.join(tmp, "ck")
    argv = [TORCHRUN, "--standalone", "--nproc_per_node=4", "--max_restarts=1",
            "--monitor_interval=0.1", "--no_python", f"{BUILD}/examples/train/train",
            *TRAIN_FLAGS, "--checkpoint-dir", ck]

    def stop(lines, now):
        a = first(lines, r"rank 2: injected hang at step 15")
        return (a is not None and now > a + wait_after) or now > 300

    lines, rc, end, n = run(argv, stop)
    a = first(lines, r"rank 2: injected hang at step 15")
    if a is None:
        sys.exit("torchrun run did not reach the hang:\n" + "\n".join(l for _, _, l in lines[-40:]))
    after = [l for t, _, l in lines if t > a]
    restarted = first(lines, r"(?i)restart|FAILED", after=a) is not None
    return {"hang line at": a, "lines after the hang": len(after), "restart seen": restarted,
            "ended by us after": end - a, "rc": rc, "processes seen": n}


def summary(rows):
    for k in rows[0]:
        v = [r[k] for r in rows]
        print(f"  {k:40s} median {statistics.median(v):6.2f} s  range {min(v):.2f}-{max(v):.2f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--torchrun-wait", type=float, default=60.0)
    ap.add_argument("--only", choices=["muster", "torchrun"])
    args = ap.parse_args()
    if args.only != "torchrun":
        rows = []
        for i in range(args.reps):
            tmp = tempfile.mkdtemp(prefix="hang-bench-")
            try:
                rows.append(muster_once(tmp))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            print(f"muster rep {i + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in rows[-1].items()),
                  flush=True)
        print(f"muster launch --hang_timeout=2, {args.reps} reps:")
        summary(rows)
    if args.only != "muster" and os.path.exists(TORCHRUN):
        tmp = tempfile.mkdtemp(prefix="hang-bench-")
        try:
            r = torchrun_once(tmp, args.torchrun_wait)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"torchrun (1.13), once: hang line at {r['hang line at']:.2f} s; "
              f"{r['lines after the hang']} output lines in the {args.torchrun_wait:.0f} s after it; "
              f"restart seen: {r['restart seen']}; ended by pid {r['ended by us after']:.2f} s after "
              f"the hang (rc {r['rc']}); {r['processes seen']} processes seen, none left", flush=True)


if __name__ == "__main__":
    main()
