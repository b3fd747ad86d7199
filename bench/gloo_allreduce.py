"""The peer of `comm_bench allreduce`: torch.distributed.all_reduce on gloo, float32, same sizes
and iterations; run under launch (env://). Rank 0 prints "allreduce <MiB> <bus GB/s>"."""
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method="env://")
n = dist.get_world_size()
for mib in (1, 16, 64):
    t = torch.ones(mib << 18, dtype=torch.float32)
    iters = 40 if mib == 1 else (10 if mib == 16 else 4)
    dist.all_reduce(t)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    s = (time.perf_counter() - t0) / iters
    if dist.get_rank() == 0:
        print(f"allreduce {mib} {2 * (n - 1) / n * t.numel() * 4 / s / 1e9:.3f}", flush=True)
dist.destroy_process_group()
