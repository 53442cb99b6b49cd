"""Aspect-ratio buckets: images of mixed sizes trained near their own shape, a batch per bucket.

With `data.buckets = true` (as kohya's sd-scripts do it): the buckets are every width W from
`bucket_min` to `bucket_max` in steps of `bucket_step`, with the largest height H (same step,
same bounds) such that W x H <= resolution^2, and the transposes. Each image goes to the bucket
whose aspect ratio is nearest its own (by log ratio), is resized to cover it and cropped to it
(centred, or a random crop drawn from (seed, epoch, index) like the square path). So every
bucket has about resolution^2 pixels, and memory per image, which the micro-batch and the OOM
guard's fallback count in images, is about the same whatever the bucket.

`BucketBatchSampler` (a DataLoader batch sampler) makes each step's batch from one bucket. Per
epoch and on every rank alike: each bucket's items are shuffled (seed + epoch), cut into global
batches of (per-rank batch x world size) items (a bucket's remainder waits for the next epoch's
shuffle), and the global batches are shuffled; rank r takes every world-size-th item of a global
batch. So at every step all ranks train the same bucket with the same number of images (DDP's
all-reduce sees the same step on every rank), and the state is the epoch and the samples
consumed, which a checkpoint saves and a resume restores exactly (`state_dict` as
trainer.data.ResumableDistributedSampler's).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from PIL import Image
from torch.utils.data import DataLoader, Sampler

from trainer.data import (
    AugmentedDataset,
    DataConfig,
    DataError,
    EpochPosition,
    SampleKey,
    build_dataloader,
)

Size = tuple[int, int]  # (width, height) in pixels


def bucket_bounds(cfg: DataConfig, model_step: int) -> tuple[int, int, int]:
    """(step, shortest side, longest side) with the automatic (0) values filled in."""
    step = cfg.bucket_step or model_step
    low = cfg.bucket_min or max(step, cfg.resolution // 2 // step * step)
    high = cfg.bucket_max or cfg.resolution * 2 // step * step
    return step, low, high


def check_bucket_settings(cfg: DataConfig, model_step: int) -> None:
    """DataError when the bucket settings cannot give the model usable shapes."""
    step, low, high = bucket_bounds(cfg, model_step)
    if step % model_step:
        raise DataError(
            f"data.bucket_step={step} is not a multiple of {model_step}, the smallest side step this model "
            f"takes (VAE x UNet downsampling); use a multiple of {model_step} or 0"
        )
    if low % step or high % step or low > cfg.resolution or high < cfg.resolution:
        raise DataError(
            f"buckets from {low} to {high} px in steps of {step} do not fit data.resolution={cfg.resolution}: "
            "data.bucket_min and data.bucket_max must be multiples of data.bucket_step around the resolution "
            "(0 takes resolution/2 and resolution*2)"
        )


def bucket_sizes(resolution: int, step: int, low: int, high: int) -> list[Size]:
    """Every (W, H), W and H multiples of `step` in [low, high], H the largest with W x H <= resolution^2."""
    area = resolution * resolution
    sizes = set()
    for width in range(low, high + 1, step):
        height = min(high, area // width // step * step)
        if height >= low:
            sizes.add((width, height))
            sizes.add((height, width))
    return sorted(sizes, key=lambda s: (s[0] / s[1], s))


def nearest_bucket(size: Size, buckets: Sequence[Size]) -> int:
    """Index of the bucket whose aspect ratio is nearest `size`'s (log ratio; ties: the larger area)."""
    ratio = math.log(size[0] / size[1])
    return min(
        range(len(buckets)),
        key=lambda i: (abs(math.log(buckets[i][0] / buckets[i][1]) - ratio), -buckets[i][0] * buckets[i][1]),
    )


def image_size(path: Any) -> Size:
    """(width, height) from the image's header (no pixel decode)."""
    with Image.open(path) as image:
        return image.size


def assign_buckets(dataset: AugmentedDataset, cfg: DataConfig, model_step: int) -> list[Size]:
    """Give every item of `dataset` its bucket (dataset.target_sizes); returns the bucket list."""
    check_bucket_settings(cfg, model_step)
    buckets = bucket_sizes(cfg.resolution, *bucket_bounds(cfg, model_step))
    records = getattr(dataset, "records", None)
    if records is None:  # the built-in digits: squares
        sizes = [(cfg.resolution, cfg.resolution)] * len(dataset)
    else:
        with ThreadPoolExecutor(max_workers=8) as pool:
            sizes = list(pool.map(_size_or_square, (r.path for r in records)))
    dataset.set_target_sizes([buckets[nearest_bucket(s, buckets)] for s in sizes])
    return buckets


def _size_or_square(path: Any) -> Size:
    try:
        return image_size(path)
    except Exception:  # noqa: BLE001 - unreadable: the image path substitutes it later; any bucket will do
        return (1, 1)


def describe_buckets(target_sizes: Sequence[Size]) -> str:
    counts: dict[Size, int] = {}
    for size in target_sizes:
        counts[size] = counts.get(size, 0) + 1
    parts = [f"{w}x{h}: {n}" for (w, h), n in sorted(counts.items(), key=lambda kv: -kv[1])]
    return f"{len(counts)} aspect-ratio bucket(s) in use ({', '.join(parts[:12])}{', ...' if len(parts) > 12 else ''})"


class BucketBatchSampler(EpochPosition, Sampler[list[SampleKey]]):
    """Batches of one bucket, the same bucket on every rank at every step (see the module doc)."""

    yields_batches = True  # a DataLoader batch sampler (trainer.data.build_dataloader)

    def __init__(
        self,
        groups: Sequence[int] | Sequence[Size],
        batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        self.dataset_len = len(groups)
        self.batch_size = batch_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.consumed = 0  # samples all ranks consumed together in this epoch
        members: dict[Any, list[int]] = {}
        for index, group in enumerate(groups):
            members.setdefault(group, []).append(index)
        self.groups = [members[k] for k in sorted(members)]
        if self.batches_per_epoch == 0:
            largest = max(len(m) for m in self.groups)
            raise DataError(
                f"no aspect-ratio bucket holds one step's {self.global_batch} images (train.micro_batch x "
                f"train.grad_accum x {num_replicas} ranks; the largest bucket has {largest}): lower "
                "train.micro_batch, add data, or turn data.buckets off"
            )

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.num_replicas

    @property
    def batches_per_epoch(self) -> int:
        return sum(len(m) // self.global_batch for m in self.groups)

    def _epoch_batches(self) -> list[list[int]]:
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        batches: list[list[int]] = []
        for members in self.groups:
            order = (
                [members[i] for i in torch.randperm(len(members), generator=g)] if self.shuffle else members
            )
            whole = len(order) // self.global_batch * self.global_batch
            batches.extend(order[i : i + self.global_batch] for i in range(0, whole, self.global_batch))
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=g)]
        return batches

    def _done(self) -> int:
        return min(self.consumed // self.global_batch, self.batches_per_epoch)

    def __iter__(self) -> Iterator[list[SampleKey]]:
        epoch = self.epoch
        for batch in self._epoch_batches()[self._done() :]:
            yield [SampleKey(i, epoch) for i in batch[self.rank :: self.num_replicas]]

    def __len__(self) -> int:
        return self.batches_per_epoch - self._done()

    def state_dict(self) -> dict[str, int]:
        # Another world size on resume (re-sharding): the epoch goes on after the batches consumed so far.
        return {**super().state_dict(), "batch_size": self.batch_size}


def build_bucket_loader(
    dataset: Any,
    target_sizes: Sequence[Size],
    batch_size: int,
    num_replicas: int,
    rank: int,
    seed: int,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> tuple[BucketBatchSampler, DataLoader]:
    """(sampler, loader): trainer.data.build_dataloader's loader with batches from one bucket each."""
    sampler = BucketBatchSampler(target_sizes, batch_size, num_replicas, rank, seed)
    return sampler, build_dataloader(dataset, sampler, batch_size, num_workers, pin_memory, seed)


def prepare_buckets(
    dataset: AugmentedDataset, cfg: DataConfig, model_step: int, log: Any
) -> list[Size] | None:
    """With data.buckets: give every item its bucket and log the buckets in use (None without)."""
    if not cfg.buckets:
        return None
    assign_buckets(dataset, cfg, model_step)
    assert dataset.target_sizes is not None
    log(describe_buckets(dataset.target_sizes))
    return dataset.target_sizes
