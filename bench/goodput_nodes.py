#!/usr/bin/python3
"""What a node loss costs a PyTorch DDP job when the node comes back (issue 41; bench/README.md,
"Goodput under failures"). Four namespace hosts (tests/support/hostnet): rdzvd on host 0, one
agent on each of hosts 1-3 (`--nnodes=2:3 --nproc_per_node=1`) running
examples/python/ddp_in_place.py (--step-sleep-ms 30, a checkpoint every 50 steps into a folder
every host sees). Every 15 s host 2's agent and everything in its session are killed -9 and a
new agent is started on host 2 at once (the node coming back, a newcomer within MIN:MAX).
Progress is the step rank 0 stands at when the minute ends (counted from the first step),
against the same job without kills. Side by side, one after another:

  none       launch --in_place, no kill (the reference)
  spares     launch --in_place --spares=1 (the node comes back warm: it joins once its worker
             waits in await_rank)
  in_place   launch --in_place (the survivors wait for the newcomer's interpreter)
  full       launch (every worker restarted, from the checkpoint)
  torchrun   ../shared/peer/torchrun311 (c10d hosted by host 1's agent, --monitor_interval=0.1)

The end is checked and each failure's cost measured within its run as in bench/goodput.py
(`params_agree`, `lost_s`).

  bench/goodput_nodes.sh [--trials N] [--only spares,in_place,full,torchrun] [--seconds S]
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from goodput import lost_per_failure, write_stop  # noqa: E402
from hostproc import BUILD, ROOT, TORCHRUN, Proc, wait_until, wrap  # noqa: E402

HOSTNET = os.path.join(BUILD, "tests/hostnet")
LAUNCH = os.path.join(BUILD, "launcher/launch")
RDZVD = os.path.join(BUILD, "rendezvous/rdzvd")
SCRIPT = os.path.join(ROOT, "examples", "python", "ddp_in_place.py")
STEP = r"(?:^|\]:)step (\d+): loss"
FINAL = r"final loss \S+ steps (\d+) params (\S+)"
WAYS = ["none", "none_spares", "spares", "in_place", "full", "torchrun"]


def agent(a, way, host, tmp, n):
    script = [SCRIPT, "--steps", "1000000", "--log-every", "1", "--checkpoint",
              os.path.join(tmp, "ck.pt"), "--checkpoint-every", "50", "--step-sleep-ms",
              str(a.step_ms), "--stop-file", os.path.join(tmp, "stop")]
    if way == "torchrun":
        endpoint = f"{os.environ['HOSTNET_HOST_1']}:29500"
        argv = wrap(host) + [TORCHRUN, "--nnodes=2:3", "--nproc_per_node=1", "--rdzv_backend=c10d",
                             f"--rdzv_endpoint={endpoint}", "--rdzv_id=job", "--max_restarts=100",
                             "--monitor_interval=0.1", "--rdzv_conf=last_call_timeout=2",
                             "--tee=3", *script]
    else:
        endpoint = f"{os.environ['HOSTNET_HOST_0']}:29400"
        argv = wrap(host) + [LAUNCH, "--nnodes=2:3", "--nproc_per_node=1", "--rdzv_backend=c10d",
                             f"--rdzv_endpoint={endpoint}", "--rdzv_id=job", "--max_restarts=100",
                             "--rdzv_conf=last_call_timeout=2"]
        if way in ("none", "none_spares", "spares", "in_place"):
            argv.append("--in_place")
        if way in ("spares", "none_spares"):
            argv.append("--spares=1")
        argv += ["/usr/bin/python3", *script]
    env = dict(os.environ, PYTHON_EXEC="/usr/bin/python3", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    return Proc(f"agent{host}.{n}", argv, env=env)


def inner(a):
    tmp = subprocess.run(["mktemp", "-d"], capture_output=True, text=True).stdout.strip()
    res = {"way": a.way}
    procs = []
    try:
        if a.way != "torchrun":
            rd = Proc("rdzvd", wrap(0) + [RDZVD, "--listen", "0.0.0.0:29400"])
            procs.append(rd)
            if not wait_until(lambda: rd.first("listening on port"), 30):
                raise RuntimeError("rdzvd did not start")
        order = (1, 3, 2) if a.way == "torchrun" else (1, 2, 3)
        agents = {}
        for h in order:
            agents[h] = agent(a, a.way, h, tmp, 0)
            procs.append(agents[h])
        everyone = lambda: [p for p in procs if p.name.startswith("agent")]  # noqa: E731
        first = wait_until(lambda: next((p.first(STEP) for p in everyone() if p.first(STEP)), None), 180)
        if not first:
            raise RuntimeError("no first step: " + " | ".join(t for p in everyone() for _, t in p.lines[-3:]))
        t0 = first[0]
        kills = 0
        kill_times = []
        next_kill = t0 + a.every
        while time.monotonic() < t0 + a.seconds:
            time.sleep(0.05)
            if not a.way.startswith("none") and time.monotonic() >= next_kill and next_kill < t0 + a.seconds:
                # The node dies (its agent and everything in its session) and comes back.
                os.killpg(agents[2].p.pid, signal.SIGKILL)
                agents[2].p.wait()
                kill_times.append(time.monotonic())
                kills += 1
                agents[2] = agent(a, a.way, 2, tmp, kills)
                procs.append(agents[2])
                next_kill += a.every
        end = t0 + a.seconds
        steps = sorted((t, int(m.group(1))) for p in everyone() for t, m in p.all(STEP) if t <= end)
        # rank 0 may move between hosts: the newest step line at the end
        res["step"] = steps[-1][1] if steps else 0
        res["kills"] = kills
        res["stalls"] = [round(steps[i][0] - steps[i - 1][0], 2) for i in range(1, len(steps))
                         if steps[i][0] - steps[i - 1][0] > 0.2]
        res["lost_s"] = lost_per_failure(steps, kill_times, a.every / 2, end)
        # Every rank ends 100 steps after the last one seen and says its parameters' digest.
        write_stop(os.path.join(tmp, "stop"), max(s for _, s in steps))
        live = [agents[h] for h in agents]
        ended = wait_until(lambda: all(p.p.poll() is not None for p in live), 120)
        for p in live:
            p.reader.join(30)  # the last lines read
        finals = [m.group(2) for p in everyone() for _, m in p.all(FINAL)]
        res["ended"] = bool(ended) and all(p.p.returncode == 0 for p in live)
        res["finals"] = len(finals)
        res["params_agree"] = len(set(finals)) == 1
        if a.detail:  # steps per second, second by second
            per = [0] * int(a.seconds)
            for t, _ in steps:
                k = int(t - t0)
                if 0 <= k < len(per):
                    per[k] += 1
            res["per_second"] = per
            res["kill_times"] = [round(k - t0, 2) for k in kill_times]
    except Exception as e:  # noqa: BLE001 (the result says what went wrong)
        res["error"] = str(e)
    finally:
        for p in reversed(procs):
            p.stop()
        subprocess.run(["rm", "-rf", tmp])
    print("RESULT " + json.dumps(res), flush=True)


def outer(a):
    rows = {}
    ways = [w for w in a.only.split(",") if w]
    if "none" not in ways:
        ways.insert(0, "none")
    for t in range(a.trials):
        for way in ways:
            cmd = [HOSTNET, "run", "4", "--", sys.executable, __file__, "--inner", "--way", way,
                   "--step_ms", str(a.step_ms), "--seconds", str(a.seconds), "--every", str(a.every)]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            res = json.loads(line[-1][7:]) if line else {"error": r.stderr[-400:]}
            print(f"  {way} #{t}: {json.dumps(res)}", flush=True)
            rows.setdefault(way, []).append(res)
    ok = lambda w: [r for r in rows.get(w, []) if "step" in r]  # noqa: E731
    ref = statistics.median(r["step"] for r in ok("none")) if ok("none") else None
    print(f"\n| a node killed every {a.every:g} s and back, {a.seconds:g} s | step | kills | progress "
          "| lost per failure (in the run) | params agree at the end |")
    print("|---|---|---|---|---|---|")
    for w in ways:
        if not ok(w) or not ref:
            print(f"| {w} | - | - | - | - | - |")
            continue
        step = statistics.median(r["step"] for r in ok(w))
        kills = statistics.median(r["kills"] for r in ok(w))
        own = ""
        if w == "spares" and ok("none_spares"):  # against the same job (its spares) unkilled
            own = " (%.1f%% of none_spares)" % (
                100.0 * step / statistics.median(r["step"] for r in ok("none_spares")))
        inrun = [x for r in ok(w) for x in r.get("lost_s", [])]
        inrun = "%.2f s (median of %d)" % (statistics.median(inrun), len(inrun)) if inrun else ""
        agree = "%d of %d" % (sum(1 for r in ok(w) if r.get("params_agree")), len(ok(w)))
        print(f"| {w} | {step:.0f} | {kills:.0f} | {100.0 * step / ref:.1f}%{own} | {inrun} | {agree} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--inner", action="store_true")
    ap.add_argument("--way", default="spares")
    ap.add_argument("--only", default=",".join(WAYS))
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--every", type=float, default=15)
    ap.add_argument("--step_ms", type=float, default=30)
    ap.add_argument("--detail", action="store_true", help="--inner: steps per second")
    a = ap.parse_args()
    inner(a) if a.inner else outer(a)


if __name__ == "__main__":
    main()
