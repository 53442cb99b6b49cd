"""A classification script in the style of torchvision's references/classification/train.py.

torchrun --nproc-per-node 2 torchvision_style.py
DistributedSampler with set_epoch, a small conv net with BatchNorm turned into SyncBatchNorm,
bf16 autocast on CPU, an evaluation per epoch that sums correct/total over the ranks, and a
checkpoint saved by rank 0 only, then a barrier.
Environment: EPOCHS (3), BATCH (8), SAMPLES (96 per epoch, split over the ranks), CKPT_DIR (.),
SYNC_BN (0; SyncBatchNorm needs CUDA modules: on CPU DDP refuses it).
"""

import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_model():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


def train_one_epoch(model, criterion, optimizer, loader, epoch):
    model.train()
    for image, target in loader:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = model(image)  # FORWARD
            loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()  # BACKWARD
        optimizer.step()


def evaluate(model, loader):
    model.eval()
    correct = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for image, target in loader:
            output = model(image)
            correct[0] += (output.argmax(1) == target).sum()
            correct[1] += target.numel()
    dist.all_reduce(correct)  # EVAL
    return (correct[0] / correct[1]).item()


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    samples = int(os.environ.get("SAMPLES", "96"))
    data = TensorDataset(torch.randn(samples, 3, 8, 8), torch.randint(0, 10, (samples,)))
    train_sampler = DistributedSampler(data)
    test_sampler = DistributedSampler(data, shuffle=False)
    batch = int(os.environ.get("BATCH", "8"))
    train_loader = DataLoader(data, batch_size=batch, sampler=train_sampler)
    test_loader = DataLoader(data, batch_size=batch, sampler=test_sampler)
    model = make_model()
    if os.environ.get("SYNC_BN", "0") == "1":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = nn.parallel.DistributedDataParallel(model)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt_dir = os.environ.get("CKPT_DIR", ".")
    for epoch in range(int(os.environ.get("EPOCHS", "3"))):
        train_sampler.set_epoch(epoch)
        start = time.time()
        train_one_epoch(model, criterion, optimizer, train_loader, epoch)
        acc = evaluate(model, test_loader)
        if rank == 0:
            torch.save(
                {"model": model.module.state_dict(), "epoch": epoch}, os.path.join(ckpt_dir, "checkpoint.pth")
            )
            print(f"epoch {epoch} acc {acc:.3f} {time.time() - start:.2f}s", flush=True)
        dist.barrier()  # BARRIER
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
