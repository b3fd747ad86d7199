"""A PyTorch DistributedDataParallel job as one would write it for torchrun (gloo on the CPU,
init_method env://), to run under launch unchanged:

    build/launcher/launch --standalone --nproc_per_node=4 --max_restarts=3 examples/python/ddp.py

Each rank fits y = 3x - 1 on its own samples; DDP averages the gradients, so every rank ends
with the same weights. Rank 0 prints the loss every 20 steps and the fitted line at the end.
"""
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(1234)  # the same initial weights on every rank
model = DistributedDataParallel(torch.nn.Linear(1, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
samples = torch.Generator().manual_seed(rank)
steps = int(os.environ.get("DDP_EXAMPLE_STEPS", "100"))
for step in range(steps):
    x = torch.rand(64, 1, generator=samples) * 2 - 1
    loss = torch.nn.functional.mse_loss(model(x), 3 * x - 1)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if rank == 0 and step % 20 == 0:
        print(f"step {step}: loss {loss.item():.4f} ({world} ranks)", flush=True)
w, b = model.module.weight.item(), model.module.bias.item()
if rank == 0:
    print(f"fitted y = {w:.3f}x {b:+.3f} on {world} ranks", flush=True)
dist.destroy_process_group()
