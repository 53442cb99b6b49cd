"""Stop a run whose loss or gradient stops being a finite number, before its weights are saved.

The policy: the first non-finite loss (any rank) or non-finite gradient norm (after DDP's
all-reduce, so every rank sees it) ends the run with `NonFiniteError` (exit code 3) at the next
check: every logging interval, and before every checkpoint, sample grid and export. Nothing is
written after the step that went wrong, so the newest checkpoint holds finite weights and a
resume from it (with a lower learning rate, say) continues from before the divergence.

Skipping bad steps instead would hide a diverging run for days; the fp16 loss scaler keeps
skipping steps whose gradients overflow (that is its normal work), so with fp16 only the loss
is watched.

`observe` costs a few tiny device kernels per step and no host sync. At the logging interval the
watch's two numbers per rank ride in the all-reduce the trainer runs there anyway (`for_max`);
before a checkpoint, sample grid or export `check(None, ...)` runs one small all-reduce itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist


class NonFiniteError(RuntimeError):
    """The loss or the gradient became NaN or infinite; the message says where and what to try."""


class NonFiniteWatch:
    """Remembers on the device the first step whose loss / gradient norm was not finite."""

    def __init__(self, device: torch.device, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        # Row per rank (others stay inf so a MIN all-reduce gathers them): first bad step of
        # [loss, gradient norm], inf while all were finite.
        self.first = torch.full((world_size, 2), math.inf, device=device)

    def observe(
        self, step: int, loss: torch.Tensor | None = None, grad_norm: torch.Tensor | None = None
    ) -> None:
        """Record `step` if `loss` or `grad_norm` is not finite (on the device, no host sync)."""
        for column, value in ((0, loss), (1, grad_norm)):
            if value is None:
                continue
            bad_at = torch.where(torch.isfinite(value.detach().float()), math.inf, float(step))
            mine = self.first[self.rank, column]
            mine.copy_(torch.minimum(mine, bad_at))

    def for_max(self) -> torch.Tensor:
        """This rank's numbers negated and flat, to ride along in a MAX all-reduce (the caller's)."""
        return -self.first.flatten()

    def check(self, reduced: list[float] | None, what: str, advice: str | Callable[[], str]) -> None:
        """Raise NonFiniteError on every rank if any rank saw a non-finite value.

        `reduced` is `for_max()` after the caller's MAX all-reduce; None: reduce here (a collective).
        """
        if reduced is None:
            first = self.first.clone()
            if self.world_size > 1 and dist.is_initialized():
                dist.all_reduce(first, op=dist.ReduceOp.MIN)
            reduced = (-first.flatten()).tolist()
        table = [[-reduced[2 * r], -reduced[2 * r + 1]] for r in range(self.world_size)]
        if all(math.isinf(v) for row in table for v in row):
            return
        loss_at = min(row[0] for row in table)
        grad_at = min(row[1] for row in table)
        parts = []
        if not math.isinf(loss_at):
            ranks = [r for r, row in enumerate(table) if row[0] == loss_at]
            parts.append(f"the loss was not finite at step {int(loss_at)} on rank(s) {ranks}")
        if not math.isinf(grad_at):
            parts.append(f"the gradient norm was not finite at step {int(grad_at)}")
        if callable(advice):
            advice = advice()
        raise NonFiniteError(f"{what} diverged: {' and '.join(parts)}; stopped without saving. {advice}")
