#!/usr/bin/python3
"""launch --preflight on namespace hosts (issue 42; bench/README.md, "Stragglers"): what it adds
to the first rendezvous, false names in uncapped runs, and a capped link named.

Four hosts (tests/support/hostnet): rdzvd on host 0, one agent on each of hosts 1-3
(--nnodes=2:3 --nproc_per_node=1, the worker tests/test_worker `env`: it exits at once), every
agent host's link capped by tbf at --kbit (both directions), host 3's at a fifth of it for the
capped runs. Each run: from starting the three launches to the last one's exit.

  bench/preflight.sh [--uncapped N] [--capped N] [--kbit K]
  bench/preflight.sh --running [--trials N] [--seconds S]
      the straggler watch's slow links while a job runs: three launches of
      examples/python/ddp_in_place.py --hidden 1024 --step-sleep-ms 30 (gloo,
      --watch_stragglers) on hosts 1-3;
      capped as above: seconds and rank 0's steps from its first step to rdzvd's
      straggler_named event; uncapped (all at --kbit): names in S seconds (should be none)
"""
import argparse
import json
import re
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("BUILD", os.path.join(ROOT, "build"))
LAUNCH = os.path.join(BUILD, "launcher/launch")
RDZVD = os.path.join(BUILD, "rendezvous/rdzvd")
WORKER = os.path.join(BUILD, "tests/test_worker")
HOSTNET = os.path.join(BUILD, "tests/hostnet")


def wrap(i):
    return os.environ["HOSTNET_WRAP_%d" % i].split()


def one(endpoint, id, preflight):
    with tempfile.TemporaryDirectory() as d:
        flags = ["--nnodes=2:3", "--nproc_per_node=1", "--rdzv_backend=c10d",
                 "--rdzv_endpoint=" + endpoint, "--rdzv_id=" + id]
        if preflight:
            flags.append("--preflight")
        env = dict(os.environ, MUSTER_LOG_LEVEL="info")
        t0 = time.monotonic()
        ps = [subprocess.Popen(wrap(h) + [LAUNCH] + flags + [WORKER, "env", d], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for h in (1, 2, 3)]
        outs = [p.communicate(timeout=120) for p in ps]
        took = time.monotonic() - t0
        rcs = [p.returncode for p in ps]
        failed = [h for h, (_, err) in zip((1, 2, 3), outs) if "pre-flight failed" in err]
        links = [l.split("link ")[1].split(" MB/s")[0] for _, err in outs
                 for l in err.splitlines() if "this node's link" in l]
        return {"took_s": round(took, 3), "rcs": rcs, "named_hosts": failed,
                "links_mbps": links, "world": len([f for f in os.listdir(d) if f.startswith("env.")])}


def inner(a):
    ctl = os.environ["HOSTNET_CTL"]
    rd = subprocess.Popen(wrap(0) + [RDZVD, "--listen", "0.0.0.0:0"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    port = None
    while port is None:
        line = rd.stdout.readline()
        if "listening on port" in line:
            port = line.split("listening on port ")[1].split()[0]
    endpoint = os.environ["HOSTNET_HOST_0"] + ":" + port
    try:
        for h in (1, 2, 3) if a.kbit > 0 else ():  # --kbit 0: no tbf at all (uncapped only)
            subprocess.run([ctl, "rate", os.environ["HOSTNET_NS_%d" % h], str(a.kbit)], check=True)
        rows = {"plain": [], "preflight": [], "capped": []}
        for i in range(a.uncapped):
            rows["plain"].append(one(endpoint, "plain%d" % i, False))
            rows["preflight"].append(one(endpoint, "pre%d" % i, True))
        if a.kbit > 0:
            subprocess.run([ctl, "rate", os.environ["HOSTNET_NS_3"], str(a.kbit // 5)], check=True)
        for i in range(a.capped if a.kbit > 0 else 0):
            rows["capped"].append(one(endpoint, "cap%d" % i, True))
    finally:
        rd.terminate()
        rd.wait()
    plain = [r["took_s"] for r in rows["plain"]]
    pre = [r["took_s"] for r in rows["preflight"]]
    cap = rows["capped"]
    print("RESULT " + json.dumps({
        "kbit": a.kbit, "uncapped_runs": a.uncapped,
        "plain_s_median": statistics.median(plain) if plain else None,
        "preflight_s_median": statistics.median(pre) if pre else None,
        "preflight_s_max": max(pre) if pre else None,
        "added_s_median": round(statistics.median(pre) - statistics.median(plain), 3) if pre else None,
        "false_names": sum(len(r["named_hosts"]) for r in rows["preflight"]),
        "uncapped_failed_runs": sum(1 for r in rows["preflight"] if any(rcs != 0 for rcs in r["rcs"])),
        "capped_runs": len(cap),
        "capped_named_host3": sum(1 for r in cap if r["named_hosts"] == [3]),
        "capped_world2": sum(1 for r in cap if r["world"] == 2),
        "capped_s": [r["took_s"] for r in cap],
        "uncapped_links_mbps": [r["links_mbps"] for r in rows["preflight"][:3]],
        "sample_links": rows["capped"][0]["links_mbps"] if cap else []}), flush=True)


DDP = os.path.join(ROOT, "examples", "python", "ddp_in_place.py")


def running_job(endpoint, id, rd_lines, seconds, want_name):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ps = [subprocess.Popen(wrap(h) + [LAUNCH, "--nnodes=3", "--nproc_per_node=1",
                                      "--rdzv_backend=c10d", "--rdzv_endpoint=" + endpoint,
                                      "--rdzv_id=" + id, "--watch_stragglers", DDP, "--steps",
                                      "1000000", "--hidden", "1024", "--step-sleep-ms", "30",
                                      "--log-every", "1"],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
          for h in (1, 2, 3)]
    steps = []  # (time, step) of rank 0
    import threading

    def read(p):
        for line in p.stdout:
            m = re.search(r"step (\d+): loss", line)
            if m:
                steps.append((time.monotonic(), int(m.group(1))))
    ts = [threading.Thread(target=read, args=(p,), daemon=True) for p in ps]
    for t in ts:
        t.start()
    start = len(rd_lines)
    t_end = time.monotonic() + seconds
    named = None
    while time.monotonic() < t_end and named is None:
        for t, l in list(rd_lines[start:]):
            if '"event":"straggler_named"' in l and ('"run":"%s"' % id) in l:
                named = (t, json.loads(l[l.index("{"):]))
                break
        if want_name is False and named is not None:
            break
        time.sleep(0.05)
    for p in ps:
        p.terminate()
    for p in ps:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    first = steps[0] if steps else None
    out = {"steps_seen": len(steps)}
    if named is not None:
        t, e = named
        before = [s for ts_, s in steps if ts_ <= t]
        out.update({"host": e.get("host"), "cause": e.get("cause"), "slowdown": e.get("slowdown"),
                    "seconds_from_first_step": round(t - first[0], 2) if first else None,
                    "steps_from_first_step": (before[-1] - first[1]) if first and before else None})
    else:
        out["named"] = None
    if steps:
        out["steps_per_s"] = round((steps[-1][1] - steps[0][1]) / max(steps[-1][0] - steps[0][0], 1e-9), 2)
    return out


def running(a):
    import threading
    ctl = os.environ["HOSTNET_CTL"]
    rd = subprocess.Popen(wrap(0) + [RDZVD, "--listen", "0.0.0.0:0", "--event_log", "-"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    port = None
    while port is None:
        line = rd.stdout.readline()
        if "listening on port" in line:
            port = line.split("listening on port ")[1].split()[0]

    def read():
        for line in rd.stdout:
            lines.append((time.monotonic(), line))
    threading.Thread(target=read, daemon=True).start()
    endpoint = os.environ["HOSTNET_HOST_0"] + ":" + port
    try:
        for h in (1, 2, 3):
            subprocess.run([ctl, "rate", os.environ["HOSTNET_NS_%d" % h], str(a.kbit)], check=True)
        for i in range(a.trials):
            r = running_job(endpoint, "even%d" % i, lines, a.seconds, False)
            print("RESULT " + json.dumps(dict(r, row="running_uncapped", seconds=a.seconds)), flush=True)
        subprocess.run([ctl, "rate", os.environ["HOSTNET_NS_3"], str(a.kbit // 5)], check=True)
        for i in range(a.trials):
            r = running_job(endpoint, "capped%d" % i, lines, 120, True)
            print("RESULT " + json.dumps(dict(r, row="running_capped")), flush=True)
    finally:
        rd.terminate()
        rd.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--inner", action="store_true")
    ap.add_argument("--uncapped", type=int, default=50)
    ap.add_argument("--capped", type=int, default=10)
    ap.add_argument("--kbit", type=int, default=400000)
    ap.add_argument("--running", action="store_true")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=60)
    a = ap.parse_args()
    if a.inner:
        return running(a) if a.running else inner(a)
    extra = ["--running", "--trials", str(a.trials), "--seconds", str(a.seconds)] if a.running else []
    return subprocess.call([HOSTNET, "run", "4", "--", sys.executable, os.path.abspath(__file__),
                            "--inner", "--uncapped", str(a.uncapped), "--capped", str(a.capped),
                            "--kbit", str(a.kbit)] + extra)


if __name__ == "__main__":
    sys.exit(main())
