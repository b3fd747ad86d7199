"""Run as another user (runuser -u nobody) against ports of a job: torch's own TCPStore client
sets a key and reads it back on each port, in a child process bounded in time. Prints "port P
got in" only where the key came back (a set alone proves nothing: torch's client sends it and
returns), and "port P refused: ..." otherwise."""
import subprocess
import sys

CHILD = r"""
import sys
from datetime import timedelta
import torch.distributed as dist
from store_args import LIBUV
s = dist.TCPStore("127.0.0.1", int(sys.argv[1]), None, False, timedelta(seconds=5), **LIBUV)
s.set("intruder", "x")
assert s.get("intruder") == b"x"
"""

for port in sys.argv[1:]:
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, port], capture_output=True, text=True,
                           timeout=8)
        if r.returncode == 0:
            print("port %s got in" % port, flush=True)
        else:
            last = (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1]
            print("port %s refused: %s" % (port, last), flush=True)
    except subprocess.TimeoutExpired:
        print("port %s refused: no answer within 8 s" % port, flush=True)
