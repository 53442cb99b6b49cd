"""A script written for the legacy launcher: `python -m torch.distributed.launch --use-env`, which
sets LOCAL_RANK in the environment (without --use-env it passes --local-rank instead).

python -m torch.distributed.launch --use-env --nproc-per-node 2 legacy_launch.py [--local-rank N]
Environment: STEPS (40), BATCH (16).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--local-rank", "--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0"))
    )
    args = parser.parse_args()
    dist.init_process_group("gloo", init_method="env://")
    torch.manual_seed(args.local_rank)
    model = DDP(nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 5)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps, batch = int(os.environ.get("STEPS", "40")), int(os.environ.get("BATCH", "16"))
    for _ in range(steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(torch.randn(batch, 10)), torch.randn(batch, 5))  # FORWARD
        loss.backward()  # BACKWARD
        optimizer.step()
    dist.destroy_process_group()
    print(f"rank {dist.get_rank() if dist.is_initialized() else args.local_rank} done", flush=True)


if __name__ == "__main__":
    main()
