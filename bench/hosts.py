#!/usr/bin/python3
"""Multi-host figures on network-namespace hosts (tests/support/hostnet), ours against torchrun.
Run through bench/hosts.sh. Each repetition runs in fresh hosts: `hostnet run N -- hosts.py
--inner SCENARIO OUT.json ...`; this outer part repeats, alternates launchers and prints tables
of medians and ranges. Every time is CLOCK_MONOTONIC (time.monotonic here, the workers' own
t=), which all namespaces share; a line's time is when this driver read it from the pipe.

  bench/hosts.sh [--reps N] [--only ITEM ...]    ITEM: partition blips formation ddp slowlink
"""
import argparse
import json
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hostproc  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("BUILD", "/work/build-bench")
LAUNCH = os.path.join(BUILD, "launcher/launch")
HOSTNET = os.path.join(BUILD, "tests/hostnet")
PROXY = os.path.join(BUILD, "tests/fault_proxy")
TORCHRUN = os.environ.get("TORCHRUN", os.path.join(ROOT, "..", "shared/peer/torchrun311"))
PY = "/usr/bin/python3"
WORKER = os.path.join(ROOT, "bench/hosts_worker.py")
DDP = os.path.join(ROOT, "tests/interop/ddp_train.py")
PORT = 29400
LOGDIR = os.environ.get("HOSTS_LOGDIR", "/tmp/hosts-bench")

# ----------------------------------------------------------------------------- inner helpers


class Proc:
    """A process in a host; every output line kept with the time it was read."""

    def __init__(self, name, argv, env=None):
        self.name = name
        self.lines = []  # (t, stream, text)
        self.lock = threading.Lock()
        self.t_start = time.monotonic()
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env=env, start_new_session=True)
        self.t_exit = None
        self.rc = None
        self.threads = [threading.Thread(target=self._read, args=(s, n), daemon=True)
                        for s, n in ((self.p.stdout, "out"), (self.p.stderr, "err"))]
        for t in self.threads:
            t.start()
        threading.Thread(target=self._wait, daemon=True).start()

    def _read(self, f, n):
        for raw in iter(f.readline, b""):
            t = time.monotonic()
            with self.lock:
                self.lines.append((t, n, raw.decode(errors="replace").rstrip("\n")))

    def _wait(self):
        rc = self.p.wait()
        self.t_exit = time.monotonic()
        self.rc = rc

    def find(self, pattern, after=0.0, stream=None):
        """(t, match) of the first line matching after time `after`, or None."""
        rx = re.compile(pattern)
        with self.lock:
            lines = list(self.lines)
        for t, s, text in lines:
            if t >= after and (stream is None or s == stream):
                m = rx.search(text)
                if m:
                    return t, m
        return None

    def find_all(self, pattern, after=0.0):
        rx = re.compile(pattern)
        with self.lock:
            lines = list(self.lines)
        return [(t, m) for t, s, text in lines if t >= after for m in [rx.search(text)] if m]

    def stop(self, grace=10):
        if self.p.poll() is None:
            try:
                os.kill(self.p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.p.wait(grace)
            except subprocess.TimeoutExpired:
                os.kill(self.p.pid, signal.SIGKILL)
                self.p.wait()

    def dump(self, path):
        with self.lock, open(path, "w") as f:
            for t, s, text in self.lines:
                f.write(f"{t:.6f} {s} {text}\n")
            f.write(f"# rc={self.rc} t_exit={self.t_exit}\n")


def wait_until(pred, timeout, poll=0.005):
    return hostproc.wait_until(pred, timeout, poll)


class PidWatch:
    """The exit time of a process that is not our child (a worker), via a pidfd."""

    def __init__(self, pid):
        self.t_exit = None
        try:
            self.fd = os.pidfd_open(pid)
        except OSError:
            self.t_exit = time.monotonic()
            return
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        p = select.poll()
        p.register(self.fd, select.POLLIN)
        p.poll()
        self.t_exit = time.monotonic()
        os.close(self.fd)


def wrap(i):
    return os.environ[f"HOSTNET_WRAP_{i}"].split()


def ns(i):
    return os.environ[f"HOSTNET_NS_{i}"]


def ctl(*args):
    subprocess.run([os.environ["HOSTNET_CTL"], *args], check=True)


def launcher_argv(kind, nnodes, endpoint, prog, conf=None, max_restarts=None):
    if kind == "ours":
        argv = [LAUNCH]
    else:
        argv = [PY, TORCHRUN, "--monitor_interval=0.1"]
    argv += [f"--nnodes={nnodes}", "--nproc_per_node=1", "--rdzv_backend=c10d",
             f"--rdzv_endpoint={endpoint}", "--rdzv_id=job"]
    if conf:
        argv.append(f"--rdzv_conf={conf}")
    if max_restarts is not None:
        argv.append(f"--max_restarts={max_restarts}")
    return argv + ["--no_python"] + prog


def env_for(kind):
    e = dict(os.environ)
    e["MUSTER_LOG_LEVEL"] = "info"
    e["PATH"] = "/usr/bin:/bin:" + e.get("PATH", "")
    e.pop("PYTHONPATH", None)
    return e


STEP = r"step (\d+) world (\d+) t=([0-9.]+)"
READY = r"ready pid=(\d+) rank \d+ world (\d+) t=([0-9.]+)"


def steps(p, world=None, after=0.0):
    """[(t_worker, n, world)] of a launcher's worker step lines (the worker's own t=)."""
    out = []
    for _, m in p.find_all(STEP, 0.0):
        t = float(m.group(3))
        if t >= after and (world is None or int(m.group(2)) == world):
            out.append((t, int(m.group(1)), int(m.group(2))))
    return out


def start_training(kind, n, conf, nnodes="2:3"):
    ep = f"node0:{PORT}"
    procs = []
    for i in range(n):
        argv = wrap(i) + launcher_argv(kind, nnodes, ep, [PY, "-u", WORKER, "0", "20"], conf, 3)
        procs.append(Proc(f"node{i}", argv, env_for(kind)))
    ok = wait_until(lambda: all(steps(p, world=n) for p in procs), 120, 0.05)
    return procs, bool(ok)


def last_ready_pid(p, after=0.0):
    r = [m for _, m in p.find_all(READY, after)]
    return int(r[-1].group(1)) if r else None


def finish(procs, out, res, extra=()):
    for p in procs:
        p.stop()
    for p in list(procs) + list(extra):
        p.dump(os.path.join(LOGDIR, f"{out}.{p.name}.log"))
    with open(os.path.join(LOGDIR, out + ".json"), "w") as f:
        json.dump(res, f)


# ----------------------------------------------------------------------------- scenarios


def sc_partition(kind, out, cap=60.0):
    """Item 1: silent cut of node2 of 3 (2:3, c10d hosted by node0's agent)."""
    procs, ok = start_training(kind, 3, None)
    res = {"formed": ok}
    if not ok:
        return finish(procs, out, res)
    time.sleep(1.0)
    victim = procs[2]
    vpid = last_ready_pid(victim)
    watch = PidWatch(vpid) if vpid else None
    t_cut = time.monotonic()
    ctl("cut", ns(2))
    res["cut_cmd_s"] = time.monotonic() - t_cut
    surv = procs[:2]

    def world2_steps():
        s = [steps(p, world=2, after=t_cut) for p in surv]
        return s if all(s) else None

    wait_until(lambda: world2_steps() and (watch is None or watch.t_exit), cap, 0.05)
    if kind == "ours":
        noticed = [p.find(r"restarting workers", t_cut) for p in surv]
        rounds = [p.find(r"info: round \d+: group rank", t_cut) for p in surv]
        lost = victim.find(r"lost the server", t_cut)
        res["noticed"] = max(x[0] for x in noticed) - t_cut if all(noticed) else None
        res["noticed_first"] = min(x[0] for x in noticed if x) - t_cut if any(noticed) else None
        res["round"] = max(x[0] for x in rounds) - t_cut if all(rounds) else None
        res["lost_line"] = lost[0] - t_cut if lost else None
    s2 = world2_steps()
    res["first_step_w2"] = max(s[0][0] for s in s2) - t_cut if s2 else None
    r2 = [[float(m.group(3)) for _, m in p.find_all(READY, t_cut) if m.group(2) == "2"]
          for p in surv]
    res["ready_w2"] = max(r[0] for r in r2) - t_cut if all(r2) else None
    res["victim_worker_exit"] = (watch.t_exit - t_cut) if watch and watch.t_exit else None
    # What the survivors' workers did: their last step before any world-2 step.
    res["survivor_last_w3_step"] = max((s[-1][0] - t_cut for s in
                                        [steps(p, world=3) for p in surv] if s), default=None)
    res["victim_agent_alive"] = victim.p.poll() is None
    res["victim_agent_lines"] = [text for t, s, text in victim.lines if t >= t_cut
                                 and "step " not in text][:20]
    res["survivor_agent_lines"] = [text for t, s, text in surv[0].lines if t >= t_cut
                                   and "step " not in text][:20]
    finish(procs, out, res)


def sc_blip(kind, out, blip, conf, observe):
    """Item 2: cut node2 for `blip` s, heal; count restarts, measure the stall."""
    procs, ok = start_training(kind, 3, conf)
    res = {"formed": ok, "blip": blip}
    if not ok:
        return finish(procs, out, res)
    time.sleep(1.0)
    t_cut = time.monotonic()
    ctl("cut", ns(2))
    time.sleep(blip)
    t_heal = time.monotonic()
    ctl("heal", ns(2))

    def back3():
        s = [steps(p, world=3, after=t_heal) for p in procs]
        return s if all(s) else None

    # Wait for world 3 to be back, then observe a little more.
    wait_until(back3, observe, 0.05)
    time.sleep(2.0)
    readies = sum(len(p.find_all(READY, t_cut)) for p in procs)
    res["new_workers"] = readies
    if kind == "ours":
        res["restart_lines"] = sum(len(p.find_all(r"restarting workers", t_cut)) for p in procs)
        res["lost_lines"] = sum(len(p.find_all(r"lost the server", t_cut)) for p in procs)
    # Stall: the longest gap between consecutive steps of each worker around the blip
    # (steps of any world, any incarnation), the largest over the three nodes.
    # A worker that never stepped again after the heal counts its gap up to the end.
    gaps = []
    t_end = time.monotonic()
    res["resumed"] = bool(back3())
    for p in procs:
        ts = [t for t, _, _ in steps(p, after=t_cut - 1.0)]
        if not ts or ts[-1] < t_heal:
            ts.append(t_end)
        gaps.append(max((b - a for a, b in zip(ts, ts[1:])), default=None))
    res["stall"] = max(g for g in gaps if g is not None) if any(g is not None for g in gaps) else None
    res["stall_per_node"] = gaps
    b3 = back3()
    res["world3_back_from_cut"] = max(s[0][0] for s in b3) - t_cut if b3 else None
    res["world3_back_from_heal"] = max(s[0][0] for s in b3) - t_heal if b3 else None
    w2 = [steps(p, world=2, after=t_cut) for p in procs[:2]]
    res["world2_steps"] = sum(len(s) for s in w2)
    finish(procs, out, res)


def listening(i, port):
    r = subprocess.run(["ip", "netns", "exec", ns(i), "ss", "-ltnH", f"sport = :{port}"],
                       capture_output=True, text=True)
    return bool(r.stdout.strip())


def sc_formation(kind, out, n, prog, endpoint=None, conf_of=None, timeout=120.0, stagger=False):
    """stagger: start node0 first and the others once its port listens (torchrun behind the
    proxy: a client that reaches the proxy before the store listens gets a reset, and torch
    1.13's TCPStore client aborts on it instead of retrying)."""
    ep = endpoint or f"node0:{PORT}"
    argvs = [wrap(i) + launcher_argv(kind, str(n), ep, prog, conf_of(i) if conf_of else None)
             for i in range(n)]
    t0 = time.monotonic()
    if stagger:
        procs = [Proc("node0", argvs[0], env_for(kind))]
        wait_until(lambda: listening(0, PORT), 60, 0.05)
        procs += [Proc(f"node{i}", argvs[i], env_for(kind)) for i in range(1, n)]
    else:
        procs = [Proc(f"node{i}", argvs[i], env_for(kind)) for i in range(n)]
    wait_until(lambda: all(p.rc is not None for p in procs), timeout, 0.002)
    res = {"rcs": [p.rc for p in procs]}
    started = [p.find(r"(^|:)started$|rank \d+/\d+ params_identical") for p in procs]
    res["started"] = max(s[0] for s in started) - t0 if all(started) else None
    res["exited"] = (max(p.t_exit for p in procs) - t0
                     if all(p.rc == 0 for p in procs) else None)
    return procs, res


def sc_form(kind, out, n, ddp=False):
    prog = [PY, "-u", DDP, "50"] if ddp else ["/bin/echo", "started"]
    procs, res = sc_formation(kind, out, n, prog)
    finish(procs, out, res)


def sc_slowlink(kind, out, n, kbit, delay_ms, stagger=False):
    """Item 4: formation with every host's link at KBIT (tbf) and DELAY ms added by a proxy in
    the root namespace in front of the endpoint; the agents reach it by the name rdzvproxy."""
    gw = os.environ["HOSTNET_GATEWAY"]
    for i in range(n):
        with open(f"/etc/netns/{ns(i)}/hosts", "a") as f:
            f.write(f"{gw} rdzvproxy\n")
        ctl("rate", ns(i), str(kbit))
    proxy = Proc("proxy", [PROXY, "--listen", f"{gw}:{PORT}",
                           "--target", f"{os.environ['HOSTNET_ADDR_0']}:{PORT}",
                           "--delay_ms", str(delay_ms)])
    if not wait_until(lambda: proxy.find("listening"), 10):
        res = {"error": "proxy did not start: " + " | ".join(t for _, _, t in proxy.lines)}
        return finish([proxy], out, res)
    procs, res = sc_formation(kind, out, n, ["/bin/echo", "started"],
                              endpoint=f"rdzvproxy:{PORT}",
                              conf_of=lambda i: "is_host=1" if i == 0 else "is_host=0",
                              timeout=60.0, stagger=kind == "torchrun" and stagger)
    finish(procs + [proxy], out, res)


def inner(args):
    os.makedirs(LOGDIR, exist_ok=True)
    sc, kind, out = args[0], args[1], args[2]
    rest = args[3:]
    if sc == "partition":
        sc_partition(kind, out)
    elif sc == "blip":
        sc_blip(kind, out, float(rest[0]), rest[1] if rest[1] != "-" else None, float(rest[2]))
    elif sc == "form":
        sc_form(kind, out, int(rest[0]), ddp=rest[1] == "ddp")
    elif sc == "slowlink":
        sc_slowlink(kind, out, int(rest[0]), int(rest[1]), int(rest[2]), len(rest) > 3)


# ----------------------------------------------------------------------------- outer


def run_one(n, sc, kind, out, *rest, timeout=400):
    cmd = [HOSTNET, "run", str(n), "--", PY, os.path.abspath(__file__), "--inner", sc, kind, out,
           *map(str, rest)]
    t = time.monotonic()
    try:
        subprocess.run(cmd, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        print(f"  {out}: timed out after {timeout} s", flush=True)
    path = os.path.join(LOGDIR, out + ".json")
    res = json.load(open(path)) if os.path.exists(path) else {"error": "no result"}
    print(f"  {out} ({time.monotonic() - t:.0f} s): {json.dumps(res)[:600]}", flush=True)
    return res


def fmt(v, unit="s"):
    if v is None:
        return "n/a"
    if unit == "s":
        return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"
    return f"{v:g}"


def summary(vals, unit="s", none_text="none"):
    got = [v for v in vals if v is not None]
    if not got:
        return none_text
    med = statistics.median(got)
    s = fmt(med, unit)
    if len(got) > 1:
        s += f" ({fmt(min(got), unit)}-{fmt(max(got), unit)})"
    if len(got) < len(vals):
        s += f" [{len(vals) - len(got)}/{len(vals)} none]"
    return s


def ratio(ours, peer):
    o = [v for v in ours if v is not None]
    p = [v for v in peer if v is not None]
    if not o or not p:
        return ""
    return f"{statistics.median(p) / statistics.median(o):.1f}x"


def outer(a):
    os.makedirs(LOGDIR, exist_ok=True)
    R = {}
    tag = time.strftime("%H%M%S")

    def rep(key, n, sc, kind, *rest, reps=a.reps, timeout=400):
        R.setdefault(key, [])
        for r in range(reps):
            R[key].append(run_one(n, sc, kind, f"{tag}-{key}-{r}", *rest, timeout=timeout))

    only = set(a.only or ["formation", "ddp", "slowlink", "partition", "blips"])
    table = []
    if "formation" in only:
        print("formation", flush=True)
        for n in (2, 3):
            for r in range(a.reps):  # alternating launchers
                for kind in ("ours", "torchrun"):
                    R.setdefault(f"form{n}-{kind}", []).append(
                        run_one(n, "form", kind, f"{tag}-form{n}-{kind}-{r}", n, "echo"))
        for n in (2, 3):
            for what in ("started", "exited"):
                o = [x.get(what) for x in R[f"form{n}-ours"]]
                p = [x.get(what) for x in R[f"form{n}-torchrun"]]
                table.append((f"formation, {n} hosts, every worker {what}", summary(o),
                              summary(p), ratio(o, p)))
    if "ddp" in only:
        print("ddp", flush=True)
        for r in range(a.reps):
            for kind in ("ours", "torchrun"):
                R.setdefault(f"ddp-{kind}", []).append(
                    run_one(2, "form", kind, f"{tag}-ddp-{kind}-{r}", 2, "ddp"))
        o = [x.get("exited") for x in R["ddp-ours"]]
        p = [x.get("exited") for x in R["ddp-torchrun"]]
        table.append(("DDP 50 steps, 2 hosts, end to end", summary(o), summary(p), ratio(o, p)))
    if "slowlink" in only:
        print("slowlink", flush=True)
        for r in range(a.reps):
            for kind in ("ours", "torchrun"):
                R.setdefault(f"slow-{kind}", []).append(
                    run_one(3, "slowlink", kind, f"{tag}-slow-{kind}-{r}", 3, 1000, 200))
        for what in ("started", "exited"):
            o = [x.get(what) for x in R["slow-ours"]]
            p = [x.get(what) for x in R["slow-torchrun"]]
            table.append((f"formation, 3 hosts, 1 Mbit/s + 200 ms, every worker {what}",
                          summary(o), summary(p, none_text="failed (see logs)"), ratio(o, p)))
    if "slowstagger" in only or "slowlink" in only:
        # torchrun behind the proxy, node0 started first (see sc_formation), with ours as usual.
        print("slowlink, torchrun's node0 first", flush=True)
        for r in range(a.reps):
            for kind in ("ours", "torchrun"):
                R.setdefault(f"slowst-{kind}", []).append(
                    run_one(3, "slowlink", kind, f"{tag}-slowst-{kind}-{r}", 3, 1000, 200, "st"))
        for what in ("started", "exited"):
            o = [x.get(what) for x in R["slowst-ours"]]
            p = [x.get(what) for x in R["slowst-torchrun"]]
            table.append((f"formation, 3 hosts, 1 Mbit/s + 200 ms, every worker {what} "
                          "(torchrun: node0 first)", summary(o), summary(p), ratio(o, p)))
    if "partition" in only:
        print("partition", flush=True)
        for r in range(a.reps):
            for kind in ("ours", "torchrun"):
                R.setdefault(f"part-{kind}", []).append(
                    run_one(3, "partition", kind, f"{tag}-part-{kind}-{r}"))
        for what, label in (("noticed", "(a) noticed: survivors' `restarting workers`"),
                            ("lost_line", "(b) partitioned node: `lost the server`"),
                            ("victim_worker_exit", "(b) partitioned node's worker exited"),
                            ("round", "(c) survivors' new round formed"),
                            ("ready_w2", "(c') survivors' workers past init_process_group"),
                            ("first_step_w2", "(d) survivors' first step in world 2")):
            o = [x.get(what) for x in R["part-ours"]]
            p = [x.get(what) for x in R["part-torchrun"]]
            rt = ratio(o, p)
            if not [v for v in p if v is not None] and [v for v in o if v is not None]:
                rt = f"> {60 / statistics.median([v for v in o if v is not None]):.0f}x"
            table.append((f"partition 1 of 3: {label}", summary(o),
                          summary(p, none_text="none within 60 s"), rt))
    if "blips" in only:
        print("blips", flush=True)
        conf = "keep_alive_interval=5,keep_alive_max_attempt=6"
        for blip in (3, 10, 20):
            for r in range(a.reps):
                R.setdefault(f"blip{blip}-ours", []).append(
                    run_one(3, "blip", "ours", f"{tag}-blip{blip}-ours-{r}", blip, conf, 45))
            R.setdefault(f"blip{blip}-torchrun", []).append(
                run_one(3, "blip", "torchrun", f"{tag}-blip{blip}-torchrun-0", blip, "-", 45))
            o, p = R[f"blip{blip}-ours"], R[f"blip{blip}-torchrun"]
            table.append((f"blip {blip} s (30 s rule; torchrun default): restarts (new workers)",
                          "/".join(str(x.get("new_workers")) for x in o),
                          "/".join(str(x.get("new_workers")) for x in p), ""))
            def st(xs):
                v = summary([x.get("stall") for x in xs])
                return v if all(x.get("resumed") for x in xs) else v + " (not resumed by the end)"
            table.append((f"blip {blip} s: training stall (longest gap between steps)",
                          st(o), st(p),
                          ratio([x.get("stall") for x in o], [x.get("stall") for x in p])))
        for r in range(a.reps):
            R.setdefault("blip3def-ours", []).append(
                run_one(3, "blip", "ours", f"{tag}-blip3def-ours-{r}", 3, "-", 60))
        o = R["blip3def-ours"]
        table.append(("blip 3 s, default 2 s rule: new workers (restart + rejoin)",
                      "/".join(str(x.get("new_workers")) for x in o), "", ""))
        table.append(("blip 3 s, default rule: 3-node world back, from the cut",
                      summary([x.get("world3_back_from_cut") for x in o]), "", ""))
        table.append(("blip 3 s, default rule: 3-node world back, from the heal",
                      summary([x.get("world3_back_from_heal") for x in o]), "", ""))
    json.dump(R, open(os.path.join(LOGDIR, f"{tag}-all.json"), "w"))
    print(f"\nraw results and logs: {LOGDIR}/{tag}-*\n")
    print("| figure | muster | torchrun | ratio |\n|---|---|---|---|")
    for row in table:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--inner":
        inner(sys.argv[2:])
    else:
        ap = argparse.ArgumentParser()
        ap.add_argument("--reps", type=int, default=3)
        ap.add_argument("--only", action="append")
        outer(ap.parse_args())
