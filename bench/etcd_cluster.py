"""A throwaway etcd cluster for the benchmarks (bench/failover.py, bench/run's formation_etcd):
Debian's etcd 3.4 (/usr/bin/etcd) members on 127.0.0.1 with etcd's default timing (heartbeat
100 ms, election 1 s), as tests/support/etcd_cluster.h starts them for the tests.

Each member gets a client and a peer port checked free (all distinct), a data dir and a log
(its stderr) in one fresh temp folder. Readiness is etcd's sd_notify "READY=1" on an abstract
unix datagram socket of ours (NOTIFY_SOCKET), sent once the member has joined the cluster; a
member that exits first fails the start with its log's tail. If a port was taken between the
check and etcd's bind, the start is tried once more with new ports. close() (also on error,
and as a context manager) ends every member by its pid and removes the folder.

    with EtcdCluster(3) as etcd:
        etcd.endpoints()   # "127.0.0.1:P0,127.0.0.1:P1,127.0.0.1:P2"
"""
import os
import select
import signal
import socket
import subprocess
import tempfile
import time

ETCD = "/usr/bin/etcd"
READY_S = 30  # every member ready (READY=1) within this


def free_ports(n):
    """n distinct ports that were free on 127.0.0.1 (held open together while picked)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class PortTaken(RuntimeError):
    pass


class EtcdCluster:
    def __init__(self, members=3):
        if not os.access(ETCD, os.X_OK):
            raise RuntimeError(f"no {ETCD} (Debian's etcd-server; scripts/setup installs it)")
        self.dir = tempfile.mkdtemp(prefix="bench_etcd_")
        self.procs = []
        self.notify = []
        self.client_ports = []
        try:
            try:
                self._start(members)
            except PortTaken:
                self._end_members()
                self._start(members)
        except BaseException:
            self.close()
            raise

    def _start(self, members):
        ports = free_ports(2 * members)
        self.client_ports = ports[:members]
        peer = ports[members:]
        token = os.path.basename(self.dir)
        cluster = ",".join(f"m{i}=http://127.0.0.1:{peer[i]}" for i in range(members))
        env = {k: v for k, v in os.environ.items()
               if not (k.startswith("ETCD_") or k.startswith("ETCDCTL_") or k == "NOTIFY_SOCKET")}
        for i in range(members):
            name = f"{token}-m{i}"
            n = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            n.bind("\0" + name)  # abstract: no path in the folder, no length limit from TMPDIR
            self.notify.append(n)
            data = os.path.join(self.dir, f"m{i}")
            log = open(os.path.join(self.dir, f"m{i}.log"), "ab")
            client = f"http://127.0.0.1:{self.client_ports[i]}"
            argv = [ETCD, f"--name=m{i}", f"--data-dir={data}",
                    f"--listen-peer-urls=http://127.0.0.1:{peer[i]}",
                    f"--initial-advertise-peer-urls=http://127.0.0.1:{peer[i]}",
                    f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
                    f"--initial-cluster={cluster}", f"--initial-cluster-token={token}",
                    "--initial-cluster-state=new", "--logger=zap", "--log-outputs=stderr",
                    "--log-level=warn"]
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                 env=dict(env, NOTIFY_SOCKET="@" + name), start_new_session=True)
            log.close()
            self.procs.append(p)
        pending = set(range(members))
        deadline = time.monotonic() + READY_S
        while pending:
            for i in list(pending):
                p = self.procs[i]
                if p.poll() is not None:
                    tail = self.log_tail(i)
                    what = f"etcd member m{i} exited with {p.returncode} before it was ready: {tail}"
                    raise PortTaken(what) if "address already in use" in tail else RuntimeError(what)
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"etcd members {sorted(pending)} not ready within {READY_S} s")
            # A member's exit is seen within 100 ms; its READY=1 at once.
            ready, _, _ = select.select([self.notify[i] for i in pending], [], [], min(left, 0.1))
            for s in ready:
                i = self.notify.index(s)
                if b"READY=1" in s.recv(256):
                    pending.discard(i)

    def endpoints(self):
        return ",".join(f"127.0.0.1:{p}" for p in self.client_ports)

    def log_tail(self, i, chars=2000):
        try:
            with open(os.path.join(self.dir, f"m{i}.log"), errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def _end_members(self):
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait()
        for s in self.notify:
            s.close()
        self.procs, self.notify = [], []
        for entry in os.listdir(self.dir):
            subprocess.run(["rm", "-rf", os.path.join(self.dir, entry)])

    def close(self):
        self._end_members()
        subprocess.run(["rm", "-rf", self.dir])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
