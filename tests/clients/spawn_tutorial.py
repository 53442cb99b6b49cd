"""The PyTorch DDP tutorial's multigpu.py pattern: mp.spawn, setup(rank, world_size), no launcher.

python spawn_tutorial.py
Environment: MASTER_PORT (required), STEPS (40), ACCUM (1), BARRIER_EVERY (0), BATCH (16),
START_METHOD (spawn; fork starts the workers as multiprocessing.Process does by default on Linux),
EXIT_RANK and EXIT_CODE (that rank calls sys.exit(EXIT_CODE) after its first step).
"""

import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # INIT


def train(rank, world_size):
    setup(rank, world_size)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps, accum = int(os.environ.get("STEPS", "40")), int(os.environ.get("ACCUM", "1"))
    barrier_every, batch = int(os.environ.get("BARRIER_EVERY", "0")), int(os.environ.get("BATCH", "16"))
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        for micro in range(accum):
            sync = contextlib.nullcontext() if micro == accum - 1 else model.no_sync()
            with sync:
                loss = nn.functional.mse_loss(model(torch.randn(batch, 10)), torch.randn(batch, 5))  # FORWARD
                loss.backward()  # BACKWARD
        optimizer.step()
        if step == 1 and str(rank) == os.environ.get("EXIT_RANK"):
            sys.exit(int(os.environ["EXIT_CODE"]))  # EXIT
        if barrier_every and step % barrier_every == 0:
            dist.barrier()  # BARRIER
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    world_size = 2
    method = os.environ.get("START_METHOD", "spawn")
    mp.start_processes(train, args=(world_size,), nprocs=world_size, join=True, start_method=method)
