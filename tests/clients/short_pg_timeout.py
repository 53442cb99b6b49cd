"""A DDP loop whose process group timeout (10 s) is shorter than the supervisor's hang timeout, so
gloo itself ends a hang with "Timed out waiting ... ms".

torchrun --nproc-per-node 2 short_pg_timeout.py
Every EVAL_EVERY (4) steps a validation loss is all-reduced and a barrier follows.
Environment: STEPS (12), BATCH (8), PG_TIMEOUT (10 s); STALL makes rank 1 stop at step STALL_STEP
(6) in its own code: `sleep` (600 s in Python) or `side` (in an all-reduce on a second group with
a 600 s timeout that rank 0 never joins: blocked in gloo's native wait).
"""

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def validate(model, batch):
    model.eval()
    with torch.no_grad():
        loss = model(torch.randn(batch, 10)).pow(2).mean()
    model.train()
    dist.all_reduce(loss)  # EVAL
    return loss.item() / dist.get_world_size()


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("PG_TIMEOUT", "10"))))
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch, every = int(os.environ.get("BATCH", "8")), int(os.environ.get("EVAL_EVERY", "4"))
    side = dist.new_group(timeout=timedelta(seconds=600))
    stall, stall_step = os.environ.get("STALL", ""), int(os.environ.get("STALL_STEP", "6"))
    for step in range(1, int(os.environ.get("STEPS", "12")) + 1):
        if stall and step == stall_step and dist.get_rank() == 1:
            if stall == "sleep":
                time.sleep(600)  # STALL_SLEEP
            else:
                dist.all_reduce(torch.ones(1), group=side)  # STALL_SIDE
        loss = model(torch.randn(batch, 10)).pow(2).mean()  # FORWARD
        optimizer.zero_grad()
        loss.backward()  # BACKWARD
        optimizer.step()
        if step % every == 0:
            validate(model, batch)
            dist.barrier()  # BARRIER
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
