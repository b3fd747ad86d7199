"""An unmodified elastic DDP job (gloo, env://, no muster module) for the tests of a node that
leaves or joins: each rank prints "rank R/W step S t=T" after every step (T: the wall clock,
for the time from a loss to the smaller world's first step; "joined" gives the time the
process started, before its imports, and the time its group formed). A world of --finish_world ranks
trains --steps steps, checks that every rank holds the same parameters and exits (3 if they
differ); a world of any other size trains on until its world changes under it (a test kills a
node, cuts it off, or adds one; the agents then start the next world). The data of a rank is a
function of rank and step, the start is the same seed everywhere, so a new world starts over
from the same model: no checkpoint is needed for what the tests check."""
import time

STARTED = time.time()  # before the imports: what a new process costs before torch is there

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--finish_world", type=int, required=True)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--step_ms", type=float, default=50)
args = parser.parse_args()

dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"rank {rank}/{world} joined attempt={attempt} pid={os.getpid()} started={STARTED:.3f} "
      f"t={time.time():.3f}", flush=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
finishing = world == args.finish_world
step = 0
while not finishing or step < args.steps:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(32, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True)
    opt.zero_grad()
    loss = ((ddp(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    print(f"rank {rank}/{world} step {step} t={time.time():.3f}", flush=True)
    step += 1
    time.sleep(args.step_ms / 1000)
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.zeros_like(flat) for _ in range(world)]
dist.all_gather(gathered, flat)
same = all(torch.equal(gathered[0], t) for t in gathered)
print(f"rank {rank}/{world} done steps={step} params_identical={same} "
      f"checksum={flat.sum().item():.6f}", flush=True)
dist.destroy_process_group()
sys.exit(0 if same else 3)
