"""Training that saves and reloads the DDP model with torch.distributed.checkpoint (DCP) midway.

torchrun --nproc-per-node 2 dcp_checkpoint.py
DCP plans the save on every rank and agrees on it with collectives of its own (gather_object,
broadcast_object_list, barriers). Environment: STEPS (12), SAVE_AT (every 4 steps), BATCH (8),
CKPT_DIR (./dcp_ckpt).
"""

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps, save_at = int(os.environ.get("STEPS", "12")), int(os.environ.get("SAVE_AT", "4"))
    batch = int(os.environ.get("BATCH", "8"))
    ckpt_dir = os.environ.get("CKPT_DIR", "dcp_ckpt")
    for step in range(1, steps + 1):
        loss = model(torch.randn(batch, 16)).pow(2).mean()  # FORWARD
        optimizer.zero_grad()
        loss.backward()  # BACKWARD
        optimizer.step()
        if step % save_at == 0:
            state = {"model": model.state_dict()}
            dcp.save(state, checkpoint_id=os.path.join(ckpt_dir, f"step{step}"))  # SAVE
            dcp.load(state, checkpoint_id=os.path.join(ckpt_dir, f"step{step}"))  # LOAD
            model.load_state_dict(state["model"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
