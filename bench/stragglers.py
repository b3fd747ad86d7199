#!/usr/bin/python3
"""The straggler watch (issue 42; bench/README.md, "Stragglers"): what it costs and how soon it
names a slow rank. examples/python/ddp_in_place.py (Debian's python3-torch, gloo), --step-sleep-ms
20, unmodified (launch's automatic progress reports).

  overhead  muster_progress.step() per call (the reports' writer, with the time per phase kind),
            against a step; and the same standalone 3-worker job with and without
            --watch_stragglers, alternating, steps per second
  named     three launches on one rdzvd; rank 2 stopped (SIGSTOP/SIGCONT) STOP ms of every
            100 ms from outside: seconds and steps from the first stop to rdzvd's
            straggler_named event (50 ms: 2x its own work; 33 ms: 1.5x)
  noise     the same job with a random rank paused 300 ms every ~2.5 s: names (should be none)
  exclude   --exclude_stragglers, --nnodes=2:3: rank 2 under a 50/100 ms duty cycle; from its
            naming to its node's exclusion, and to the first 3 s in which rank 0 steps at 90% or
            more of a healthy two-node job's rate (measured alongside, the same way)

  bench/stragglers.sh [--only overhead,named,noise,exclude] [--trials N] [--noise-seconds S]
"""
import argparse
import json
import mmap
import os
import random
import re
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hostproc import wait_until as wait_for  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("BUILD", os.path.join(ROOT, "build"))
LAUNCH = os.path.join(BUILD, "launcher/launch")
RDZVD = os.path.join(BUILD, "rendezvous/rdzvd")
SCRIPT = os.path.join(ROOT, "examples", "python", "ddp_in_place.py")
PID = re.compile(r"rank (\d+): pid (\d+) in place, round 1")
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def reader(p, lines):
    def read():
        for raw in iter(p.stdout.readline, b""):
            lines.append((time.monotonic(), raw.decode(errors="replace").rstrip()))
    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t


def end(p):
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def page_step(pid):
    """The step on worker `pid`'s progress page (offset 16), from MUSTER_PROGRESS_FILE."""
    with open("/proc/%d/environ" % pid, "rb") as f:
        env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
    with open(env[b"MUSTER_PROGRESS_FILE"], "rb") as f:
        return struct.unpack_from("<Q", f.read(24), 16)[0]


class Job:
    """rdzvd (event log on stderr) and three launches of one worker each, run `id`."""

    def __init__(self, id, nodes=3, nnodes="3", flags=("--watch_stragglers",), log_every=1000000):
        self.rdzvd = subprocess.Popen([RDZVD, "--listen", "127.0.0.1:0", "--event_log", "-"],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        self.events = []
        reader(self.rdzvd, self.events)
        port = wait_for(lambda: next((re.search(r"listening on port (\d+)", l).group(1)
                                      for _, l in self.events
                                      if "listening on port" in l), None), 30)
        self.agents, self.lines = [], []
        for _ in range(nodes):
            p = subprocess.Popen([LAUNCH, "--nnodes=" + nnodes, "--nproc_per_node=1",
                                  "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:" + port,
                                  "--rdzv_id=" + id, "--in_place"] + list(flags) + [SCRIPT,
                                  "--steps", "1000000", "--step-sleep-ms", "20",
                                  "--log-every", str(log_every)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV,
                                 start_new_session=True)
            self.agents.append(p)
            reader(p, self.lines)
        found = wait_for(lambda: len(self.pids()) == nodes and self.pids(), 180)
        if not found:
            self.close()
            raise RuntimeError("the job did not start")

    def pids(self):
        return {int(m.group(1)): int(m.group(2))
                for _, l in list(self.lines) for m in [PID.search(l)] if m}

    def named(self, event="straggler_named"):
        out = []
        for t, l in list(self.events):
            if '"event":"%s"' % event in l:
                out.append((t, json.loads(l[l.index("{"):])))
        return out

    def steps(self):
        """Rank 0's logged steps: (when read, step)."""
        return [(t, int(m.group(1))) for t, l in list(self.lines)
                for m in [re.search(r"step (\d+): loss", l)] if m]

    def close(self):
        for p in self.agents:
            end(p)
        end(self.rdzvd)


def overhead(a):
    with tempfile.TemporaryDirectory() as tmp:
        page = os.path.join(tmp, "progress")
        with open(page, "wb") as f:
            f.write(struct.pack("<II", 0x3150504D, 1) + b"\0" * 4088)
        code = ("import sys, time; sys.path.insert(0, %r); import muster_progress as p\n"
                "n = 200000; t = time.perf_counter()\n"
                "for i in range(n): p.step(i, ('forward', 'backward', 'optimizer', 'between_steps')[i %% 4])\n"
                "print((time.perf_counter() - t) / n * 1e9)" % os.path.join(ROOT, "python"))
        ns = [float(subprocess.run(["/usr/bin/python3", "-c", code], capture_output=True, text=True,
                                   env=dict(ENV, MUSTER_PROGRESS_FILE=page)).stdout)
              for _ in range(3)]
    call = statistics.median(ns)
    print("RESULT " + json.dumps({"row": "overhead_call", "ns_per_report": round(call),
                                  "reports_per_step": 4,
                                  "share_of_20ms_step": 4 * call / 20e6}), flush=True)
    rates = {"off": [], "on": []}
    for t in range(a.trials):
        for way in ("off", "on"):
            argv = [LAUNCH, "--standalone", "--nproc_per_node=3", SCRIPT, "--steps", "600",
                    "--step-sleep-ms", "20", "--log-every", "100"]
            if way == "on":
                argv.insert(3, "--watch_stragglers")
            lines = []
            p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=ENV,
                                 start_new_session=True)
            r = reader(p, lines)
            p.wait()
            r.join()
            steps = [(t, int(m.group(1))) for t, l in lines
                     for m in [re.search(r"step (\d+): loss", l)] if m]
            (t0, s0), (t1, s1) = steps[1], steps[-1]  # from step 100: past start-up
            rates[way].append((s1 - s0) / (t1 - t0))
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    print("RESULT " + json.dumps({"row": "overhead_job", "steps_per_s_off": round(off, 2),
                                  "steps_per_s_on": round(on, 2), "ratio": round(on / off, 4),
                                  "trials": rates}), flush=True)


def named(a, stop_ms):
    job = Job("slow%d" % stop_ms)
    try:
        time.sleep(3)  # past start-up: steps at their pace
        pid = job.pids()[2]
        onset_step = page_step(pid)
        done = threading.Event()

        def duty():
            while not done.is_set():
                os.kill(pid, signal.SIGSTOP)
                time.sleep(stop_ms / 1000)
                os.kill(pid, signal.SIGCONT)
                time.sleep((100 - stop_ms) / 1000)
            os.kill(pid, signal.SIGCONT)
        t0 = time.monotonic()
        th = threading.Thread(target=duty)
        th.start()
        got = wait_for(job.named, 90)
        done.set()
        th.join()
        if not got:
            return {"row": "named", "stop_ms": stop_ms, "named": None}
        t, e = got[0]
        return {"row": "named", "stop_ms": stop_ms, "rank": e["rank"], "cause": e["cause"],
                "slowdown": round(e["slowdown"], 2), "seconds": round(t - t0, 2),
                "steps": e["step"] - onset_step}
    finally:
        job.close()


def noise(a):
    job = Job("noisy")
    try:
        time.sleep(3)
        pids = list(job.pids().values())
        first = page_step(pids[0])
        rng = random.Random(7)
        t_end = time.monotonic() + a.noise_seconds
        pauses = 0
        while time.monotonic() < t_end:
            p = rng.choice(pids)
            os.kill(p, signal.SIGSTOP)
            time.sleep(0.3)
            os.kill(p, signal.SIGCONT)
            pauses += 1
            time.sleep(rng.uniform(1.5, 3.5))
        return {"row": "noise", "seconds": a.noise_seconds, "pauses": pauses,
                "steps": page_step(pids[0]) - first, "named": [e for _, e in job.named()]}
    finally:
        job.close()


def rate(steps, t0, t1):
    """Steps per second between t0 and t1 from (time, step) samples."""
    inside = [(t, s) for t, s in steps if t0 <= t <= t1]
    if len(inside) < 2:
        return 0.0
    (ta, sa), (tb, sb) = inside[0], inside[-1]
    return (sb - sa) / (tb - ta) if tb > ta else 0.0


def exclude(a):
    healthy = Job("healthy2", nodes=2, nnodes="2", log_every=10)
    try:
        time.sleep(5)
        t = time.monotonic()
        time.sleep(20)
        ref = rate(healthy.steps(), t, time.monotonic())
    finally:
        healthy.close()
    job = Job("exclude", nnodes="2:3", log_every=10,
              flags=("--exclude_stragglers", "--straggler_cooldown=600"))
    try:
        time.sleep(3)
        pid = job.pids()[2]
        t_before = time.monotonic()
        time.sleep(5)
        before = rate(job.steps(), t_before, time.monotonic())
        done = threading.Event()

        def duty():
            while not done.is_set():
                try:
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(0.05)
                    os.kill(pid, signal.SIGCONT)
                    time.sleep(0.05)
                except ProcessLookupError:
                    return  # its node was excluded: the worker is gone
        t0 = time.monotonic()
        th = threading.Thread(target=duty)
        th.start()
        got = wait_for(lambda: job.named("straggler_excluded"), 90)
        done.set()
        th.join()
        if not got:
            return {"row": "exclude", "excluded": None, "named": [e for _, e in job.named()]}
        tx, ex = got[0]
        tn = job.named()[0][0]
        time.sleep(30)
        steps = job.steps()
        slowed = rate(steps, t0, tx)
        back = None
        t = tx
        while t + 3 <= time.monotonic():
            if rate(steps, t, t + 3) >= 0.9 * ref:
                back = t
                break
            t += 0.25
        after = rate(steps, tx + 10, tx + 30)
        return {"row": "exclude", "healthy2_steps_per_s": round(ref, 2),
                "three_steps_per_s": round(before, 2), "slowed_steps_per_s": round(slowed, 2),
                "slowdown": round(ex["slowdown"], 2), "named_s": round(tn - t0, 2),
                "excluded_after_named_s": round(tx - tn, 2),
                "back_to_90pct_after_named_s": None if back is None else round(back + 3 - tn, 2),
                "after_steps_per_s": round(after, 2), "after_ratio": round(after / ref, 3)}
    finally:
        job.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="overhead,named,noise,exclude")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--noise-seconds", type=float, default=120)
    ap.add_argument("--stop-ms", type=int, nargs="+", default=[50, 33],
                    help="named: the duty cycles to run (ms stopped of every 100)")
    a = ap.parse_args()
    only = a.only.split(",")
    if "overhead" in only:
        overhead(a)
    if "named" in only:
        for stop_ms in a.stop_ms:
            for _ in range(a.trials):
                print("RESULT " + json.dumps(named(a, stop_ms)), flush=True)
    if "noise" in only:
        print("RESULT " + json.dumps(noise(a)), flush=True)
    if "exclude" in only:
        for _ in range(a.trials):
            print("RESULT " + json.dumps(exclude(a)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
