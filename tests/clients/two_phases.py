"""Two phases of training, each with its own process group: the first one is destroyed and a new
one is made for the second (as a script does that changes backend or re-initialises between a
pre-training and a fine-tuning phase).

torchrun --nproc-per-node 2 two_phases.py
Environment: STEPS (6 per phase), BATCH (8), PHASE2_STORE (./phase2.store: a file the
second group meets through; it must not exist before the run).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def train(model, steps, batch, phase):
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for _step in range(1, steps + 1):
        loss = ddp(torch.randn(batch, 10)).pow(2).mean()  # FORWARD
        optimizer.zero_grad()
        loss.backward()  # BACKWARD
        optimizer.step()
    dist.barrier()  # BARRIER


def main():
    steps, batch = int(os.environ.get("STEPS", "6")), int(os.environ.get("BATCH", "8"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))
    dist.init_process_group("gloo")
    train(model, steps, batch, "pretrain")
    dist.destroy_process_group()
    # torchrun's store still holds the first group's keys, under the names the new group would
    # get again: the second group meets through a file of its own
    store = os.path.abspath(os.environ.get("PHASE2_STORE", "phase2.store"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)  # PHASE 2
    train(model, steps, batch, "finetune")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
