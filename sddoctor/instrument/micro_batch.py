"""Cutting a batch into micro-batches: the one splitter of the OOM guard and the bundled trainer.

A batch is a mapping of fields. Tensors with a leading dimension, lists and tuples are cut along
it (tensor views and list slices, no copies); anything else (0-d tensors, numbers, None) is
shared by every piece. Every field that is cut must have the same leading size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch


def is_cut(value: Any) -> bool:
    """Whether a field is cut along its first dimension (else every micro-batch shares it)."""
    if isinstance(value, torch.Tensor):
        return value.dim() > 0
    return isinstance(value, (list, tuple))


def batch_size(batch: Mapping[str, Any]) -> int:
    """The leading size that every tensor and list of `batch` shares (ValueError when they differ)."""
    sizes = {len(value) for value in batch.values() if is_cut(value)}
    if not sizes:
        raise ValueError("the batch holds no tensor or list to take a size from")
    if len(sizes) != 1:
        raise ValueError(f"the batch's tensors and lists must share one leading size, got {sorted(sizes)}")
    return sizes.pop()


def split_sizes(size: int, micro_batch: int) -> list[int]:
    """Sizes of the consecutive micro-batches of a batch of `size` (the last one may be smaller)."""
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    return [min(micro_batch, size - i * micro_batch) for i in range(math.ceil(size / micro_batch))]


def split_batch(batch: Mapping[str, Any], micro_batch: int) -> list[dict[str, Any]]:
    """Cut `batch` into consecutive micro-batches of at most `micro_batch` items."""
    pieces = []
    start = 0
    for n in split_sizes(batch_size(batch), micro_batch):
        pieces.append({k: v[start : start + n] if is_cut(v) else v for k, v in batch.items()})
        start += n
    return pieces
