"""TORCHELASTIC_USE_AGENT_STORE=True (launch's default): MASTER_ADDR:MASTER_PORT is the store
of this world on the rendezvous server, in torch's TCPStore protocol, and every rank is its
client.

Attempt 0: every rank forms the gloo group through env:// (torch's own agent-store path),
all-reduces, writes "attempt0/<rank>" straight into the store (no prefix), prints its
MASTER_PORT, and rank 0 then kills itself with SIGKILL. Attempt 1 (after the restart): the
store is there though the process that would have hosted torch's own store is gone, and it is
the new world's own: none of attempt 0's keys (as torch's agent means it, "a new TCPStore for
every retry"); the group forms again and finishes.
"""
import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist
from store_args import LIBUV

assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True", os.environ["TORCHELASTIC_USE_AGENT_STORE"]
rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
port = int(os.environ["MASTER_PORT"])

dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
assert t.item() == world * (world + 1) / 2, t.item()

store = dist.TCPStore(os.environ["MASTER_ADDR"], port, None, False, timedelta(seconds=60),
                      wait_for_workers=False, **LIBUV)
print(f"rank {rank} attempt {attempt} store port {port}", flush=True)
if attempt == 0:
    store.set(f"attempt0/{rank}", f"from pid {os.getpid()}")
    store.wait([f"attempt0/{r}" for r in range(world)])
    # The look attempt 1 makes does see a key that is there.
    assert store.compare_set(f"attempt0/{rank}", "absent", "x") != b"absent"
    dist.barrier()
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    store.wait(["never"], timedelta(seconds=120))  # stopped by the agent before that
else:
    # compare_set answers the expected value for a missing key (and sets nothing), the
    # present value otherwise: a look that changes nothing (torch 1.13 has no check()).
    seen = sum(store.compare_set(f"attempt0/{r}", "absent", "x") != b"absent"
               for r in range(world))
    print(f"rank {rank} attempt {attempt} agent store ok, attempt 0 left {seen} keys",
          flush=True)
    dist.destroy_process_group()
