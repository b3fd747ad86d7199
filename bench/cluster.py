#!/usr/bin/python3
"""launch --hosts against today's way (one ssh per host, each starting torchrun), on
network-namespace hosts running Debian's sshd. Run through bench/cluster.sh, which runs this
inside `hostnet run 4` (host 0: the head node the command is typed on; hosts 1-3: the job).

Measured, per repetition, for a 3-host job of 2 workers per host:
  start   command -> job over, workers /bin/true (ssh logins, rendezvous, workers, exit)
  stop    Ctrl-C (SIGINT) of the launching command(s) while the workers run /bin/sleep:
          seconds until no host runs anything of the job, and what is left 10 s after
"""
import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("BUILD", "/work/build-bench")
LAUNCH = os.path.join(BUILD, "launcher/launch")
TORCHRUN = os.path.realpath(os.environ.get("TORCHRUN", os.path.join(ROOT, "..", "shared/peer/torchrun311")))
JOB_HOSTS = [1, 2, 3]
NPROC = 2


def wrap(i):
    return os.environ[f"HOSTNET_WRAP_{i}"].split()


def host(i):
    return os.environ[f"HOSTNET_HOST_{i}"]


def ns_pids(i):
    out = subprocess.run(["ip", "netns", "pids", os.environ[f"HOSTNET_NS_{i}"]],
                         capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def exe(pid):
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return ""


def job_pids(i, sshd):
    """What runs in host i besides its sshd and sshd's session processes."""
    return [p for p in ns_pids(i) if p != sshd[i] and exe(p) not in ("sshd", "")]


class Sshd:
    def __init__(self, tmp):
        self.tmp = tmp
        run = lambda *a: subprocess.run(a, check=True, capture_output=True)
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{tmp}/client")
        os.makedirs("/run/sshd", exist_ok=True)
        known = []
        self.pids = {}
        for i in JOB_HOSTS:
            run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{tmp}/host{i}")
            with open(f"{tmp}/host{i}.pub") as f:
                known.append(f"{host(i)},{os.environ[f'HOSTNET_ADDR_{i}']} {f.read().strip()}")
            with open(f"{tmp}/sshd_config_{i}", "w") as f:
                f.write(f"Port 22\nListenAddress 0.0.0.0\nHostKey {tmp}/host{i}\n"
                        f"AuthorizedKeysFile {tmp}/client.pub\nPidFile none\nUsePAM no\n"
                        "StrictModes no\nPermitRootLogin prohibit-password\n"
                        "PasswordAuthentication no\nKbdInteractiveAuthentication no\n")
            log = open(f"{tmp}/sshd{i}.log", "w")
            p = subprocess.Popen(wrap(i) + ["/usr/sbin/sshd", "-D", "-e", "-f", f"{tmp}/sshd_config_{i}"],
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=log)
            self.pids[i] = p.pid
            self.procs = getattr(self, "procs", []) + [p]
        with open(f"{tmp}/known_hosts", "w") as f:
            f.write("\n".join(known) + "\n")
        self.config = f"{tmp}/ssh_config"
        with open(self.config, "w") as f:
            f.write(f"Host *\n  User root\n  IdentityFile {tmp}/client\n  IdentitiesOnly yes\n"
                    f"  UserKnownHostsFile {tmp}/known_hosts\n  GlobalKnownHostsFile /dev/null\n"
                    "  StrictHostKeyChecking yes\n  BatchMode yes\n  LogLevel ERROR\n")
        for i in JOB_HOSTS:  # ready when the banner comes
            deadline = time.monotonic() + 15
            while True:
                try:
                    with socket.create_connection((os.environ[f"HOSTNET_ADDR_{i}"], 22), 1) as s:
                        if s.recv(4).startswith(b"SSH-"):
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    sys.exit(f"sshd in host {i} did not come up")
                time.sleep(0.05)

    def close(self):
        for p in self.procs:
            p.terminate()
            p.wait()


def launch_cmd(ssh, program):
    hosts = ",".join(host(i) for i in JOB_HOSTS)
    return [wrap(0) + [LAUNCH, "--hosts", hosts, f"--nproc_per_node={NPROC}",
                       f"--ssh_args=-F {ssh.config}"] + program]


def torchrun_cmds(ssh, program, run_id):
    # Today's way: an ssh per host from the head node, each starting torchrun; the rendezvous is
    # hosted by the agent on the first job host (torchrun's c10d rule).
    ep = f"{host(JOB_HOSTS[0])}:29400"
    return [wrap(0) + ["ssh", "-F", ssh.config, "-T", host(i), TORCHRUN, f"--nnodes={len(JOB_HOSTS)}",
                       f"--nproc_per_node={NPROC}", "--rdzv_backend=c10d", f"--rdzv_endpoint={ep}",
                       f"--rdzv_id={run_id}", "--monitor_interval=0.1", "--no_python"] + program
            for i in JOB_HOSTS]


def start(cmds):
    return [subprocess.Popen(c, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL) for c in cmds]


def time_start(cmds):
    t0 = time.monotonic()
    procs = start(cmds)
    rcs = [p.wait(timeout=120) for p in procs]
    if any(rcs):
        sys.exit(f"a job failed: {rcs} ({cmds[0][:6]}...)")
    return time.monotonic() - t0


def time_stop(cmds, ssh):
    procs = start(cmds)
    deadline = time.monotonic() + 120
    while sum(1 for i in JOB_HOSTS for p in job_pids(i, ssh.pids) if exe(p) == "sleep") < \
            NPROC * len(JOB_HOSTS):
        if time.monotonic() > deadline:
            sys.exit("the workers did not start")
        time.sleep(0.02)
    t0 = time.monotonic()
    for p in procs:  # Ctrl-C in a terminal: SIGINT to the foreground command(s)
        p.send_signal(2)
    gone = None
    while time.monotonic() - t0 < 10:
        if not any(job_pids(i, ssh.pids) for i in JOB_HOSTS):
            gone = time.monotonic() - t0
            break
        time.sleep(0.02)
    left = {i: job_pids(i, ssh.pids) for i in JOB_HOSTS}
    n_left = sum(len(v) for v in left.values())
    kinds = sorted({exe(p) for v in left.values() for p in v})
    for v in left.values():  # what Ctrl-C left behind, ended by pid
        for p in v:
            try:
                os.kill(p, 9)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return gone, n_left, kinds


def median_range(xs):
    return f"{statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ssh = Sshd(tmp)
        try:
            res = {"launch": {"start": [], "stop": []}, "torchrun": {"start": [], "stop": []}}
            for r in range(args.reps):
                res["launch"]["start"].append(time_start(launch_cmd(ssh, ["/bin/true"])))
                res["torchrun"]["start"].append(time_start(torchrun_cmds(ssh, ["/bin/true"], f"s{r}")))
                res["launch"]["stop"].append(time_stop(launch_cmd(ssh, ["/bin/sleep", "600"]), ssh))
                res["torchrun"]["stop"].append(
                    time_stop(torchrun_cmds(ssh, ["/bin/sleep", "600"], f"t{r}"), ssh))
        finally:
            ssh.close()
    print(f"3 hosts x {NPROC} workers over ssh, {args.reps} repetitions (median, range)")
    print("| | launch --hosts | ssh + torchrun per host | ratio |")
    print("|---|---|---|---|")
    ls, ts = res["launch"]["start"], res["torchrun"]["start"]
    print(f"| command -> job over (/bin/true) | {median_range(ls)} | {median_range(ts)} | "
          f"{statistics.median(ts) / statistics.median(ls):.1f}x |")
    for name in ("launch", "torchrun"):
        stops = res[name]["stop"]
        gone = [g for g, _, _ in stops if g is not None]
        left = [n for _, n, _ in stops]
        kinds = sorted({k for _, _, ks in stops for k in ks})
        print(f"| Ctrl-C, {name}: hosts clean after | "
              f"{median_range(gone) if gone else 'never (10 s)'} in {len(gone)} of {len(stops)} | "
              f"processes left after 10 s: {sorted(left)} {kinds if kinds else ''} | |")


if __name__ == "__main__":
    main()
