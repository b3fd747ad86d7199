"""Rank 1 fails on the first attempt; after the restart every rank joins a gloo group."""
import os
import sys

import torch
import torch.distributed as dist

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt == 0 and os.environ["RANK"] == "1":
    sys.exit(1)
dist.init_process_group("gloo", init_method="env://")
t = torch.ones(1)
dist.all_reduce(t)
print(f"rank {dist.get_rank()} attempt {attempt} sum {int(t.item())}", flush=True)
dist.destroy_process_group()
