"""A DDP loop whose ranks save a checkpoint when SIGTERM comes, as schedulers' preemption notices
are often handled: the handler writes the file (slowly: SAVE_SECONDS, 4 s) to a temporary name,
renames it into place and exits 0.

torchrun --nproc-per-node 2 save_on_sigterm.py
Environment: STEPS (200), CHECKPOINT_DIR (the working directory). Rank 1 stops in its own code at
step STALL_STEP (5) when STALL is set, so the job hangs with rank 1 in Python, able to save.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

SAVING = []


def save_and_exit(signum, frame):
    if SAVING:  # the launcher's own SIGTERM may follow: one save is enough
        return
    SAVING.append(signum)
    rank = os.environ.get("RANK", "0")
    folder = os.environ.get("CHECKPOINT_DIR", ".")
    partial = os.path.join(folder, f"checkpoint-{rank}.pt.partial")
    with open(partial, "w") as f:
        f.write("step weights ")
        f.flush()
        time.sleep(float(os.environ.get("SAVE_SECONDS", "4")))
        f.write("complete\n")
    os.replace(partial, os.path.join(folder, f"checkpoint-{rank}.pt"))
    sys.exit(0)


def main():
    import signal

    signal.signal(signal.SIGTERM, save_and_exit)
    dist.init_process_group("gloo")
    model = DDP(nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    stall_step = int(os.environ.get("STALL_STEP", "5"))
    for step in range(1, int(os.environ.get("STEPS", "200")) + 1):
        if os.environ.get("STALL") and step == stall_step and dist.get_rank() == 1:
            while True:
                time.sleep(0.1)  # STALL
        loss = model(torch.randn(8, 10)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
