"""--rdzv_conf use_agent_store=false (TORCHELASTIC_USE_AGENT_STORE=False): MASTER_PORT is a free
port on the group-rank-0 node, so rank 0 can (and must) host torch's own store there, as torch
does with this value."""
import os
from datetime import timedelta

import torch.distributed as dist
from store_args import LIBUV

assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "False", os.environ["TORCHELASTIC_USE_AGENT_STORE"]
rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                      is_master=(rank == 0), timeout=timedelta(seconds=60), **LIBUV)
store.set(f"rank{rank}", str(rank))
store.wait([f"rank{r}" for r in range(world)])
print(f"rank {rank} own store ok {sum(int(store.get(f'rank{r}')) for r in range(world))}", flush=True)
