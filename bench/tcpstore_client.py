"""The peer of `comm_bench store`: N set+get pairs on torch.distributed.TCPStore.
   tcpstore_client.py server PORT      hosts the store, prints "ready", waits for stdin to close
   tcpstore_client.py client PORT N ID connects, prints "ready", waits for a line on stdin,
                                       then prints "store <ops> <seconds>" """
import sys
import time
from datetime import timedelta

from torch.distributed import TCPStore

if sys.argv[1] == "server":
    store = TCPStore("127.0.0.1", int(sys.argv[2]), is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=60))
    print("ready", flush=True)
    sys.stdin.read()
else:
    port, n, ident = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    value = b"v" * 16
    store.set(f"{ident}/warm", value)
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    for i in range(n):
        key = f"{ident}/{i}"
        store.set(key, value)
        store.get(key)
    print(f"store {2 * n} {time.perf_counter() - t0:.6f}", flush=True)
