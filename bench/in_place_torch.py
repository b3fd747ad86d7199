#!/usr/bin/python3
"""A PyTorch DDP job recovering in place against today's full restart and against torchrun
(issue 27; bench/README.md, "PyTorch in place"). Four namespace hosts (tests/support/hostnet):
rdzvd on host 0, one agent on each of hosts 1-3 (`--nnodes=2:3 --nproc_per_node=1`), each
running examples/python/ddp_in_place.py (Debian's python3-torch, gloo) with a checkpoint every
50 steps into a folder every host sees. Rank 0 prints every step; every time is
CLOCK_MONOTONIC, which all namespaces share.

  kill -9 of host 2's agent and its workers (its session), past step 60: seconds
  from the kill to the next step rank 0 completes after the recovery (in place: after its
  "re-formed in place" line; a full restart: the new rank 0's first step), whether the
  survivors kept their processes, whether a checkpoint was read.

Three ways, side by side in one run, each trial in fresh hosts:
  in_place   launch --in_place
  full       launch (today's full restart: every worker new, from the checkpoint)
  torchrun   ../shared/peer/torchrun311 (torch 1.13's elastic agent, c10d rendezvous hosted by
             host 1's agent, --monitor_interval=0.1), the same script (not in place)

  bench/in_place_torch.sh [--trials N] [--only in_place,full,torchrun]
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hostproc import Proc, wait_until  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("BUILD", "/work/main/build")
HOSTNET = os.path.join(BUILD, "tests/hostnet")
# LAUNCH, PYTHON: another launch and interpreter (the suite's torch 2.x roots give the wheel's
# muster-launch run in the root and the root's python3: tests/support/in_torch_root.sh).
LAUNCH = os.environ.get("LAUNCH", os.path.join(BUILD, "launcher/launch"))
PYTHON = os.environ.get("PYTHON", "/usr/bin/python3")
RDZVD = os.path.join(BUILD, "rendezvous/rdzvd")
TORCHRUN = os.environ.get("TORCHRUN", os.path.join(ROOT, "..", "shared", "peer", "torchrun311"))
SCRIPT = os.path.join(ROOT, "examples", "python", "ddp_in_place.py")

STEP = r"\]:step (\d+): loss"
# An agent's or a worker's words on a recovery that did not stay in place.
WHY = r"falling back|failed|[Aa]bort|Traceback|Error|SIG[A-Z]+|terminate"


def wrap(i):
    return os.environ[f"HOSTNET_WRAP_{i}"].split()


def agent(a, host, tmp):
    script = [SCRIPT, "--steps", "1000000", "--log-every", "1", "--checkpoint",
              os.path.join(tmp, "ck.pt"), "--checkpoint-every", "50", "--step-sleep-ms",
              str(a.step_ms), "--pg-timeout", str(a.pg_timeout)]
    conf = "last_call_timeout=2"
    if a.fault == "cut":
        conf += ",keep_alive_interval=0.5,keep_alive_max_attempt=4"  # a 2 s liveness window
    if a.way == "torchrun":
        endpoint = f"{os.environ['HOSTNET_HOST_1']}:29500"
        argv = wrap(host) + [TORCHRUN, "--nnodes=2:3", "--nproc_per_node=1", "--rdzv_backend=c10d",
                             f"--rdzv_endpoint={endpoint}", "--rdzv_id=job", "--max_restarts=100",
                             "--monitor_interval=0.1", f"--rdzv_conf={conf}",
                             "--tee=3", *script]
    else:
        endpoint = f"{os.environ['HOSTNET_HOST_0']}:29400"
        argv = wrap(host) + [LAUNCH, "--nnodes=2:3", "--nproc_per_node=1", "--rdzv_backend=c10d",
                             f"--rdzv_endpoint={endpoint}", "--rdzv_id=job", "--max_restarts=100",
                             f"--rdzv_conf={conf}"]
        if a.way == "in_place":
            argv.append("--in_place")
        argv += [PYTHON, *script]
    env = dict(os.environ, PYTHON_EXEC=PYTHON)
    env.pop("PYTHONPATH", None)
    return Proc(f"agent{host}", argv, env=env)


def inner(a):
    tmp = tempfile.mkdtemp(prefix="in_place_torch_")
    res = {"way": a.way, "fault": a.fault}
    procs = []
    try:
        if a.way != "torchrun":
            rd = Proc("rdzvd", wrap(0) + [RDZVD, "--listen", "0.0.0.0:29400", "--event_log", "-"])
            procs.append(rd)
            if not wait_until(lambda: rd.first("listening on port"), 30):
                raise RuntimeError("rdzvd did not start")
        agents = {h: agent(a, h, tmp) for h in (1, 3, 2)} if a.way == "torchrun" else \
            {h: agent(a, h, tmp) for h in (1, 2, 3)}
        procs += agents.values()
        # Rank 0 steps in a world of three, past a checkpoint.
        if not wait_until(lambda: any(p.first(r"\]:step 60: loss .* \(3 ranks\)") for p in agents.values()),
                          180):
            raise RuntimeError("the job did not form: " + " | ".join(
                t for p in agents.values() for _, t in p.lines[-3:]))
        survivors = {h: agents[h] for h in (1, 3)}
        t_kill = time.monotonic()
        if a.fault == "cut":
            # Host 2 goes silent (iptables DROP, no FIN, no RST): the survivors' collectives
            # wait on its rank until the process group's timeout (gloo cannot be aborted).
            subprocess.run([os.environ["HOSTNET_CTL"], "cut", os.environ["HOSTNET_NS_2"]], check=True)
        else:
            # The node dies: its agent and everything in the agent's session, at once
            # (torchrun's workers do not die with their agent; launch's do either way).
            os.killpg(agents[2].p.pid, signal.SIGKILL)
            agents[2].p.wait()

        def resumed():
            for p in survivors.values():
                mark = p.first(r"re-formed in place as rank 0 |rank 0: starting at step", t_kill)
                if mark:
                    done = p.first(STEP, mark[0])
                    if done:
                        return done[0]
            return None
        first = wait_until(resumed, 120)
        if not first:
            raise RuntimeError("no step after the kill: " + " | ".join(
                f"{p.name}: {t}" for p in survivors.values() for _, t in p.lines[-4:]))
        res["kill_to_step_s"] = first - t_kill
        if a.way != "torchrun":
            # The server's decision (its node_lost event) -> rank 0's next step: what the push
            # saves (a cut is decided only after the liveness window).
            decided = rd.first(r'"event":"node_lost"', t_kill)
            if decided:
                res["decision_to_step_s"] = first - decided[0]
        # In place: the survivors re-formed in the processes they had (no new one started on
        # them) and hold the same parameters after the re-form.
        res["new_processes_on_survivors"] = sum(
            p.count(r"rank \d+: starting at step|in place, round", t_kill) for p in survivors.values())
        if a.way == "in_place":
            digests = wait_until(lambda: [m.group(1) for p in survivors.values()
                                          for _, m in p.all(r"round \d+ params (\S+)", t_kill)]
                                 if all(p.first(r"round \d+ params", t_kill) for p in survivors.values())
                                 else None, 30)
            res["survivors_same_params"] = bool(digests) and len(set(digests)) == 1
        res["checkpoint_read"] = any(p.first(r"resuming from the checkpoint", t_kill) for p in survivors.values())
        if res["new_processes_on_survivors"]:
            # What the survivors' agents and workers said of the fault (a failed test's output).
            res["why"] = [f"{p.name}: {m.string[-300:]}" for p in survivors.values()
                          for _, m in p.all(WHY, t_kill)][:8]
    except Exception as e:  # noqa: BLE001 (the result says what went wrong)
        res["error"] = str(e)
    finally:
        for p in reversed(procs):
            p.stop()
        subprocess.run(["rm", "-rf", tmp])
    print("RESULT " + json.dumps(res), flush=True)


def outer(a):
    rows = {}
    for way in a.only.split(","):
        for t in range(a.trials):
            cmd = [HOSTNET, "run", "4", "--", sys.executable, __file__, "--inner", "--way", way,
                   "--step_ms", str(a.step_ms), "--fault", a.fault, "--pg_timeout", str(a.pg_timeout)]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            res = json.loads(line[-1][7:]) if line else {"error": r.stderr[-400:]}
            print(f"  {way} #{t}: {json.dumps(res)}", flush=True)
            rows.setdefault(way, []).append(res)

    def med(way):
        v = [r["kill_to_step_s"] for r in rows.get(way, []) if r.get("kill_to_step_s") is not None]
        return statistics.median(v) if v else None

    what = "kill -9 of a node" if a.fault == "kill" else f"a node cut silently (pg timeout {a.pg_timeout:g} s)"
    print(f"\n| {what} -> rank 0's next step (median of {a.trials}) | seconds | vs in place |")
    print("|---|---|---|")
    base = med("in_place")
    for way in a.only.split(","):
        m = med(way)
        ratio = f"{m / base:.1f}x" if m and base else "-"
        print(f"| {way} | {m:.2f} |" if m is not None else f"| {way} | - |", ratio, "|")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--inner", action="store_true")
    ap.add_argument("--way", default="in_place")
    ap.add_argument("--only", default="in_place,full,torchrun")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--step_ms", type=float, default=20, help="each step's stand-in compute")
    ap.add_argument("--fault", default="kill", choices=["kill", "cut"])
    ap.add_argument("--pg_timeout", type=float, default=60,
                    help="the script's process-group timeout, seconds (a silent peer's bound)")
    a = ap.parse_args()
    inner(a) if a.inner else outer(a)


if __name__ == "__main__":
    main()
