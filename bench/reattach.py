#!/usr/bin/env python3
"""rdzvd kill -9 -> restarted -> every agent re-attached (bench/README.md, "Restarting rdzvd
without restarting workers").

A job of --agents agents x --nproc workers (tests' test_worker in `signals` mode: each appends
a start record and waits) runs against `rdzvd --state_dir`. Once every worker runs, rdzvd is
killed -9 and, as soon as it is reaped, started again on the same port and folder (a service
manager with no restart delay). Each output line is timestamped as read (time.monotonic).
Phases: kill -> every agent noticed; restart of the process + load of the state (spawn ->
its "restored" line); listening -> every agent re-attached (reconnect + re-attach); total
kill -> last re-attached. Then the workers are released (SIGUSR1) and the job must exit 0
with one start record per worker.
"""
import argparse
import os
import re
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

BUILD = os.environ.get("BUILD", "/work/build-bench")
LAUNCH = f"{BUILD}/launcher/launch"
RDZVD = f"{BUILD}/rendezvous/rdzvd"
WORKER = f"{BUILD}/tests/test_worker"


class Procs:
    """Processes whose output lines are collected with the time each was read."""

    def __init__(self):
        self.sel = selectors.DefaultSelector()
        self.lines = {}  # name -> [(t, line)]
        self.procs = {}

    def start(self, name, argv):
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.procs[name] = p
        self.lines.setdefault(name, [])
        self.sel.register(p.stdout, selectors.EVENT_READ, [name, b""])
        return p

    def pump(self, until, timeout=60):
        """Reads output until until() holds; returns the time it did."""
        end = time.monotonic() + timeout
        while not until():
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out; last lines: " + repr(
                    {k: v[-3:] for k, v in self.lines.items()}))
            for key, _ in self.sel.select(timeout=min(left, 0.5)):
                data = os.read(key.fileobj.fileno(), 65536)
                now = time.monotonic()
                if not data:
                    self.sel.unregister(key.fileobj)
                    continue
                key.data[1] += data
                *whole, key.data[1] = key.data[1].split(b"\n")
                self.lines[key.data[0]] += [(now, l.decode(errors="replace")) for l in whole]
        return time.monotonic()

    def first(self, name, pattern, after=0.0):
        for t, l in self.lines.get(name, []):
            if t >= after and re.search(pattern, l):
                return t
        return None

    def count(self, name, pattern):
        return sum(1 for _, l in self.lines.get(name, []) if re.search(pattern, l))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trial(agents, nproc):
    procs = Procs()
    state = tempfile.mkdtemp(prefix="reattach_state_")
    work = tempfile.mkdtemp(prefix="reattach_work_")
    port = free_port()
    ep = f"127.0.0.1:{port}"
    rdzvd_argv = [RDZVD, "--listen", ep, "--state_dir", state]
    try:
        procs.start("rdzvd0", rdzvd_argv)
        procs.pump(lambda: procs.first("rdzvd0", "restored") is not None)
        names = [f"agent{i}" for i in range(agents)]
        for n in names:
            procs.start(n, [LAUNCH, f"--nnodes={agents}", f"--nproc_per_node={nproc}",
                            "--rdzv_backend=c10d", f"--rdzv_endpoint={ep}", "--rdzv_id=bench",
                            WORKER, "signals", work])
        procs.pump(lambda: all(procs.count(n, r"\]:ready ") >= nproc for n in names))
        t_kill = time.monotonic()
        os.kill(procs.procs["rdzvd0"].pid, signal.SIGKILL)
        procs.procs["rdzvd0"].wait()
        t_spawn = time.monotonic()
        procs.start("rdzvd1", rdzvd_argv)
        t_listen = procs.pump(lambda: procs.first("rdzvd1", "restored 1 runs") is not None)
        t_listen = procs.first("rdzvd1", "restored 1 runs")
        procs.pump(lambda: all(procs.first(n, "re-attached to run bench") for n in names))
        noticed = max(procs.first(n, "re-attaches to run bench", t_kill) for n in names)
        attached = max(procs.first(n, "re-attached to run bench") for n in names)
        # Release the workers; the job must end well, each worker started once.
        pids = [int(m.group(1)) for n in names for _, l in procs.lines[n]
                if (m := re.search(r"\]:ready (\d+)", l))]
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
        for n in names:
            procs.pump(lambda: procs.procs[n].poll() is not None, timeout=30)
            if procs.procs[n].wait() != 0:
                raise RuntimeError(f"{n} exited {procs.procs[n].returncode}")
        restarted = 0
        for r in range(agents * nproc):
            with open(os.path.join(work, f"starts.{r}")) as f:
                restarted += len(f.read().splitlines()) - 1
        return {
            "noticed": noticed - t_kill,
            "restart_load": t_listen - t_spawn,
            "reattach": attached - t_listen,
            "total": attached - t_kill,
            "restarted": restarted,
        }
    finally:
        for p in procs.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        subprocess.run(["rm", "-rf", state, work])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    a = ap.parse_args()
    rows = [trial(a.agents, a.nproc) for _ in range(a.reps)]
    ms = lambda k: statistics.median(r[k] for r in rows) * 1000
    print(f"rdzvd kill -9 -> restarted -> {a.agents} agents re-attached "
          f"({a.agents}x{a.nproc} workers, {a.reps} runs, medians)")
    print(f"  kill -> every agent noticed          {ms('noticed'):8.1f} ms")
    print(f"  restart of rdzvd + load of its state {ms('restart_load'):8.1f} ms")
    print(f"  listening -> every agent re-attached {ms('reattach'):8.1f} ms")
    print(f"  kill -> every agent re-attached      {ms('total'):8.1f} ms")
    print(f"  workers restarted                    {sum(r['restarted'] for r in rows):8d}")


if __name__ == "__main__":
    sys.exit(main())
