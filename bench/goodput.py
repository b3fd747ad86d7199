#!/usr/bin/python3
"""What a worker crash costs a PyTorch DDP job (issue 41; bench/README.md, "Goodput under
failures"): a 4-worker standalone job, examples/python/ddp_in_place.py with --step-sleep-ms 30
(Debian's python3-torch, gloo), one random worker killed -9 every 10 s; progress is the step
the job stands at when the minute ends (the step rank 0 last completed, after a full restart's
rollback to its checkpoint), against the same job without kills, each started at its first
step. Side by side, one after another on this machine:

  none       launch --in_place, no kill (the reference)
  spares     launch --in_place --spares=1 (a warm spare takes the dead rank's place)
  in_place   launch --in_place (the dead rank's replacement is a new process)
  full       launch (every worker restarted, from the checkpoint every 50 steps)
  torchrun   ../shared/peer/torchrun311 --monitor_interval=0.1 (the same, as torchrun does it)

After the minute every rank ends 100 steps on (the example's --stop-file) and prints its
parameters' digest: `params_agree` says whether all agree. `lost_s`: each failure's cost
within its run (rank 0's steps in the half-period after the kill against its rate in the
half-period before), free of the machine's noise between runs.

  bench/goodput.sh [--trials N] [--only spares,in_place,...] [--seconds S] [--every S]
"""
import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("BUILD", os.path.join(ROOT, "build"))
# LAUNCH, PYTHON, TORCHRUN: another launch, interpreter and torchrun (bench/goodput_torch2.sh
# runs this in a Debian root with torch 2.x: the wheel's muster-launch, the root's python3 and
# the torchrun of that torch).
LAUNCH = os.environ.get("LAUNCH", os.path.join(BUILD, "launcher/launch"))
PYTHON = os.environ.get("PYTHON", "/usr/bin/python3")
TORCHRUN = os.environ.get("TORCHRUN", os.path.join(ROOT, "..", "shared", "peer", "torchrun311"))
SCRIPT = os.path.join(ROOT, "examples", "python", "ddp_in_place.py")
STEP = re.compile(r"(?:^|\]:)step (\d+): loss")
FINAL = re.compile(r"final loss \S+ steps (\d+) params (\S+)")
PID = re.compile(r"pid (\d+) (?:in place|re-formed in place)")
WAYS = ["none", "none_spares", "spares", "in_place", "full", "torchrun"]


def children(pid):
    """The pids whose parent is `pid`."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(name))
        except (OSError, IndexError, ValueError):
            pass
    return out


def is_worker(pid, ranked):
    """A training worker with a rank (not a spare, not torchrun's own helpers). A spare that
    took a rank still shows its first environment in /proc: it is known by its own line
    ("pid P in place"), kept in `ranked`."""
    if pid in ranked:
        return True
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            if b"ddp_in_place.py" not in f.read():
                return False
        with open("/proc/%d/environ" % pid, "rb") as f:
            env = f.read().split(b"\0")
        return b"MUSTER_SPARE=1" not in env and any(e.startswith(b"RANK=") for e in env)
    except OSError:
        return False


def workers_of(agent, ranked):
    found, todo = [], [agent]
    while todo:
        for c in children(todo.pop()):
            if is_worker(c, ranked):
                found.append(c)
            else:
                todo.append(c)
    return found


def lost_per_failure(steps, kill_times, window, end):
    """Seconds of progress each failure cost, measured within the run: rank 0's step rate in
    the `window` seconds before the kill against the steps it made in the window after it
    (so the run-to-run noise of this machine's rate does not enter). A kill whose window after
    goes past the measured `end` is not counted."""
    lost = []
    for k in kill_times:
        if k + window > end:
            continue
        before = sum(1 for t, _ in steps if k - window <= t < k)
        after = sum(1 for t, _ in steps if k <= t < k + window)
        if before:
            lost.append(round(window * (1.0 - after / before), 2))
    return lost


def next_step_ms(steps, kill_times, window):
    """Per kill: milliseconds from the kill to the end of the longest pause between two of rank
    0's steps that ends within `window` seconds after it: when the job steps again. (The first
    step line after a kill may be a step the dead rank had already done its part of.)"""
    out = []
    times = [t for t, _ in steps]
    for k in kill_times:
        gaps = [(times[i] - times[i - 1], times[i]) for i in range(1, len(times))
                if k < times[i] <= k + window]
        if gaps:
            out.append(round((max(gaps)[1] - k) * 1000))
    return out


def write_stop(stop_file, last_step):
    """Every rank ends 100 steps after the last step seen (the example's --stop-file)."""
    with open(stop_file + ".tmp", "w") as f:
        f.write(str(last_step + 100))
    os.replace(stop_file + ".tmp", stop_file)


def end_and_check(p, reader, finals, stop_file, last_step, timeout=120):
    """The job ends (write_stop) and every rank says its parameters' digest: whether they
    agree, and how many said it."""
    write_stop(stop_file, last_step)
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        return {"ended": False}
    reader.join(30)  # the last lines read
    return {"ended": p.returncode == 0, "finals": len(finals),
            "params_agree": len(set(finals)) == 1 and len(finals) > 0}


def run(way, a, tmp):
    ck = os.path.join(tmp, "ck.pt")
    stop_file = os.path.join(tmp, "stop")
    for f in (ck, stop_file):
        if os.path.exists(f):
            os.remove(f)
    script = [SCRIPT, "--steps", "1000000", "--log-every", "1", "--step-sleep-ms", str(a.step_ms),
              "--checkpoint", ck, "--checkpoint-every", "50", "--stop-file", stop_file]
    if way == "torchrun":
        argv = [TORCHRUN, "--standalone", "--nproc_per_node=4", "--monitor_interval=0.1",
                "--max_restarts=100"] + script
    else:
        flags = ["--standalone", "--nproc_per_node=4", "--max_restarts=100"]
        if way in ("none", "none_spares", "spares", "in_place"):
            flags.append("--in_place")
        if way in ("spares", "none_spares"):
            flags.append("--spares=1")
        argv = [LAUNCH] + flags + [PYTHON] + script
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    err = subprocess.DEVNULL
    if a.logs:
        os.makedirs(a.logs, exist_ok=True)
        err = open(os.path.join(a.logs, "%s.err" % way), "w")
        env["MUSTER_LOG_LEVEL"] = "info"
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, env=env,
                         start_new_session=True)
    steps = []  # (monotonic, step)
    finals = []  # each rank's digest at the end
    ranked = set()
    first = threading.Event()

    def read():
        for line in p.stdout:
            text = line.decode(errors="replace")
            pid = PID.search(text)
            if pid:
                ranked.add(int(pid.group(1)))
            m = STEP.search(text)
            if m:
                steps.append((time.monotonic(), int(m.group(1))))
                first.set()
            f = FINAL.search(text)
            if f:
                finals.append(f.group(2))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    kills = 0
    kill_times = []
    try:
        if not first.wait(120):
            raise RuntimeError("%s: no first step within 120 s" % way)
        t0 = steps[0][0]
        rng = random.Random(a.seed)
        next_kill = t0 + a.every
        while time.monotonic() < t0 + a.seconds:
            time.sleep(0.05)
            if not way.startswith("none") and time.monotonic() >= next_kill and next_kill < t0 + a.seconds:
                ws = workers_of(p.pid, ranked)
                if ws:
                    os.kill(rng.choice(sorted(ws)), signal.SIGKILL)
                    kills += 1
                    kill_times.append(time.monotonic())
                next_kill += a.every
        end = t0 + a.seconds
        done = [(t, s) for t, s in steps if t <= end]
        # The pauses of rank 0's steps longer than 0.2 s: what each failure stalled the job.
        stalls = [round(done[i][0] - done[i - 1][0], 2) for i in range(1, len(done))
                  if done[i][0] - done[i - 1][0] > 0.2]
        res = {"way": way, "step": done[-1][1] if done else 0, "kills": kills, "stalls": stalls,
               "lost_s": lost_per_failure(steps, kill_times, a.every / 2, end),
               "next_step_ms": next_step_ms(steps, kill_times, a.every / 2)}
        res.update(end_and_check(p, reader, finals, stop_file, max(s for _, s in steps)))
        return res
    finally:
        if p.poll() is None:  # it did not end by itself (an error above)
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--only", default=",".join(WAYS))
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--every", type=float, default=10)
    ap.add_argument("--step_ms", type=float, default=30)
    ap.add_argument("--seed", type=int, default=41)
    ap.add_argument("--logs", default="", help="a folder: each run's stderr (launch at info level)")
    a = ap.parse_args()
    ways = [w for w in a.only.split(",") if w]
    if "none" not in ways:
        ways.insert(0, "none")
    results = {w: [] for w in ways}
    with tempfile.TemporaryDirectory() as tmp:
        for t in range(a.trials):
            for w in ways:
                r = run(w, a, tmp)
                results[w].append(r)
                print(json.dumps(dict(r, trial=t)), flush=True)
    ref = statistics.median(r["step"] for r in results["none"])
    print("\n%-10s %8s %8s %10s %14s %16s %-12s %s" % ("way", "step", "kills", "progress", "lost/failure",
                                                    "lost (in run)", "params agree",
                                                    "kill -> next step"))
    for w in ways:
        step = statistics.median(r["step"] for r in results[w])
        kills = statistics.median(r["kills"] for r in results[w])
        per = ""
        if kills:
            # seconds of progress lost per failure, at the reference's step rate
            rate = ref / a.seconds
            per = "%.2f s" % ((ref - step) / rate / kills)
        own = ""
        if w == "spares" and results.get("none_spares"):  # against the same job unkilled
            own = "  (%.1f%% of none_spares)" % (
                100.0 * step / statistics.median(r["step"] for r in results["none_spares"]))
        inrun = [x for r in results[w] for x in r.get("lost_s", [])]
        inrun = "%.2f s" % statistics.median(inrun) if inrun else ""
        agree = "%d of %d" % (sum(1 for r in results[w] if r.get("params_agree")), len(results[w]))
        nxt = sorted(x for r in results[w] for x in r.get("next_step_ms", []))
        nxt = "%d ms (%d-%d)" % (statistics.median(nxt), nxt[0], nxt[-1]) if nxt else ""
        print("%-10s %8d %8d %9.1f%% %14s %16s %-12s %s%s" % (w, step, kills, 100.0 * step / ref, per,
                                                          inrun, agree, nxt, own))


if __name__ == "__main__":
    main()
