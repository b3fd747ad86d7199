"""The DDP worker of bench/hosts.sh (run with /usr/bin/python3 under launch or torchrun, env://).
A tiny model on gloo; after init it prints "ready pid=<pid> world W t=<monotonic>", then one line
per step, "step N world W t=<monotonic>" (CLOCK_MONOTONIC, shared by every network namespace),
at about RATE steps per second, for STEPS steps (0: until stopped), then exits 0.
   hosts_worker.py STEPS [RATE]"""
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 0
rate = float(sys.argv[2]) if len(sys.argv) > 2 else 20.0
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
print(f"ready pid={os.getpid()} rank {rank} world {world} t={time.monotonic():.6f}", flush=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
gen = torch.Generator().manual_seed(100 + rank)
period = 1.0 / rate
n = 0
next_t = time.monotonic()
while steps == 0 or n < steps:
    x = torch.randn(32, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True)
    opt.zero_grad()
    loss = ((ddp(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    n += 1
    print(f"step {n} world {world} t={time.monotonic():.6f}", flush=True)
    next_t += period
    d = next_t - time.monotonic()
    if d > 0:
        time.sleep(d)
    else:
        next_t = time.monotonic()
dist.destroy_process_group()
