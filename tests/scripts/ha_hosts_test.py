#!/usr/bin/python3
"""The replicated rendezvous under silent faults on namespace hosts (issue 25): every row of
docs/rendezvous.md's fault table, once each, through bench/ha_hosts.py's trial (seven hosts:
three etcd members, two rdzvd replicas, two agents; iptables drops, no FIN, no RST).

    ha_hosts_test.py BUILD_DIR SOURCE_DIR

For each fault it checks: no worker restarted and no agent stopped one (the workers of the
first round still run, each started once); the agents ended up served by the replica that
leads (or, for an etcd member's loss, nothing moved and both replicas stayed); after the heal
at most one replica leads; a worker failure then restarts each worker exactly once (the run's
state survived); both agents exit 0 once the workers are released. hostnet ends whatever is
left on any host by its pid and removes the hosts. How fast is bench/'s to say, not this test's.

Exits 77 (ctest: Skipped) without root, etcd or the namespace tools.
"""
import json
import os
import shutil
import subprocess
import sys

FAULTS = ["etcd-leader", "etcd-follower", "leader", "leader-etcd", "kill9"]


def main():
    build, src = sys.argv[1], sys.argv[2]
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("iptables"):
        print("ha_hosts_test: SKIPPED (needs root, ip and iptables)")
        return 77
    if not os.access("/usr/bin/etcd", os.X_OK) or not os.access("/usr/bin/etcdctl", os.X_OK):
        print("ha_hosts_test: SKIPPED (no etcd: scripts/setup installs etcd-server, etcd-client)")
        return 77
    logdir = os.path.join(build, "Testing", "ha_hosts")
    os.makedirs(logdir, exist_ok=True)
    problems = []
    for fault in FAULTS:
        cmd = [os.path.join(build, "tests/hostnet"), "run", "7", "--", sys.executable,
               os.path.join(src, "bench/ha_hosts.py"), "--inner", "--fault", fault, "--finish",
               "--launch", os.path.join(build, "launcher/launch"),
               "--rdzvd", os.path.join(build, "rendezvous/rdzvd"),
               "--logdir", logdir, "--tag", fault]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=400,
                           env=dict(os.environ, BUILD=build))
        lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        if r.returncode != 0 or not lines:
            problems.append(f"{fault}: no result (exit {r.returncode}): {r.stderr[-600:]}")
            continue
        res = json.loads(lines[-1][len("RESULT "):])
        print(f"ha_hosts_test: {fault}: {json.dumps(res)}")

        def want(ok, what):
            if not ok:
                problems.append(f"{fault}: {what} (logs: {logdir}/{fault}.*.log)")

        want("error" not in res, f"the trial failed: {res.get('error')}")
        if "error" in res:
            continue
        want(res["restarted_workers"] == 0, f"{res['restarted_workers']} workers restarted")
        want(res["restart_lines"] == 0, "an agent restarted or stopped its workers")
        want(res["agents_alive"], "an agent exited")
        if fault.startswith("etcd-"):
            want(res["served_s"] is None, "the agents moved, for an etcd member's loss")
            want(res["exited"] == [], f"replicas exited: {res['exited']}")
        else:
            want(res["served_by"] == ["node4:29400", "node4:29400"],
                 f"not both served by the new leader: {res['served_by']}")
            want(res["leading"] == ["rdzvdB"], f"leading after the fault: {res['leading']}")
        want(len(res.get("leading_after_heal", [])) <= 1,
             f"more than one replica leads after the heal: {res.get('leading_after_heal')}")
        want(res.get("restarted_after_failure") == 2 and res.get("restart_count_after") == ["1"],
             "a worker failure after the fault did not restart each worker exactly once "
             f"(restart count 1): {res.get('restarted_after_failure')}, "
             f"{res.get('restart_count_after')}")
        want(res.get("agent_rcs") == [0, 0], f"agents' exit codes: {res.get('agent_rcs')}")
    for p in problems:
        print("ha_hosts_test: " + p)
    # What CI keeps is this output, not the log folder: the failing trials' logs' last lines.
    for fault in sorted({p.split(":", 1)[0] for p in problems}):
        for name in sorted(os.listdir(logdir)):
            if name.startswith(fault + "."):
                with open(os.path.join(logdir, name), errors="replace") as f:
                    tail = f.read().splitlines()[-12:]
                print(f"ha_hosts_test: --- {name} (last lines)")
                for line in tail:
                    print("    " + line)
    if problems:
        print(f"ha_hosts_test: FAILED ({len(problems)} problems)")
        return 1
    print(f"ha_hosts_test: ok ({len(FAULTS)} faults)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
