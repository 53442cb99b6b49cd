"""The PyTorch DDP tutorial's torchrun script, with the knobs the tests turn.

torchrun --nproc-per-node 2 ddp_tutorial.py
Environment: STEPS (40), ACCUM micro-batches per optimizer step (1; no_sync on all but the last),
BARRIER_EVERY steps a dist.barrier() (0 = never), BATCH (20), RANK1_STEPS (STEPS: rank 1 runs
fewer steps, as with uneven data per rank).
"""

import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(ToyModel())
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    steps, accum = int(os.environ.get("STEPS", "40")), int(os.environ.get("ACCUM", "1"))
    barrier_every, batch = int(os.environ.get("BARRIER_EVERY", "0")), int(os.environ.get("BATCH", "20"))
    if rank == 1:
        steps = int(os.environ.get("RANK1_STEPS", steps))
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        for micro in range(accum):
            sync = contextlib.nullcontext() if micro == accum - 1 else model.no_sync()
            with sync:
                outputs = model(torch.randn(batch, 10))  # FORWARD
                loss = loss_fn(outputs, torch.randn(batch, 5))
                loss.backward()  # BACKWARD
        optimizer.step()
        if barrier_every and step % barrier_every == 0:
            dist.barrier()  # BARRIER
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
