"""One optimizer step: micro-batches with gradient accumulation, then the optimizer.

The trainer runs its steps through sddoctor's OOM guard (`OOMGuard.run_step`, same two callables),
which re-splits the same batch with a smaller micro-batch (and more accumulation) after an
out-of-memory; `run_step` here is the step without the guard (`train.oom_guard=false`, or
`ddp.find_unused_parameters=true`, which the guard does not support).

    forward_backward(model, micro_batch_dict, loss_scale) -> detached loss tensor
        forward + loss + backward of loss * loss_scale; must not call .item() (no host sync)
    optimizer_step() -> None
        unscale, clip, optimizer step, LR scheduler, EMA, zero_grad

All randomness of a step (noise, timesteps, caption dropout) is drawn for the whole batch before
it is split, so the result does not depend on how the batch is cut into micro-batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from sddoctor.instrument.micro_batch import batch_size, split_batch

__all__ = ["ForwardBackward", "StepResult", "batch_size", "run_step", "split_batch"]

ForwardBackward = Callable[[torch.nn.Module, dict[str, Any], float], torch.Tensor]


@dataclass
class StepResult:
    loss: torch.Tensor
    """Mean loss over the batch (detached, still on the device: reading it is a host sync)."""
    samples: int
    """Images this rank processed in the step."""
    micro_batch: int
    grad_accum: int


def run_step(
    ddp_model: torch.nn.Module,
    batch: Mapping[str, Any],
    micro_batch: int,
    grad_accum: int | None,
    forward_backward: ForwardBackward,
    optimizer_step: Callable[[], None],
) -> StepResult:
    """Accumulate gradients over the micro-batches of `batch` and take one optimizer step.

    DDP all-reduces only on the last micro-batch (`no_sync()` on the others). Each micro-batch's
    loss is scaled by its share of the batch, so the gradient equals that of the whole batch at
    once whatever the split. `grad_accum` is informational (the split follows `micro_batch`).
    """
    pieces = split_batch(batch, micro_batch)
    total = sum(batch_size(p) for p in pieces)
    loss_sum: torch.Tensor | None = None
    for index, piece in enumerate(pieces):
        share = batch_size(piece) / total
        last = index == len(pieces) - 1
        sync = contextlib.nullcontext() if last or not hasattr(ddp_model, "no_sync") else ddp_model.no_sync()
        with sync:
            loss = forward_backward(ddp_model, piece, share)
        weighted = loss.detach().float() * share
        loss_sum = weighted if loss_sum is None else loss_sum + weighted
    optimizer_step()
    assert loss_sum is not None
    return StepResult(loss=loss_sum, samples=total, micro_batch=micro_batch, grad_accum=len(pieces))
