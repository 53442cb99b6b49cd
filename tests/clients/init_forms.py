"""A plain DDP script whose process group starts in one of the forms users write: with no backend
(torch picks the default of each device type), with a device-to-backend string, or plainly gloo.

torchrun --nproc-per-node 2 init_forms.py
torchrun --nnodes 1 --node-rank 0 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port PORT init_forms.py
Environment: INIT (default: `init_process_group()`; cpu-gloo: `init_process_group("cpu:gloo")`;
gloo: `init_process_group("gloo")`), STEPS (30), BATCH (16), ACCUM (1: micro-batches per optimizer
step, no_sync on all but the last).
"""

import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def setup():
    form = os.environ.get("INIT", "default")
    if form == "default":
        dist.init_process_group()
    elif form == "cpu-gloo":
        dist.init_process_group("cpu:gloo")
    else:
        dist.init_process_group("gloo")


def main():
    setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    steps, batch = int(os.environ.get("STEPS", "30")), int(os.environ.get("BATCH", "16"))
    accum = int(os.environ.get("ACCUM", "1"))
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 5)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    torch.manual_seed(rank)
    for _step in range(1, steps + 1):
        optimizer.zero_grad()
        for micro in range(accum):
            sync = contextlib.nullcontext() if micro == accum - 1 else model.no_sync()
            with sync:
                out = model(torch.randn(batch, 10))  # FORWARD
                loss = nn.functional.mse_loss(out, torch.randn(batch, 5))
                loss.backward()  # BACKWARD
        optimizer.step()
    if rank == 0:
        print(f"backend {dist.get_backend()} world {world} steps {steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
