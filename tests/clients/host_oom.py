"""A DDP loop whose rank 1 runs out of host memory: the kernel's OOM killer ends it, or its
DataLoader worker.

torchrun --nproc-per-node 2 host_oom.py
Environment: OOM_CGROUP, a memory cgroup folder with a small limit, that rank 1 moves into after
its start (so only what it allocates from then on counts against the limit); OOM_IN `rank` (rank 1
itself allocates until it is killed) or `worker` (one of its DataLoader workers does, in
`__getitem__`); OOM_STEP (5): the step where it starts; FILL_PAUSE (0): seconds between two
16 MiB chunks, as memory grows in a leak or a cache filled over seconds. STEPS (12), BATCH (8).
"""

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

CHUNK = 16 * 2**20


def use_memory_until_killed():
    held, pause = [], float(os.environ.get("FILL_PAUSE", "0"))
    while True:
        held.append(bytearray(CHUNK))  # fills every page: the memory is really used
        held[-1][::4096] = b"\x01" * (CHUNK // 4096)
        time.sleep(pause)


class Batches(Dataset):
    def __init__(self, count, batch, hungry_from):
        self.count, self.batch, self.hungry_from = count, batch, hungry_from

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        if index >= self.hungry_from:
            use_memory_until_killed()  # WORKER_OOM
        return torch.randn(self.batch, 10), torch.randn(self.batch, 5)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    steps, batch = int(os.environ.get("STEPS", "12")), int(os.environ.get("BATCH", "8"))
    where, oom_step = os.environ.get("OOM_IN", ""), int(os.environ.get("OOM_STEP", "5"))
    if rank == 1 and where:
        (Path(os.environ["OOM_CGROUP"]) / "cgroup.procs").write_text(str(os.getpid()))
    hungry_from = oom_step - 1 if rank == 1 and where == "worker" else steps
    loader = DataLoader(
        Batches(steps, batch, hungry_from), batch_size=None, num_workers=1 if where == "worker" else 0
    )
    model = DDP(nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, (x, y) in enumerate(loader, start=1):  # LOADER
        if rank == 1 and where == "rank" and step == oom_step:
            use_memory_until_killed()  # RANK_OOM
        loss = (model(x) - y).pow(2).mean()  # FORWARD
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
