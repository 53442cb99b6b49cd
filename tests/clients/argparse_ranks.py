"""Ranks started by hand (a shell script, a cluster's job script): each process is given its rank
and the world size on the command line and meets the others through an explicit init_method.

python argparse_ranks.py --rank R --world-size 2 --init-method tcp://127.0.0.1:PORT
(or file:///tmp/some-file); see launch_ranks.sh. Environment: STEPS (40), BATCH (16).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def parse():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--steps", type=int, default=int(os.environ.get("STEPS", "40")))
    parser.add_argument("--batch", type=int, default=int(os.environ.get("BATCH", "16")))
    return parser.parse_args()


def main():
    args = parse()
    dist.init_process_group("gloo", init_method=args.init_method, rank=args.rank, world_size=args.world_size)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 5)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(args.steps):
        optimizer.zero_grad()
        inputs, targets = torch.randn(args.batch, 10), torch.randn(args.batch, 5)
        loss = nn.functional.mse_loss(model(inputs), targets)  # FORWARD
        loss.backward()  # BACKWARD
        optimizer.step()
    dist.destroy_process_group()
    print(f"rank {args.rank} done", flush=True)


if __name__ == "__main__":
    main()
