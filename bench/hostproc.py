"""What the namespace-host benches share (bench/ha_hosts.py, bench/blips.py, bench/hosts.py): a
process whose output lines are kept with the time each was read (time.monotonic, the
CLOCK_MONOTONIC every network namespace shares), and waiting for a condition."""
import os
import re
import signal
import subprocess
import threading
import time


# Where a bench finds the tree and its build, and how a command runs inside host i of a
# `hostnet run` (its HOSTNET_WRAP_<i> prefix).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("BUILD", "/work/main/build")
TORCHRUN = os.environ.get("TORCHRUN", os.path.join(ROOT, "..", "shared", "peer", "torchrun311"))


def wrap(i):
    return os.environ[f"HOSTNET_WRAP_{i}"].split()


class Proc:
    """A process (in a host, through its HOSTNET_WRAP_<i> prefix); stdout and stderr together."""

    def __init__(self, name, argv, env=None):
        self.name = name
        self.lines = []  # (t, text)
        self.lock = threading.Lock()
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for raw in iter(self.p.stdout.readline, b""):
            with self.lock:
                self.lines.append((time.monotonic(), raw.decode(errors="replace").rstrip("\n")))

    def all(self, pattern, after=0.0):
        """(t, match) of every line read at or after `after` that matches `pattern`."""
        rx = re.compile(pattern)
        with self.lock:
            return [(t, m) for t, text in self.lines if t >= after for m in [rx.search(text)] if m]

    def first(self, pattern, after=0.0):
        r = self.all(pattern, after)
        return r[0] if r else None

    def count(self, pattern, after=0.0):
        return len(self.all(pattern, after))

    def stop(self, sig=signal.SIGTERM):
        """Ends the process by its pid (`sig`, then SIGKILL after 30 s) and reaps it."""
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()

    def dump(self, path, since=0.0):
        with open(path, "w") as f, self.lock:
            for t, text in self.lines:
                f.write(f"{t - since:+9.3f} {text}\n")


def wait_until(pred, timeout, poll=0.02):
    """pred()'s first true value within `timeout` seconds, else its last value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(poll)
    return pred()
