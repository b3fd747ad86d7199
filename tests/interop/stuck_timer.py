"""Unchanged torchrun usage of the file-timer watchdog: with TORCHELASTIC_ENABLE_FILE_TIMER=1
the agent serves TORCHELASTIC_TIMER_FILE. On the first attempt rank 1 gets stuck inside
`expires(after=1)`; the agent must kill it (SIGKILL) and restart the group. The second attempt
finishes. Prints one line per rank and attempt."""
import os
import sys
import time

import torch.distributed.elastic.timer as timer

rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
print(f"rank {rank} attempt {attempt} pid {os.getpid()}", flush=True)
with timer.expires(after=1, scope="step"):
    if attempt == 0 and rank == 1:
        time.sleep(120)  # stuck: only the watchdog ends this
print(f"rank {rank} attempt {attempt} done", flush=True)
if attempt == 0:
    time.sleep(120)  # the others wait to be stopped by the group's restart
sys.exit(0)
