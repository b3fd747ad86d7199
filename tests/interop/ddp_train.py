"""A small DDP job (gloo, env://), unchanged from what one would run under torchrun: every
rank trains on its own data; DDP averages gradients, so every rank must end with the same
parameters. Prints one line per rank; exits 3 if the parameters differ."""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(100 + rank)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
for _ in range(steps):
    x = torch.randn(32, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True)
    opt.zero_grad()
    loss = ((ddp(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.zeros_like(flat) for _ in range(world)]
dist.all_gather(gathered, flat)
same = all(torch.equal(gathered[0], t) for t in gathered)
agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")  # whose store env:// used
print(f"rank {rank}/{world} params_identical={same} checksum={flat.sum().item():.6f} "
      f"agent_store={agent_store}", flush=True)
dist.destroy_process_group()
sys.exit(0 if same else 3)
