#!/usr/bin/python3
"""launch --preflight on namespace hosts (issue 42; bench/README.md, "Stragglers"): what it adds
to the first rendezvous, false names in uncapped runs, and a capped link named.

Four hosts (tests/support/hostnet): rdzvd on host 0, one agent on each of hosts 1-3
(--nnodes=2:3 --nproc_per_node=1, the worker tests/test_worker `env`: it exits at once), every
agent host's link capped by tbf at --kbit (both directions), host 3's at a fifth of it for the
capped runs. Each run: from starting the three launches to the last one's exit.

  bench/preflight.sh [--uncapped N] [--capped N] [--kbit K]
"""
import argparse
import json
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--inner", action="store_true")
    ap.add_argument("--uncapped", type=int, default=50)
    ap.add_argument("--capped", type=int, default=10)
    ap.add_argument("--kbit", type=int, default=400000)
    a = ap.parse_args()
    if a.inner:
        return inner(a)
    return subprocess.call([HOSTNET, "run", "4", "--", sys.executable, os.path.abspath(__file__),
                            "--inner", "--uncapped", str(a.uncapped), "--capped", str(a.capped),
                            "--kbit", str(a.kbit)])


if __name__ == "__main__":
    sys.exit(main())
