"""A DDP loop in which one rank freezes: its process stops (SIGSTOP, as Ctrl-Z or a debugger
would), or its main thread calls native code that keeps the GIL, so that no Python thread of the
process runs again. The peers wait in the next gradient all-reduce.

torchrun --nproc-per-node 2 frozen_rank.py
Environment: FREEZE (stop | gil), FREEZE_RANK (1), FREEZE_AT (step, 3), STEPS (200), PAUSE
(seconds between steps, 0.02).
"""

import ctypes
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def hold_the_gil(seconds: int) -> None:
    libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held for the whole call
    libc.sleep(seconds)  # GIL HELD


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(10, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    freeze, freeze_rank = os.environ.get("FREEZE", "stop"), int(os.environ.get("FREEZE_RANK", "1"))
    freeze_at, steps = int(os.environ.get("FREEZE_AT", "3")), int(os.environ.get("STEPS", "200"))
    pause = float(os.environ.get("PAUSE", "0.02"))
    for step in range(1, steps + 1):
        if rank == freeze_rank and step == freeze_at:
            if freeze == "gil":
                hold_the_gil(600)
            else:
                os.kill(os.getpid(), signal.SIGSTOP)  # STOPPED
        loss = model(torch.randn(8, 10)).sum()  # FORWARD
        loss.backward()  # BACKWARD
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(pause)
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
