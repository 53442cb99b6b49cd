"""The training loop of PyTorch's DCGAN example with two DDP models and two optimizers: the
discriminator trains first (a backward on real images, one on fakes, its optimizer step), then the
generator through it (a third backward of the discriminator).

torchrun --nproc-per-node 2 dcgan_style.py
Environment: STEPS (12), BATCH (6).
"""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net_g = DDP(nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8)))
    net_d = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(net_d.parameters(), lr=1e-3)
    criterion = nn.BCEWithLogitsLoss()
    steps, batch = int(os.environ.get("STEPS", "12")), int(os.environ.get("BATCH", "6"))
    real_label, fake_label = torch.ones(batch, 1), torch.zeros(batch, 1)
    for _ in range(steps):
        net_d.zero_grad()
        err_d_real = criterion(net_d(torch.randn(batch, 8)), real_label)  # FORWARD
        err_d_real.backward()  # BACKWARD
        fake = net_g(torch.randn(batch, 4))
        err_d_fake = criterion(net_d(fake.detach()), fake_label)
        err_d_fake.backward()
        opt_d.step()
        net_g.zero_grad()
        err_g = criterion(net_d(fake), real_label)
        err_g.backward()
        opt_g.step()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
