"""A PyTorch DDP job that recovers in place under `launch --in_place` (docs/in_place_torch.md):
an MLP regression with AdamW, a warm-up then cosine learning-rate schedule and mixed precision
(bf16 autocast on the CPU with gloo; CUDA, fp16 and a GradScaler with nccl), checkpointed for
the loss of the whole job and resumed from memory otherwise:

    build/launcher/launch --standalone --nproc_per_node=4 --in_place --max_restarts=3 \\
        examples/python/ddp_in_place.py --steps 400

The lines that opt in are marked "in place". Without --in_place (or under torchrun) it is an
ordinary DDP script: a failure restarts every worker, which resumes from the checkpoint.

Each step's samples are a function of (step, rank), so a step redone after a recovery sees
the data it saw before. The per-rank batch stays when the world shrinks or grows: the global
batch is batch x world size; the schedule is a function of the step only.
"""
import argparse
import datetime
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import muster_inplace  # noqa: E402  (in place; launch also puts its folder on PYTHONPATH)


def args_of(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--checkpoint", default="", help="a file: saved every --checkpoint-every steps")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--fail-at-step", type=int, default=-1, help="test: this rank exits 3 there")
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--step-sleep-ms", type=float, default=0, help="bench: a step's extra time")
    p.add_argument("--stop-file", default="",
                   help="bench: once this file holds a step, every rank ends after that step")
    p.add_argument("--pg-timeout", type=float, default=60,
                   help="seconds a collective waits for a silent peer (gloo cannot be aborted)")
    return p.parse_args(argv)


def batch_of(step, rank, n, device):
    g = torch.Generator().manual_seed(step * 100003 + rank)
    x = torch.rand(n, 8, generator=g) * 2 - 1
    y = torch.stack([x[:, :4].sum(1), (x[:, 4:] ** 2).sum(1) - 1], dim=1)
    return x.to(device), y.to(device)


def params_digest(module):
    with torch.no_grad():
        return "%.12e" % sum(float(p.double().abs().sum()) for p in module.parameters())


def main(argv):
    muster_inplace.await_rank()  # in place: a warm spare (launch --spares) waits here for a rank
    a = args_of(argv)
    cuda = a.backend == "nccl"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(1234)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, a.hidden), torch.nn.GELU(),
                                torch.nn.Linear(a.hidden, a.hidden), torch.nn.GELU(),
                                torch.nn.Linear(a.hidden, 2)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)

    def lr_at(step):
        if step < a.warmup:
            return (step + 1) / a.warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    scaler = torch.cuda.amp.GradScaler() if cuda else None
    start = 0
    if a.checkpoint and os.path.exists(a.checkpoint):  # the whole job was lost: from the file
        ck = torch.load(a.checkpoint, map_location=device)
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        if scaler is not None and ck.get("scaler"):
            scaler.load_state_dict(ck["scaler"])
        start = ck["step"] + 1
        print("rank %s: resuming from the checkpoint at step %d" % (os.environ.get("RANK", "?"), start),
              flush=True)

    # in place: the process group, DDP and the recovery (instead of init_process_group + DDP)
    job = muster_inplace.Job(model, optimizer, scheduler=scheduler, scaler=scaler,
                             start_step=start, backend=a.backend, device=device,
                             timeout=datetime.timedelta(seconds=a.pg_timeout))
    amp = dict(device_type="cuda", dtype=torch.float16) if cuda else dict(device_type="cpu", dtype=torch.bfloat16)
    loss = torch.zeros(())
    seen_round = job.round
    first = True
    steps_done, stop_at = a.steps, None
    for step in job.steps(a.steps):  # in place: steps given again after a recovery
        if first and job.rank == 0:
            print("rank 0: starting at step %d (%d ranks)" % (step, job.world_size), flush=True)
        first = False
        if job.round != seen_round:  # a recovery happened: every rank holds the same state
            seen_round = job.round
            print("rank %d: round %d params %s at step %d" % (job.rank, job.round, params_digest(model), step),
                  flush=True)
        with job.step():  # in place: a failed collective here is a world change
            if step == a.fail_at_step and job.rank == a.fail_rank and job.recoveries == 0 and \
                    int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
                print("rank %d: failing at step %d as asked" % (job.rank, step), flush=True)
                os._exit(3)
            x, y = batch_of(step, job.rank, a.batch, device)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(**amp):
                loss = F.mse_loss(job.model(x).float(), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            scheduler.step()
            if a.step_sleep_ms > 0:
                time.sleep(a.step_sleep_ms / 1000)  # stands for a bigger model's compute
        if job.rank == 0 and step % a.log_every == 0:
            print("step %d: loss %.6f lr %.2e (%d ranks)" % (step, loss.item(), scheduler.get_last_lr()[0],
                                                           job.world_size), flush=True)
        if a.checkpoint and job.rank == 0 and step % a.checkpoint_every == a.checkpoint_every - 1:
            tmp = a.checkpoint + ".tmp"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "scaler": scaler.state_dict() if scaler is not None else None, "step": step}, tmp)
            os.replace(tmp, a.checkpoint)
        if a.stop_file and stop_at is None and os.path.exists(a.stop_file):
            with open(a.stop_file) as f:
                stop_at = int(f.read())
        if stop_at is not None and step >= stop_at:
            steps_done = step + 1
            break
    print("rank %d: final loss %.6f steps %d params %s" % (job.rank, loss.item(), steps_done, params_digest(model)),
          flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
