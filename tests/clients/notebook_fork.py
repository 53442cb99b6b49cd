"""A notebook-style DDP run: the parent has already imported torch.distributed (a notebook cell
checked `dist.is_available()`), then starts the workers itself with start_method="fork".

python notebook_fork.py
Environment: MASTER_PORT (required), STEPS (40), BATCH (16), MODE: "fork" (default:
torch.multiprocessing.start_processes(..., start_method="fork")) or "nojoin" (mp.spawn(join=False)
then the returned context's join loop, as a notebook that polls its workers does).
"""

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

print(f"distributed available: {dist.is_available()}", flush=True)  # the notebook's first cell


def train(rank, world_size, steps, batch):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 5)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(torch.randn(batch, 10)), torch.randn(batch, 5))  # FORWARD
        loss.backward()  # BACKWARD
        optimizer.step()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


def run(world_size=2):
    args = (world_size, int(os.environ.get("STEPS", "40")), int(os.environ.get("BATCH", "16")))
    if os.environ.get("MODE", "fork") == "nojoin":
        context = mp.spawn(train, args=args, nprocs=world_size, join=False)
        while not context.join(timeout=0.5):  # JOIN
            time.sleep(0.1)
    else:
        mp.start_processes(train, args=args, nprocs=world_size, start_method="fork")  # START


if __name__ == "__main__":
    run()
