"""A plain DDP-style user script (no sddoctor API): compute, then one all_reduce per step.

Environment: STEPS (default 20), PAUSE seconds of "compute" per step (default 0.05).
"""

import os
import time

import torch
import torch.distributed as dist

steps = int(os.environ.get("STEPS", "20"))
pause = float(os.environ.get("PAUSE", "0.05"))
dist.init_process_group("gloo")
rank = dist.get_rank()
x = torch.ones(8)
for _ in range(steps):
    time.sleep(pause)
    y = x * (rank + 1)
    dist.all_reduce(y)  # COLLECTIVE
dist.barrier()
dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
