"""A Python worker that hangs (tests/integration/hang_test.cc): every rank reports steps
through muster_progress; at step 3 rank 1 sleeps forever in wait_for_batch_forever() while the
others go on into the step's all_reduce and wait there."""
import os
import time

import muster_progress


def wait_for_batch_forever():
    while True:
        time.sleep(1000)


def wait_in_all_reduce():
    while True:
        time.sleep(1000)


rank = int(os.environ["RANK"])
for step in range(10):
    muster_progress.step(step, "data_loader")
    if step == 3 and rank == 1:
        print(f"rank {rank}: hanging at step {step}", flush=True)
        wait_for_batch_forever()
    muster_progress.step(step, "all_reduce")
    if step == 3:
        wait_in_all_reduce()
