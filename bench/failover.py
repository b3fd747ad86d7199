#!/usr/bin/env python3
"""The leading rdzvd of two replicas on etcd dies -> the standby leads -> every agent is back
(bench/README.md, "Replicated rdzvd on etcd (issue 13)").

A 3-member etcd cluster (bench/etcd_cluster.py, etcd's default timing) is started once; each
repetition uses a fresh --etcd_prefix on it, so that no replica sees another repetition's keys.
Two `rdzvd --etcd` replicas: the first is started and leads before the second is started (it
stands by). Every output line is timestamped as read (time.monotonic, CLOCK_MONOTONIC, the clock
rdzv_sim prints in).

agents (default): a job of --agents agents x --nproc workers (tests' test_worker `signals`:
each appends a start record and waits), `--rdzv_endpoint=LEADER,STANDBY`. Once every worker
runs, the leader is killed -9 (or, in the clean-stop row, sent SIGTERM: it ends its streams and
revokes its lease, so the standby leads at once). Phases: kill -> every agent noticed (its
"re-attaches" warning); kill -> the standby won the election (its "leading" line, less the
restore it reports: the line is printed after the restore); the restore (its "restored ... in M
ms"); the "leading" line -> every agent re-attached; kill -> every agent re-attached. Then the
workers are released (SIGUSR1) and the job must exit 0 with one start record per worker.

sim: --sim_agents simulated agents (bench/rdzv_sim --reattach, in --sim_procs processes) hold a
round on the leader; it is killed -9; their streams end, each re-attaches to the next endpoint
(the standby holds the stream until it leads, then answers Attached). Phases: kill -> elected,
restore, "leading" line -> last Attached, kill -> last Attached.
"""
import argparse
import os
import re
import selectors
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from etcd_cluster import EtcdCluster  # noqa: E402
from reattach import Procs, free_port  # noqa: E402  (the --state_dir bench's line clock)

BUILD = os.environ.get("BUILD", "/work/build-bench")
LAUNCH = f"{BUILD}/launcher/launch"
RDZVD = f"{BUILD}/rendezvous/rdzvd"
WORKER = f"{BUILD}/tests/test_worker"
SIM = f"{BUILD}/bench/rdzv_sim"
STREAMS_PER_CHANNEL = 60  # as bench/run's simulate()
LEADING = r"rdzvd: leading after (\d+) ms of standby; restored (\d+) runs from etcd in (\d+) ms"


class Lines(Procs):
    def start_fed(self, name, argv):
        """start(), with a pipe to the process's stdin (rdzv_sim's "go")."""
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = p
        self.lines.setdefault(name, [])
        self.sel.register(p.stdout, selectors.EVENT_READ, [name, b""])
        return p

    def line(self, name, pattern, after=0.0):
        for t, l in self.lines.get(name, []):
            if t >= after and (m := re.search(pattern, l)):
                return t, m
        return None, None

    def end_all(self):
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def replicas(procs, etcd):
    """Starts the leader, then the standby; returns both endpoints (leader first)."""
    prefix = f"/bench/failover-{uuid.uuid4().hex[:8]}/"
    eps = []
    for k in range(2):
        port = free_port()
        ep = f"127.0.0.1:{port}"
        procs.start(f"rdzvd{k}", [RDZVD, "--listen", ep, "--etcd", etcd.endpoints(),
                                  "--etcd_prefix", prefix, "--advertise", ep])
        if k == 0:
            procs.pump(lambda: procs.first("rdzvd0", LEADING) is not None, timeout=30)
        else:
            # Standing by, and it has seen who leads.
            procs.pump(lambda: procs.first("rdzvd1", re.escape(f"rdzvd: {eps[0]} leads")) is not None,
                       timeout=30)
        eps.append(ep)
    return eps


def takeover(procs, t_kill):
    """(kill -> elected, restore, time of the "leading" line) of the standby."""
    t_lead, m = procs.line("rdzvd1", LEADING, t_kill)
    restore = int(m.group(3)) / 1000
    return t_lead - restore - t_kill, restore, t_lead


def agents_trial(etcd, agents, nproc, sig):
    procs = Lines()
    work = tempfile.mkdtemp(prefix="failover_work_")
    try:
        eps = replicas(procs, etcd)
        names = [f"agent{i}" for i in range(agents)]
        for n in names:
            procs.start(n, [LAUNCH, f"--nnodes={agents}", f"--nproc_per_node={nproc}",
                            "--rdzv_backend=c10d", f"--rdzv_endpoint={','.join(eps)}",
                            "--rdzv_id=bench", WORKER, "signals", work])
        procs.pump(lambda: all(procs.count(n, r"\]:ready ") >= nproc for n in names))
        t_kill = time.monotonic()
        os.kill(procs.procs["rdzvd0"].pid, sig)

        def back(n):
            """When agent n's workers run again under the standby: re-attached, or (refused)
            restarted, its nproc new workers ready; None before."""
            t = procs.first(n, "re-attached to run bench", t_kill)
            if t is not None:
                return t
            again = [t for t, l in procs.lines[n] if t > t_kill and re.search(r"\]:ready ", l)]
            return again[nproc - 1] if len(again) >= nproc else None
        procs.pump(lambda: all(back(n) for n in names)
                   and procs.first("rdzvd1", LEADING) is not None)
        stopped = procs.procs["rdzvd0"].wait(timeout=30)
        noticed = max(procs.first(n, "re-attaches to run bench", t_kill) for n in names)
        attached = max(back(n) for n in names)
        refused = [l for n in names for _, l in procs.lines[n] if "could not re-attach" in l]
        elected, restore, t_lead = takeover(procs, t_kill)
        # Release the workers; the job must end well, each worker started once.
        # (The last nproc of each agent: the others were stopped when a re-attach was refused.)
        pids = []
        for n in names:
            pids += [int(m.group(1)) for _, l in procs.lines[n]
                     if (m := re.search(r"\]:ready (\d+)", l))][-nproc:]
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
        for n in names:
            procs.pump(lambda: procs.procs[n].poll() is not None, timeout=30)
            if procs.procs[n].wait() != 0:
                raise RuntimeError(f"{n} exited {procs.procs[n].returncode}: {procs.lines[n][-5:]}")
        restarted = 0
        for r in range(agents * nproc):
            with open(os.path.join(work, f"starts.{r}")) as f:
                restarted += len(f.read().splitlines()) - 1
        return {"noticed": noticed - t_kill, "elected": elected, "restore": restore,
                "reattach": attached - t_lead, "total": attached - t_kill, "restarted": restarted,
                "refused": refused, "exit": stopped,
                "leader_errors": [l for _, l in procs.lines["rdzvd0"] if "error" in l]}
    finally:
        procs.end_all()
        subprocess.run(["rm", "-rf", work])


def sim_trial(etcd, agents, nprocs):
    procs = Lines()
    try:
        eps = replicas(procs, etcd)
        sims = [f"sim{k}" for k in range(nprocs)]
        # rdzvd allows 64 streams per connection (limits::kMaxConcurrentStreamsPerConnection).
        channels = max(4, -(-(agents // nprocs) // STREAMS_PER_CHANNEL))
        for k, name in enumerate(sims):
            procs.start_fed(name, [SIM, "--target", eps[0], "--reattach", ",".join(eps),
                                   "--run_id", "simfail", "--agents", str(agents // nprocs),
                                   "--max_nodes", str(agents), "--node_prefix", f"p{k}",
                                   "--channels", str(channels), "--timeout", "30"])
        procs.pump(lambda: all(procs.first(s, "^ready$") for s in sims))
        for s in sims:
            procs.procs[s].stdin.write(b"go\n")
            procs.procs[s].stdin.flush()
        procs.pump(lambda: all(procs.first(s, "last_assignment_ns|failed") for s in sims))
        if any(procs.first(s, "^failed") for s in sims):
            raise RuntimeError(f"rdzv_sim: no round: {procs.lines}")
        t_kill = time.monotonic()
        os.kill(procs.procs["rdzvd0"].pid, signal.SIGKILL)
        procs.pump(lambda: all(procs.first(s, "last_attached_ns|failed", t_kill) for s in sims)
                   and procs.first("rdzvd1", LEADING) is not None)
        results = [procs.line(s, r"first_loss_ns (\d+) last_attached_ns (\d+) retries (\d+)",
                              t_kill)[1] for s in sims]
        if None in results:
            raise RuntimeError(f"rdzv_sim: not re-attached: {[procs.lines[s][-3:] for s in sims]}")
        first_loss = min(int(m.group(1)) for m in results) / 1e9
        attached = max(int(m.group(2)) for m in results) / 1e9
        elected, restore, t_lead = takeover(procs, t_kill)
        return {"noticed": first_loss - t_kill, "elected": elected, "restore": restore,
                "reattach": attached - t_lead, "total": attached - t_kill,
                "retries": sum(int(m.group(3)) for m in results)}
    finally:
        procs.end_all()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--sim_agents", type=int, default=1000)
    ap.add_argument("--sim_procs", type=int, default=4)
    ap.add_argument("--only", choices=["agents", "clean", "sim"], action="append",
                    help="kill -9 with agents, SIGTERM with agents, kill -9 with simulated agents")
    a = ap.parse_args()
    only = a.only or ["agents", "clean", "sim"]
    print(f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')}, reps {a.reps}, medians")
    with EtcdCluster(3) as etcd:
        for kind in only:
            if kind == "sim":
                rows = [sim_trial(etcd, a.sim_agents, a.sim_procs) for _ in range(a.reps)]
            else:
                sig = signal.SIGKILL if kind == "agents" else signal.SIGTERM
                rows = [agents_trial(etcd, a.agents, a.nproc, sig) for _ in range(a.reps)]
            ms = lambda k: statistics.median(r[k] for r in rows) * 1000
            span = lambda k: (f"({min(r[k] for r in rows) * 1000:.0f}-"
                              f"{max(r[k] for r in rows) * 1000:.0f})")
            if kind == "sim":
                print(f"\nleader kill -9, {a.sim_agents} simulated agents in {a.sim_procs} processes")
            else:
                print(f"\nleader {'kill -9' if kind == 'agents' else 'SIGTERM (clean stop)'}, "
                      f"{a.agents} agents x {a.nproc} workers")
            first = "first stream end" if kind == "sim" else "every agent noticed"
            table = [(f"kill -> {first}", "noticed"),
                     ("kill -> standby elected (lease expiry + election)", "elected"),
                     ("restore of the runs from etcd", "restore"),
                     ("leading line -> every agent re-attached", "reattach"),
                     ("kill -> every agent re-attached" if kind == "sim"
                      else "kill -> every agent re-attached (or its workers restarted)", "total")]
            for label, key in table:
                print(f"  {label:58} {ms(key):8.1f} ms {span(key)}")
            if kind == "sim":
                print(f"  {'re-attach streams that ended early (all reps)':58} "
                      f"{sum(r['retries'] for r in rows):8d}")
            else:
                print(f"  {'workers restarted (all reps)':58} {sum(r['restarted'] for r in rows):8d}")
                print(f"  {'agents refused a re-attach (all reps)':58} {sum(len(r['refused']) for r in rows):8d}")
                print(f"  old leader's exit codes: {[r['exit'] for r in rows]}")
                for line in sorted({l for r in rows for l in r["refused"] + r["leader_errors"]}):
                    print(f"    {line}")
            sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
