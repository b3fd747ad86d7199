#!/usr/bin/python3
"""In-place recovery against today's full restart (issue 26; bench/README.md, "In-place
recovery"). Four namespace hosts (tests/support/hostnet): rdzvd on host 0, one agent on each
of hosts 1-3 (`--nnodes=2:3 --nproc_per_node=1`), each running examples/train with a
checkpoint every 50 steps into a folder every host sees. Rank 0 prints every step
(`--log-every 1`); every time below is CLOCK_MONOTONIC, which all namespaces share.

  kill     kill -9 of host 2's agent (its worker dies with it): seconds from the kill to the
           next step the survivors' rank 0 completes, whether the survivors' pids stayed,
           and whether a checkpoint was read ("resuming after step N of" from a new process)
  crash    rank 1's worker exits 3 at step 200 (--fail-at-step): seconds from the
           replacement's first line ("pid P in place", its ring formed) and from the crash
           to rank 0's next step; the pids that changed
  cut      host 2 silently cut (iptables drops, no FIN, no RST) while the survivors wait in an
           all_reduce on its rank: from the server's decision (its node_lost event) to each
           survivor's collective returning ("re-forming in place"): the abort is pushed, not
           timed out (the ring's own timeout is 300 s); in place only
  curve    the loss curve: 1500 steps, host 2's agent killed -9 at step 500 (in place: the world
           goes on with two ranks; full restart: from the checkpoint at step 500 or before),
           rank 0's loss at steps 600, 1000 and 1500 against a run of three that never failed
           (the `--no_faults` run of the same mode)
  goodput  for --duration seconds, host 2's agent killed -9 every --period seconds and started
           again a second later: completed steps per second against a run without faults

Each mode runs with --in_place and without (today's restart), side by side in one run, each
trial in fresh hosts (`hostnet run 4 -- in_place.py --inner ...`).

  bench/in_place.sh [--trials N] [--only kill,crash,cut,curve,goodput] [--duration S] [--period S]
                    [--delay_ms MS]   (cut: the agents reach rdzvd through fault_proxy, MS each way)
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hostproc import Proc, wait_until  # noqa: E402

BUILD = os.environ.get("BUILD", "/work/main/build")
HOSTNET = os.path.join(BUILD, "tests/hostnet")
LAUNCH = os.path.join(BUILD, "launcher/launch")
RDZVD = os.path.join(BUILD, "rendezvous/rdzvd")
TRAIN = os.path.join(BUILD, "examples/train/train")
PROXY = os.path.join(BUILD, "tests/fault_proxy")

STEP = r"\]:step (\d+) loss"


def wrap(i):
    return os.environ[f"HOSTNET_WRAP_{i}"].split()


def agent(a, host, tmp, in_place, extra=()):
    conf = "last_call_timeout=2"
    if a.mode == "cut":
        conf += ",keep_alive_interval=0.5,keep_alive_max_attempt=4"  # a 2 s liveness window
    endpoint = f"{os.environ['HOSTNET_HOST_0']}:29400"
    if a.delay_ms > 0:
        # The agent's stream (and its workers' store) through a delaying proxy in its own host:
        # a one-way delay of delay_ms each way, so the round trip to the server is visible.
        port_file = os.path.join(tmp, f"proxy.{host}.{time.monotonic()}")
        proxy = Proc(f"proxy{host}", wrap(host) + [PROXY, "--listen", "127.0.0.1:0", "--target",
                                                   endpoint, "--delay_ms", str(a.delay_ms),
                                                   "--port_file", port_file])
        a.extra_procs.append(proxy)
        if not wait_until(lambda: os.path.exists(port_file), 10):
            raise RuntimeError("fault_proxy did not start")
        endpoint = "127.0.0.1:" + open(port_file).read().strip()
    argv = wrap(host) + [LAUNCH, "--nnodes=2:3", "--nproc_per_node=1", "--rdzv_backend=c10d",
                         f"--rdzv_endpoint={endpoint}",
                         "--rdzv_id=job", "--max_restarts=100",
                         f"--rdzv_conf={conf}",
                         "--event_log", os.path.join(tmp, f"events.{host}.{time.monotonic()}")]
    if in_place:
        argv.append("--in_place")
    steps = "1500" if a.mode == "curve" else "1000000"
    argv += [TRAIN, "--steps", steps, "--log-every", "1", "--checkpoint-dir",
             os.path.join(tmp, "ck"), "--checkpoint-every", "50", *extra]
    return Proc(f"agent{host}", argv)


def pids(p, after=0.0):
    return {int(m.group(1)) for _, m in p.all(r"pid (\d+) (?:in place|re-formed)", after)}


def inner(a):
    tmp = tempfile.mkdtemp(prefix="in_place_")
    res = {"mode": a.mode, "in_place": a.in_place}
    procs = []
    try:
        rd = Proc("rdzvd", wrap(0) + [RDZVD, "--listen", "0.0.0.0:29400", "--event_log", "-"])
        procs.append(rd)
        if not wait_until(lambda: rd.first("listening on port"), 30):
            raise RuntimeError("rdzvd did not start")
        crash = ["--fail-at-step", "200", "--fail-rank", "1"] if a.mode == "crash" else []
        agents = {h: agent(a, h, tmp, a.in_place, crash) for h in (1, 2, 3)}
        procs += agents.values()
        everyone = lambda: [p for p in agents.values() if p.p.poll() is None]
        # Rank 0 steps in a world of three.
        if not wait_until(lambda: any(p.first(r"train: 3 rank\(s\)") or p.first("in place: 3 rank")
                                      for p in everyone()), 60):
            raise RuntimeError("the job did not form")
        if a.mode == "kill":
            kill_trial(a, agents, res)
        elif a.mode == "crash":
            crash_trial(a, agents, res)
        elif a.mode == "cut":
            cut_trial(a, agents, rd, res)
        elif a.mode == "curve":
            curve_trial(a, agents, res)
        else:
            goodput_trial(a, agents, procs, tmp, res)
    except Exception as e:  # noqa: BLE001 (the result says what went wrong)
        res["error"] = str(e)
    finally:
        for p in reversed(procs + a.extra_procs):
            p.stop()
        subprocess.run(["rm", "-rf", tmp])
    print("RESULT " + json.dumps(res), flush=True)


def last_step(agents, after=0.0):
    best = None
    for p in agents.values():
        for t, m in p.all(STEP, after):
            if best is None or t > best[0]:
                best = (t, int(m.group(1)))
    return best


def next_step_after(agents, t):
    """When rank 0 completed the first step of the recovered run after time t: the step after
    the one it resumed after ("in place: ... resuming after step X" or, from a checkpoint,
    "resuming after step X of"), so a line printed late from before the fault never counts."""
    def find():
        for p in agents.values():
            r = p.first(r"resuming after step (\d+)", t)
            if r:
                done = p.first(r"\]:step %d loss" % (int(r[1].group(1)) + 1), r[0])
                if done:
                    return done[0]
        return None
    return wait_until(find, 60)


def kill_trial(a, agents, res):
    time.sleep(3.0)  # past the first checkpoints, steady
    survivors = {h: agents[h] for h in (1, 3)}
    before = {h: pids(p) for h, p in survivors.items()}
    t_kill = time.monotonic()
    agents[2].stop(signal.SIGKILL)
    first = next_step_after(survivors, t_kill)
    if not first:
        raise RuntimeError("no step after the kill")
    time.sleep(1.0)
    res["kill_to_step_s"] = first - t_kill
    res["survivor_pids_kept"] = all(before[h] <= pids(p) and
                                    not p.first(r"pid \d+ in place, round", t_kill)
                                    for h, p in survivors.items()) if a.in_place else False
    res["checkpoint_read"] = any(p.first(r"resuming after step \d+ of", t_kill)
                                 for p in survivors.values())
    res["new_processes"] = sum(len(p.all(r"pid \d+ in place, round|train: \d+ rank\(s\)", t_kill))
                               for p in survivors.values())


def crash_trial(a, agents, res):
    at = lambda: [(p.first(r"injected failure at step"), h) for h, p in agents.items()
                  if p.first(r"injected failure at step")]
    crashed = wait_until(at, 60)
    if not crashed:
        raise RuntimeError("no crash")
    (t_crash, _), host = crashed[0]
    t_step = next_step_after(agents, t_crash)
    if not t_step:
        raise RuntimeError("no step after the crash")
    time.sleep(1.0)
    res["crash_to_step_s"] = t_step - t_crash
    up = agents[host].first(r"pid \d+ in place, round|train: \d+ rank\(s\)", t_crash)
    if up:
        res["replacement_up_to_step_s"] = t_step - up[0]
    res["new_processes"] = sum(len(p.all(r"pid \d+ in place, round", t_crash))
                               for p in agents.values()) if a.in_place else None
    res["changed_hosts"] = [h for h, p in agents.items()
                            if p.first(r"pid \d+ in place, round", t_crash)] if a.in_place else None


def cut_trial(a, agents, rd, res):
    time.sleep(3.0)
    t_cut = time.monotonic()
    subprocess.run([os.environ["HOSTNET_CTL"], "cut", os.environ["HOSTNET_NS_2"]], check=True)
    survivors = [agents[1], agents[3]]
    decided = wait_until(lambda: rd.first(r'"event":"node_lost"', t_cut), 30)
    if not decided:
        raise RuntimeError("the server never dropped the cut node")
    back = wait_until(lambda: all(p.first(r"re-forming in place", t_cut) for p in survivors), 30)
    if not back:
        raise RuntimeError("a survivor's collective did not return")
    returned = [p.first(r"re-forming in place", t_cut)[0] for p in survivors]
    res["delay_ms"] = a.delay_ms
    res["cut_to_decision_s"] = decided[0] - t_cut
    res["decision_to_returned_s"] = max(returned) - decided[0]
    res["returned_before_decision"] = any(t < decided[0] for t in returned)


def curve_trial(a, agents, res):
    if a.faults:
        at = wait_until(lambda: any(p.first(r"\]:step 500 loss") for p in agents.values()), 120)
        if not at:
            raise RuntimeError("no step 500")
        agents[2].stop(signal.SIGKILL)
    survivors = [p for h, p in agents.items() if h != 2 or not a.faults]
    done = wait_until(lambda: any(p.first(r"final loss") for p in survivors), 300)
    if not done:
        raise RuntimeError("the run did not finish")
    for step in (600, 1000, 1500):
        # The last line for that step (a step done again after a restart prints again).
        found = [m for p in survivors for m in p.all(r"\]:step %d loss (\S+)" % step)]
        res[f"loss_{step}"] = float(found[-1][1].group(1)) if found else None


def goodput_trial(a, agents, procs, tmp, res):
    time.sleep(3.0)
    t0 = time.monotonic()
    s0 = last_step(agents)
    kills = 0
    next_kill = t0 + (a.period if a.faults else 1e9)
    while time.monotonic() < t0 + a.duration:
        time.sleep(0.05)
        if time.monotonic() >= next_kill:
            agents[2].stop(signal.SIGKILL)
            kills += 1
            time.sleep(1.0)
            agents[2] = agent(a, 2, tmp, a.in_place)
            procs.append(agents[2])
            next_kill += a.period
    s1 = last_step(agents, t0)
    res["kills"] = kills
    res["steps_per_s"] = (s1[1] - s0[1]) / (s1[0] - t0) if s0 and s1 else None
    # Samples: each step that moves the run forward counts batch x the world it ran in (a world
    # of two takes steps faster here, three ranks sharing two cores), steps done again after a
    # restart from a checkpoint count nothing.
    lines = sorted((t, text) for p in agents.values() for t, text in p.lines if t >= t0)
    world, last, samples = 3, s0[1] if s0 else 0, 0
    for t, text in lines:
        w = re.search(r"\]:(?:train: in place: |train: )(\d+) rank\(s\)", text)
        if w:
            world = int(w.group(1))
        m = re.search(STEP, text)
        if m and int(m.group(1)) > last:
            samples += (int(m.group(1)) - last) * 32 * world
            last = int(m.group(1))
    res["samples_per_s"] = samples / (s1[0] - t0) if s1 else None


def outer(a):
    modes = a.only.split(",")
    rows = {}
    for mode in modes:
        for in_place in ((True,) if mode == "cut" else (True, False)):
            for faults in ((False, True) if mode in ("goodput", "curve") else (True,)):
                trials = 1 if mode in ("goodput", "curve") else a.trials
                for t in range(trials):
                    cmd = [HOSTNET, "run", "4", "--", sys.executable, __file__, "--inner",
                           "--mode", mode, "--duration", str(a.duration), "--period",
                           str(a.period), "--delay_ms", str(a.delay_ms)] + (["--in_place"] if in_place else []) + \
                          ([] if faults else ["--no_faults"])
                    r = subprocess.run(cmd, capture_output=True, text=True,
                                       timeout=a.duration + 300)
                    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
                    res = json.loads(line[-1][7:]) if line else {"error": r.stderr[-400:]}
                    key = (mode, in_place, faults)
                    print(f"  {mode} in_place={in_place} faults={faults} #{t}: {json.dumps(res)}",
                          flush=True)
                    rows.setdefault(key, []).append(res)

    def med(key, field):
        v = [r[field] for r in rows.get(key, []) if r.get(field) is not None]
        return statistics.median(v) if v else None

    print("\n| measure | in place | full restart | ratio |")
    print("|---|---|---|---|")
    for mode, field, what in (("kill", "kill_to_step_s", "kill -9 of a node -> survivors' next step"),
                              ("crash", "crash_to_step_s", "a worker's crash -> the group's next step"),
                              ("crash", "replacement_up_to_step_s",
                               "the replacement's ring formed -> the group's next step"),
                              ("cut", "decision_to_returned_s",
                               "a silent cut: the server's decision -> every survivor's blocked "
                               "all_reduce returned")):
        if mode not in modes:
            continue
        i, f = med((mode, True, True), field), med((mode, False, True), field)
        ratio = f"{f / i:.1f}x" if i and f else "-"
        fmt = lambda x: f"{x * 1000:.0f} ms" if x is not None else "-"
        print(f"| {what} (median of {a.trials}) | {fmt(i)} | {fmt(f)} | {ratio} |")
    if "curve" in modes:
        for step in (600, 1000, 1500):
            cells = []
            for in_place in (True, False):
                v = med(("curve", in_place, True), f"loss_{step}")
                base = med(("curve", in_place, False), f"loss_{step}")
                cells.append(f"{v:.4f} (unbroken {base:.4f})" if v and base else "-")
            print(f"| loss at step {step}, a node killed at step 500 | {cells[0]} | {cells[1]} | |")
    if "goodput" in modes:
        for field, unit in (("steps_per_s", "steps/s"), ("samples_per_s", "samples/s")):
            for in_place in (True, False):
                base = med(("goodput", in_place, False), field)
                g = med(("goodput", in_place, True), field)
                share = f"{100 * g / base:.0f}%" if g and base else "-"
                print(f"| goodput in {unit}, a node killed every {a.period:g} s for "
                      f"{a.duration:g} s ({'in place' if in_place else 'full restart'}) | "
                      f"{g and f'{g:.0f}'} vs {base and f'{base:.0f}'} without faults | {share} | |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--inner", action="store_true")
    ap.add_argument("--mode", default="kill")
    ap.add_argument("--in_place", action="store_true")
    ap.add_argument("--no_faults", dest="faults", action="store_false")
    ap.add_argument("--only", default="kill,crash,cut,curve,goodput")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--duration", type=float, default=180.0)
    ap.add_argument("--period", type=float, default=15.0)
    ap.add_argument("--delay_ms", type=int, default=0,
                    help="cut: each agent reaches rdzvd through fault_proxy with this one-way delay")
    a = ap.parse_args()
    a.extra_procs = []
    inner(a) if a.inner else outer(a)


if __name__ == "__main__":
    main()
