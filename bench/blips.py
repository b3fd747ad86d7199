#!/usr/bin/python3
"""Blips shorter than the liveness window (issue 25, item 4): two namespace hosts, each one agent
of a two-node job (`test_worker wait`: one worker each, started once), the run hosted by host 0's
agent. Host 1's link is cut silently (iptables DROP: no FIN, no RST) for a fraction of the window,
at a random phase of the keep-alive interval, then healed. A trial survives when, up to two
windows after the heal, no agent restarted or stopped a worker ("restarting workers", "lost the
server") and both workers of the first round still run.

  bench/blips.sh [--trials N] [--fractions 0.5,0.7,0.9] [--conf INTERVAL,ATTEMPTS]
                 [--launch PATH ...]      several --launch: side by side, one row each

Each trial runs in fresh hosts (`hostnet run 2 -- blips.py --inner ...`). Every time is
CLOCK_MONOTONIC, which all namespaces share; a line's time is when this driver read it.
Diagnostics: BLIPS_VERBOSE=1 prints every line after the cut, BLIPS_SS=1 the hosts' sockets,
iptables rules and neighbour tables after the heal, BLIPS_BY_ADDR=1 names the server by address.
"""
import argparse
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hostproc import Proc, wait_until  # noqa: E402

BUILD = os.environ.get("BUILD", "/work/build-bench")
HOSTNET = os.path.join(BUILD, "tests/hostnet")
WORKER = os.path.join(BUILD, "tests/test_worker")
PORT = 29400


def inner(launch, fraction, interval, attempts, seed):
    random.seed(seed)
    window = interval * attempts
    ctl = os.environ["HOSTNET_CTL"]
    # BLIPS_BY_ADDR=1: the endpoint by address, not by name (no resolver in the way).
    host = "HOSTNET_ADDR_0" if os.environ.get("BLIPS_BY_ADDR") else "HOSTNET_HOST_0"
    ep = f"{os.environ[host]}:{PORT}"
    conf = f"keep_alive_interval={interval},keep_alive_max_attempt={attempts}"
    procs = []
    for i in range(2):
        argv = os.environ[f"HOSTNET_WRAP_{i}"].split() + [
            launch, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
            f"--rdzv_endpoint={ep}", "--rdzv_id=blip", f"--rdzv_conf={conf}", WORKER, "wait"]
        procs.append(Proc(f"host{i}", argv))
    result = "no round"
    try:
        if not wait_until(lambda: all(p.count(r"\]:ready ") == 1 for p in procs), 60):
            return result
        time.sleep(1.0 + random.uniform(0, interval))  # a random phase of the keep-alives
        t_cut = time.monotonic()
        subprocess.run([ctl, "cut", os.environ["HOSTNET_NS_1"]], check=True)
        time.sleep(max(0.0, t_cut + fraction * window - time.monotonic()))
        t_heal = time.monotonic()
        subprocess.run([ctl, "heal", os.environ["HOSTNET_NS_1"]], check=True)
        if os.environ.get("BLIPS_SS"):
            for k in range(6):
                time.sleep(0.1)
                out = []
                for cmd in (["ip", "netns", "exec", os.environ["HOSTNET_NS_1"], "ss", "-tn"],
                            ["ip", "netns", "exec", os.environ["HOSTNET_NS_0"], "ss", "-tn"],
                            ["ip", "netns", "exec", os.environ["HOSTNET_NS_1"], "iptables", "-S"],
                            ["ip", "netns", "exec", os.environ["HOSTNET_NS_1"], "ip", "neigh"],
                            ["ip", "netns", "exec", os.environ["HOSTNET_NS_0"], "ip", "neigh"]):
                    r = subprocess.run(cmd, capture_output=True, text=True)
                    out.append(" ".join(cmd[3:]) + ":\n" + r.stdout + r.stderr)
                print(f"ss at {time.monotonic() - t_cut:+.3f}:\n" + "".join(out), flush=True)
        time.sleep(2 * window)
        bad = sum(p.count(r"restarting workers|lost the server|\]:ready ", t_cut) for p in procs)
        back = procs[1].first(r"re-attached to run \S+ round \d+ at \S+ after (\d+) ms", t_cut)
        alive = all(p.p.poll() is None for p in procs)
        result = "survived" if bad == 0 and alive else "restarted"
        if back:
            result += f" reattached {back[0] - t_heal:+.3f}s_from_heal"
        print(f"blip {fraction * window:.2f}s ({fraction:.0%} of {window:g} s): {result}",
              flush=True)
        if os.environ.get("BLIPS_VERBOSE"):
            for i, p in enumerate(procs):
                with p.lock:
                    for t, text in p.lines:
                        if t >= t_cut - 0.1:
                            print(f"    host{i} {t - t_cut:+.3f} {text}", flush=True)
    finally:
        for p in procs:
            p.stop()
    return result


def outer(a):
    fractions = [float(x) for x in a.fractions.split(",")]
    interval, attempts = (float(x) for x in a.conf.split(","))
    launches = a.launch or [os.path.join(BUILD, "launcher/launch")]
    rows = []
    for launch in launches:
        for f in fractions:
            survived = 0
            for t in range(a.trials):
                r = subprocess.run([HOSTNET, "run", "2", "--", sys.executable, __file__, "--inner",
                                    launch, str(f), str(interval), str(int(attempts)),
                                    str(a.seed + t)], capture_output=True, text=True,
                                   timeout=300)
                line = (r.stdout.strip().splitlines() or ["(no result)"])[-1]
                survived += "survived" in line
                print(f"  {launch} trial {t}: {line}", flush=True)
            rows.append((launch, f, survived, a.trials))
    print(f"\nwindow {interval:g} s x {int(attempts)}; blips cut at a random phase of the interval")
    print("| launch | blip (share of the window) | survived (no worker restarted) |")
    print("|---|---|---|")
    for launch, f, s, n in rows:
        print(f"| {launch} | {f * interval * attempts:.2f} s ({f:.0%}) | {s}/{n} |")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--inner":
        launch, f, interval, attempts, seed = sys.argv[2:7]
        inner(launch, float(f), float(interval), int(attempts), int(seed))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--fractions", default="0.5,0.7,0.9")
    ap.add_argument("--conf", default="0.5,4", help="keep_alive_interval,keep_alive_max_attempt")
    ap.add_argument("--launch", action="append")
    ap.add_argument("--seed", type=int, default=20261202)
    outer(ap.parse_args())


if __name__ == "__main__":
    main()
