#!/usr/bin/python3
"""The replicated rendezvous on real hosts under silent faults (issue 25; bench/README.md,
"High availability on namespace hosts"). Seven namespace hosts (tests/support/hostnet): etcd
members m0..m2 on hosts 0-2, rdzvd replicas A (host 3, started first: it leads) and B (host 4),
agents on hosts 5 and 6 (`--rdzv_endpoint=A,B`, one worker each, `test_worker wait`). Faults are
silent iptables drops (no FIN, no RST):

  etcd-leader    etcd's raft leader cut from everyone (named first in --etcd)
  etcd-follower  an etcd follower cut from everyone (named first in --etcd)
  leader     the leading rdzvd's host cut from everyone
  leader-etcd  the leading rdzvd cut from the three etcd members only (agents still reach it)
  kill9      the leading rdzvd killed -9 (no silent fault: the reference row)

For each trial: seconds from the fault until both agents are served by the replica they end up
with ("re-attached ... at X", or no word at all when nothing needed to move), workers
restarted (new "ready" lines after the fault), and whether both workers of the first round
still run. The fault is healed once everything settled (or after 30 s). With --finish, then:
which replicas lead, a worker failure (exit 3), which must restart each worker exactly once
(the run's state survived the fault), then every worker released (exit 0) and both agents'
exit codes.

  bench/ha_hosts.sh [--trials N] [--only etcd-leader,etcd-follower,leader,leader-etcd,kill9]
                    [--launch P --rdzvd P] [--finish]

Each trial runs in fresh hosts (`hostnet run 7 -- ha_hosts.py --inner ...`); every time is
CLOCK_MONOTONIC, which all namespaces share.
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

BUILD = os.environ.get("BUILD", "/work/build-bench")
HOSTNET = os.path.join(BUILD, "tests/hostnet")
WORKER = os.path.join(BUILD, "tests/test_worker")
ETCD = "/usr/bin/etcd"
ETCDCTL = "/usr/bin/etcdctl"


def env_addr(i):
    return os.environ[f"HOSTNET_ADDR_{i}"]


def wrap(i):
    return os.environ[f"HOSTNET_WRAP_{i}"].split()


def ctl(*args):
    subprocess.run([os.environ["HOSTNET_CTL"], *args], check=True)


def start_etcd(tmp):
    cluster = ",".join(f"m{i}=http://{env_addr(i)}:2380" for i in range(3))
    procs = []
    for i in range(3):
        a = env_addr(i)
        argv = wrap(i) + [ETCD, f"--name=m{i}", f"--data-dir={tmp}/m{i}",
                          f"--listen-peer-urls=http://{a}:2380",
                          f"--initial-advertise-peer-urls=http://{a}:2380",
                          f"--listen-client-urls=http://{a}:2379",
                          f"--advertise-client-urls=http://{a}:2379",
                          f"--initial-cluster={cluster}", "--initial-cluster-token=ha-hosts",
                          "--initial-cluster-state=new", "--logger=zap", "--log-outputs=stderr",
                          "--log-level=warn",
                          # As etcd 3.5 does by default: a member back from a partition does not
                          # force an election (without it, its higher term stalls etcd for about
                          # 2 s after the heal, and a decision then waits for it).
                          "--pre-vote"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        procs.append(Proc(f"etcd{i}", argv, env))
    eps = ",".join(f"http://{env_addr(i)}:2379" for i in range(3))

    def healthy():
        r = subprocess.run([ETCDCTL, f"--endpoints={eps}", "endpoint", "health"],
                           capture_output=True, text=True, env=dict(os.environ, ETCDCTL_API="3"))
        return r.returncode == 0
    if not wait_until(healthy, 60, 0.2):
        raise RuntimeError("etcd not healthy within 60 s")
    return procs


def etcd_leader():
    eps = ",".join(f"http://{env_addr(i)}:2379" for i in range(3))
    r = subprocess.run([ETCDCTL, f"--endpoints={eps}", "endpoint", "status", "-w", "json"],
                       capture_output=True, text=True, env=dict(os.environ, ETCDCTL_API="3"))
    try:
        st = json.loads(r.stdout)
        leader_id = st[0]["Status"]["leader"]
        for i, s in enumerate(st):
            if s["Status"]["header"]["member_id"] == leader_id:
                return i
    except (ValueError, KeyError, IndexError):
        pass
    return -1


def inner(a):
    # On tmpfs: etcd fsyncs every write, and a disk busy with something else (another test's
    # debootstrap) would stall it for seconds, which is not the fault under trial.
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    tmp = tempfile.mkdtemp(prefix="ha_hosts_", dir=shm)
    res = {"fault": a.fault}
    procs = []
    t_fault = None
    try:
        procs += start_etcd(tmp)
        leader = wait_until(lambda: etcd_leader() + 1, 10) - 1
        res["etcd_leader"] = leader
        # The member a fault cuts is named first in --etcd, as the trials had it.
        first = leader if a.fault == "etcd-leader" else (leader + 1) % 3
        a.etcd_cut = first
        etcd = ",".join(f"{env_addr(i)}:2379" for i in [first] + [j for j in range(3) if j != first])
        reps = []
        for k, host in enumerate((3, 4)):
            argv = wrap(host) + [a.rdzvd, "--listen", "0.0.0.0:29400", "--etcd", etcd,
                                 "--advertise", f"{os.environ[f'HOSTNET_HOST_{host}']}:29400"]
            r = Proc("rdzvdA" if k == 0 else "rdzvdB", argv)
            reps.append(r)
            procs.append(r)
            want = r"rdzvd: leading after" if k == 0 else r"campaigning to lead as"
            if not wait_until(lambda: r.first(want), 30):
                raise RuntimeError(f"{r.name}: no '{want}'")
        ep = ",".join(f"{os.environ[f'HOSTNET_HOST_{h}']}:29400" for h in (3, 4))
        agents = []
        for host in (5, 6):
            argv = wrap(host) + [a.launch, "--nnodes=2", "--nproc_per_node=1",
                                 "--rdzv_backend=c10d", f"--rdzv_endpoint={ep}", "--rdzv_id=job",
                                 "--max_restarts=3", "--rdzv_conf=reattach_timeout=20",
                                 WORKER, "signals", tmp]
            p = Proc(f"agent{host}", argv)
            agents.append(p)
            procs.append(p)
        if not wait_until(lambda: all(p.first(r"\]:ready ") for p in agents), 60):
            raise RuntimeError("the job did not form")
        time.sleep(1.0)
        t_fault = time.monotonic()
        if a.fault in ("etcd-leader", "etcd-follower"):
            ctl("cut", os.environ[f"HOSTNET_NS_{first}"])
        elif a.fault == "leader":
            ctl("cut", os.environ["HOSTNET_NS_3"])
        elif a.fault == "leader-etcd":
            for i in range(3):
                ctl("cut-between", os.environ["HOSTNET_NS_3"], env_addr(i))
        elif a.fault == "kill9":
            reps[0].stop(signal.SIGKILL)
        # Settled: both agents re-attached somewhere, or nothing moved for long.
        moved = lambda: all(p.first(r"re-attached to run job round \d+ at (\S+)", t_fault)
                            for p in agents)
        wait_until(moved, a.observe)
        time.sleep(3.0)
        back = [p.first(r"re-attached to run job round \d+ at (\S+)", t_fault) for p in agents]
        res["served_s"] = (max(b[0] for b in back) - t_fault) if all(back) else None
        res["served_by"] = [b[1].group(1) for b in back] if all(back) else None
        res["restarted_workers"] = sum(len(p.all(r"\]:ready ", t_fault)) for p in agents)
        res["restart_lines"] = sum(len(p.all(r"restarting workers|lost the server", t_fault))
                                   for p in agents)
        res["agents_alive"] = all(p.p.poll() is None for p in agents)
        res["leading"] = [r.name for r in reps
                          if r.p.poll() is None and r.first(r"rdzvd: leading after", t_fault)]
        res["exited"] = [r.name for r in reps if r.p.poll() is not None]
        if a.finish:
            finish(a, reps, agents, res)
    except Exception as e:  # noqa: BLE001 (the result says what went wrong)
        res["error"] = str(e)
    finally:
        for p in procs:
            if a.logdir:
                p.dump(os.path.join(a.logdir, f"{a.tag}.{p.name}.log"), t_fault or 0.0)
        for p in reversed(procs):
            p.stop()
        subprocess.run(["rm", "-rf", tmp])
    print("RESULT " + json.dumps(res), flush=True)


def heal(a):
    fault = a.fault
    if fault in ("etcd-leader", "etcd-follower"):
        ctl("heal", os.environ[f"HOSTNET_NS_{a.etcd_cut}"])
    elif fault == "leader":
        ctl("heal", os.environ["HOSTNET_NS_3"])
    elif fault == "leader-etcd":
        for i in range(3):
            ctl("heal-between", os.environ["HOSTNET_NS_3"], env_addr(i))


def worker_pids(agents, after=0.0):
    return [int(m.group(1)) for p in agents for _, m in p.all(r"\]:ready (\d+)", after)]


def etcd_healthy():
    eps = ",".join(f"http://{env_addr(i)}:2379" for i in range(3))
    r = subprocess.run([ETCDCTL, f"--endpoints={eps}", "endpoint", "health"],
                       capture_output=True, text=True, env=dict(os.environ, ETCDCTL_API="3"))
    return r.returncode == 0


def finish(a, reps, agents, res):
    heal(a)
    t_heal = time.monotonic()
    time.sleep(3.0)  # a healed replica has its chance to (wrongly) decide
    # The failure below is to show that the run's state survived, not to test a decision made
    # while a member that just came back catches up (the leader's write waits for etcd, and its
    # agents' keep-alives with it: docs/rendezvous.md, "etcd's own failures").
    res["etcd_healthy_after_heal"] = bool(wait_until(etcd_healthy, 20, 0.2))
    time.sleep(2.0)
    res["leading_after_heal"] = [r.name for r in reps if r.p.poll() is None and
                                 r.first(r"rdzvd: leading after")]
    first = worker_pids(agents)
    # Taken before the kill: the restarted workers' "ready" lines can be read (and stamped)
    # by the reader threads before this thread runs again after os.kill.
    t_fail = time.monotonic()
    os.kill(first[0], signal.SIGUSR2)  # a worker failure: exit 3
    again = wait_until(lambda: len(worker_pids(agents, t_fail)) >= 2, 30)
    time.sleep(1.0)
    res["restarted_after_failure"] = len(worker_pids(agents, t_fail)) if again else 0
    res["restart_count_after"] = sorted(
        {m.group(1) for p in agents for _, m in p.all(r"\]:ready \d+ .* restart (\d+)", t_fail)})
    for pid in worker_pids(agents, t_fail):
        os.kill(pid, signal.SIGUSR1)
    wait_until(lambda: all(p.p.poll() is not None for p in agents), 30)
    res["agent_rcs"] = [p.p.poll() for p in agents]
    res["heal_to_end_s"] = time.monotonic() - t_heal


def outer(a):
    faults = a.only.split(",")
    os.makedirs(a.logdir, exist_ok=True)
    rows = {}
    for f in faults:
        for t in range(a.trials):
            tag = f"{f}-{t}"
            cmd = [HOSTNET, "run", "7", "--", sys.executable, __file__, "--inner", "--fault", f,
                   "--launch", a.launch, "--rdzvd", a.rdzvd, "--observe", str(a.observe),
                   "--logdir", a.logdir, "--tag", tag] + (["--finish"] if a.finish else [])
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            res = json.loads(line[-1][7:]) if line else {"error": r.stderr[-400:]}
            print(f"  {tag}: {json.dumps(res)}", flush=True)
            rows.setdefault(f, []).append(res)
    print("\n| fault | served after (median of trials) | workers restarted | trials |")
    print("|---|---|---|---|")
    for f, rs in rows.items():
        served = [r["served_s"] for r in rs if r.get("served_s") is not None]
        med = f"{statistics.median(served):.2f} s" if served else "never moved"
        restarts = "/".join(str(r.get("restarted_workers")) for r in rs)
        print(f"| {f} | {med} ({len(served)}/{len(rs)} moved) | {restarts} | {len(rs)} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--inner", action="store_true")
    ap.add_argument("--fault", default="leader")
    ap.add_argument("--only", default="etcd-leader,etcd-follower,leader,leader-etcd,kill9")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--launch", default=os.path.join(BUILD, "launcher/launch"))
    ap.add_argument("--rdzvd", default=os.path.join(BUILD, "rendezvous/rdzvd"))
    ap.add_argument("--observe", type=float, default=30.0)
    ap.add_argument("--logdir", default="/tmp/ha-hosts")
    ap.add_argument("--tag", default="trial")
    ap.add_argument("--finish", action="store_true")
    a = ap.parse_args()
    inner(a) if a.inner else outer(a)


if __name__ == "__main__":
    main()
