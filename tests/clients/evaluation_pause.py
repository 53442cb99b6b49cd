"""A DDP loop that stops for an evaluation on every rank in the middle of training: no collective
and no step for EVAL seconds, while each rank either computes (MODE=compute: forwards of its own
model copy, as an FID or validation pass does) or sits blocked (MODE=block: a read that waits, as
on a stuck network file system).

torchrun --nproc-per-node 2 evaluation_pause.py
Environment: STEPS (12), AT (the step after which the evaluation runs, 4), EVAL (seconds, 10), MODE,
ONLY (a rank: only that one evaluates, the others go on to the next step and wait for it there).
"""

import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def evaluate_on_my_shard(model, seconds):
    deadline = time.time() + seconds
    score = 0.0
    with torch.no_grad():
        while time.time() < deadline:
            score += float(model.module(torch.randn(512, 64)).sum())
    return score


def wait_for_a_file_that_never_comes(seconds):
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, True)
    import select

    select.select([read_end], [], [], seconds)  # blocked, using no CPU
    os.close(read_end)
    os.close(write_end)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seconds = float(os.environ.get("EVAL", "10"))
    for step in range(1, int(os.environ.get("STEPS", "12")) + 1):
        loss = model(torch.randn(16, 64)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        only = os.environ.get("ONLY")
        if step == int(os.environ.get("AT", "4")) and (only is None or int(only) == rank):
            if os.environ.get("MODE", "compute") == "compute":
                print(f"rank {rank} evaluated: {evaluate_on_my_shard(model, seconds):.1f}", flush=True)
            else:
                wait_for_a_file_that_never_comes(seconds)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
