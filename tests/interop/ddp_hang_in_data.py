"""An unmodified DDP script (gloo, env://; nothing of muster's imported): with "stuck", rank 1
blocks forever loading the data of step 3 while the others wait for it in step 3's all-reduce.
Each rank first says whether launch's automatic progress hook is loaded."""
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

steps = int(sys.argv[1])
stuck = len(sys.argv) > 2 and sys.argv[2] == "stuck"
dist.init_process_group("gloo", init_method="env://")
rank = dist.get_rank()
print(f"rank {rank}: auto_progress={'muster_progress_auto' in sys.modules}", flush=True)
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def load_batch(step):
    if stuck and rank == 1 and step == 3:
        print(f"rank {rank}: loading step {step} forever", flush=True)
        while True:
            time.sleep(3600)
    return torch.randn(8, 4)


for step in range(steps):
    x = load_batch(step)
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
print(f"rank {rank}: done", flush=True)
dist.destroy_process_group()
