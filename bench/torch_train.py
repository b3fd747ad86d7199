"""The peer of examples/train for `bench/run --only train`: the same task and model in PyTorch
(DDP over gloo, CPU): a 64 -> 256 -> 256 -> 16 MLP (GELU, tanh approximation) learning a random
64 -> 64 (tanh) -> 16 teacher with MSE, AdamW, warm-up + cosine, 32 samples per rank per step.
Run under a launcher (env://). Rank 0 prints "final loss <L> steps <S> samples/s <N>", the
throughput over the steps after the first (as examples/train measures from its first step).
   torch_train.py STEPS [fp32|bf16]   (bf16: torch.autocast on the CPU)"""
import math
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

steps = int(sys.argv[1])
precision = sys.argv[2] if len(sys.argv) > 2 else "fp32"
dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(1)
torch.set_num_threads(1)
teacher = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Tanh(), nn.Linear(64, 16, bias=False))
student = nn.Sequential(nn.Linear(64, 256), nn.GELU(approximate="tanh"), nn.Linear(256, 256),
                        nn.GELU(approximate="tanh"), nn.Linear(256, 16))
model = nn.parallel.DistributedDataParallel(student)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
warmup, batch = 30, 32
gen = torch.Generator().manual_seed(1000 + rank)


def lr_at(step):
    if step <= warmup:
        return 3e-3 * step / warmup
    p = (step - warmup) / (steps - warmup)
    return 3e-4 + 0.5 * (3e-3 - 3e-4) * (1 + math.cos(math.pi * p))


t0 = None
for step in range(1, steps + 1):
    if step == 2:
        t0 = time.perf_counter()
    x = torch.randn(batch, 64, generator=gen)
    with torch.no_grad():
        y = teacher(x)
    for g in opt.param_groups:
        g["lr"] = lr_at(step)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = ((model(x).float() - y) ** 2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
if rank == 0:
    secs = time.perf_counter() - t0
    print(f"final loss {loss.item():.6f} steps {steps} samples/s {(steps - 1) * batch * world / secs:.0f}",
          flush=True)
dist.destroy_process_group()
