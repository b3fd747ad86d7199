"""A worker of a token-protected job (security_test, issue 40): torch's env:// store is its
agent's loopback listener; the worker forms the gloo group, writes and reads a key of its own
through torch's own TCPStore client, says so, and stays until the test writes to the FIFO
named by argv[1] (the test looks at the job's listeners meanwhile)."""
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from store_args import LIBUV

rank = int(os.environ["RANK"])
assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
t = torch.tensor([1.0])
dist.all_reduce(t)
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                      timedelta(seconds=30), **LIBUV)
store.set("mine/%d" % rank, "rank %d" % rank)
assert store.get("mine/%d" % rank) == b"rank %d" % rank
print("rank %d store ok port %s world %d" % (rank, os.environ["MASTER_PORT"], int(t.item())),
      flush=True)
if rank == 0:
    with open(sys.argv[1]) as fifo:
        fifo.read()
dist.barrier()
