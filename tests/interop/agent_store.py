"""TORCHELASTIC_USE_AGENT_STORE=True (launch's default): MASTER_ADDR:MASTER_PORT is the run's
store on the rendezvous server, in torch's TCPStore protocol, and every rank is its client.

Attempt 0: every rank forms the gloo group through env:// (torch's own agent-store path),
all-reduces, writes "attempt0/<rank>" straight into the store (no prefix), and rank 0 then
kills itself with SIGKILL. Attempt 1 (after the restart): the keys of attempt 0 are still
there, though the process that would have hosted torch's own store is gone; the group forms
again (torch keeps attempts apart by its /worker/attempt_N prefix) and finishes.
"""
import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist

assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True", os.environ["TORCHELASTIC_USE_AGENT_STORE"]
rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])

dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
assert t.item() == world * (world + 1) / 2, t.item()

store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                      timedelta(seconds=60), wait_for_workers=False)
if attempt == 0:
    store.set(f"attempt0/{rank}", f"from pid {os.getpid()}")
    store.wait([f"attempt0/{r}" for r in range(world)])
    dist.barrier()
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    store.wait(["never"], timedelta(seconds=120))  # stopped by the agent before that
else:
    seen = [store.get(f"attempt0/{r}").decode() for r in range(world)]
    print(f"rank {rank} attempt {attempt} agent store ok, attempt 0 left {len(seen)} keys",
          flush=True)
    dist.destroy_process_group()
