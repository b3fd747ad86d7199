"""A small DDP job (gloo, env://), unchanged from what one would run under torchrun: every
rank trains on its own data; DDP averages gradients, so every rank must end with the same
parameters. Prints one line per rank at the end ("rank R/W params_identical=... checksum=...
agent_store=... steps=S"); exits 3 if the parameters differ.

  ddp_train.py [STEPS]
      STEPS steps (default 5).
  ddp_train.py [STEPS] --finish_world W [--step_ms MS]
      Elastic, for the tests of a node that leaves or joins (issue 38): each rank prints
      "rank R/W joined attempt=N pid=P started=T0 t=T" once its group formed (T0: the process's
      start, before its imports) and "rank R/W step S t=T" after every step (T: the wall clock,
      for the time from a loss to the smaller world's first step). A world of W ranks trains
      STEPS steps and ends; a world of any other size trains on until its world changes under
      it (a test kills a node, cuts it off or adds one; the agents start the next world, which
      starts over from the same seed: no checkpoint is needed for what the tests check).
"""
import time

STARTED = time.time()  # before the imports: what a new process costs before torch is there

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("steps", type=int, nargs="?", default=5)
parser.add_argument("--finish_world", type=int, default=0, help="0: not elastic")
parser.add_argument("--step_ms", type=float, default=50)
args = parser.parse_args()
elastic = args.finish_world > 0

dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
if elastic:
    print(f"rank {rank}/{world} joined attempt={os.environ['TORCHELASTIC_RESTART_COUNT']} "
          f"pid={os.getpid()} started={STARTED:.3f} t={time.time():.3f}", flush=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(100 + rank)
finishing = not elastic or world == args.finish_world
step = 0
while not finishing or step < args.steps:
    x = torch.randn(32, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True)
    opt.zero_grad()
    loss = ((ddp(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    step += 1
    if elastic:
        print(f"rank {rank}/{world} step {step - 1} t={time.time():.3f}", flush=True)
        time.sleep(args.step_ms / 1000)
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.zeros_like(flat) for _ in range(world)]
dist.all_gather(gathered, flat)
same = all(torch.equal(gathered[0], t) for t in gathered)
agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")  # whose store env:// used
print(f"rank {rank}/{world} params_identical={same} checksum={flat.sum().item():.6f} "
      f"agent_store={agent_store} steps={step}", flush=True)
dist.destroy_process_group()
sys.exit(0 if same else 3)
