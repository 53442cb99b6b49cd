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

`OptimizerStep` is the trainer's `optimizer_step`; `TrainStep` is what the training loop calls:
one step through the guard or `run_step`, and the agreements around steps (the guard's settle,
the non-finite check) that every rank runs before the model is read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from sddoctor.instrument import api as sdi
from sddoctor.instrument.micro_batch import batch_size, split_batch
from sddoctor.instrument.oom_guard import OOMGuard
from trainer.nonfinite import NonFiniteWatch
from trainer.optim import EMA

__all__ = [
    "ForwardBackward",
    "OptimizerStep",
    "StepResult",
    "TrainStep",
    "batch_size",
    "gradient_norm",
    "run_step",
    "split_batch",
]

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
        no_sync = getattr(ddp_model, "no_sync", None)  # DDP's; a plain module has none
        sync = contextlib.nullcontext() if last or no_sync is None else no_sync()
        with sync:
            loss = forward_backward(ddp_model, piece, share)
        weighted = loss.detach().float() * share
        loss_sum = weighted if loss_sum is None else loss_sum + weighted
    optimizer_step()
    assert loss_sum is not None
    return StepResult(loss=loss_sum, samples=total, micro_batch=micro_batch, grad_accum=len(pieces))


def gradient_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """L2 norm of all gradients, on the device (what clip_grad_norm_ computes, without clipping)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), device=params[0].device if params else None)
    return torch.linalg.vector_norm(torch.stack([g.float() for g in torch._foreach_norm(grads)]))


class OptimizerStep:
    """Unscale, clip, step, schedule, EMA, zero_grad: called once a step's gradients are complete.

    `next_step()` gives the 1-based number of the step the loop is in (it is read when the step
    runs: a step the OOM guard redoes later is observed under the loop's step of that moment).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        params: list[torch.nn.Parameter],
        max_grad_norm: float,
        scaler: torch.amp.GradScaler | None,
        ema: EMA | None,
        watch: NonFiniteWatch,
        next_step: Callable[[], int],
    ) -> None:
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.params = params
        self.max_grad_norm = max_grad_norm
        self.scaler = scaler
        self.ema = ema
        self.watch = watch
        self.next_step = next_step
        # The learning rate the latest optimizer step used. Read in the step rather than before it:
        # when the OOM guard repairs a rank's failed optimizer step at the next step's agreement, it
        # copies the scheduler from a healthy rank first, and the step then runs at that rate.
        self.used_lr: float = lr_scheduler.get_last_lr()[0]
        device = params[0].device if params else None
        # Sum and count of the finite gradient norms since the last read, kept on the device.
        self._norm_sum = torch.zeros((), device=device)
        self._norm_count = torch.zeros((), device=device)

    def __call__(self) -> None:
        sdi.phase("optimizer")
        optimizer, scaler = self.optimizer, self.scaler
        self.used_lr = optimizer.param_groups[0]["lr"]
        if scaler is not None:
            scaler.unscale_(optimizer)
        if self.max_grad_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm, foreach=True)
        else:
            grad_norm = gradient_norm(self.params)
        if scaler is None:  # the fp16 loss scaler skips steps with overflowing gradients itself
            self.watch.observe(self.next_step(), grad_norm=grad_norm)
        finite = torch.isfinite(grad_norm.detach().float())
        self._norm_sum += torch.where(finite, grad_norm.detach().float(), 0.0)
        self._norm_count += finite
        if scaler is not None:
            try:
                scaler.step(optimizer)
            except Exception:
                # update() did not run, so the scaler still marks this optimizer as unscaled and
                # would refuse the unscale_() of the step the OOM guard redoes or repairs.
                scaler._per_optimizer_states.clear()
                raise
            scaler.update()
        else:
            optimizer.step()
        self.lr_scheduler.step()
        if self.ema is not None:
            self.ema.update()
        optimizer.zero_grad(set_to_none=True)

    def take_grad_norm(self) -> torch.Tensor:
        """The mean finite gradient norm since the last call, on the device (NaN if there was none);
        the next call averages from here on."""
        mean = self._norm_sum / self._norm_count
        self._norm_sum.zero_()
        self._norm_count.zero_()
        return mean


class TrainStep:
    """The loop's optimizer step, through the OOM guard when there is one (else `run_step`)."""

    def __init__(
        self,
        guard: OOMGuard | None,
        ddp_model: torch.nn.Module | None,
        micro_batch: int,
        grad_accum: int,
        forward_backward: ForwardBackward,
        optimizer_step: OptimizerStep,
        advice: Callable[[], str],
        log: Callable[[str], None],
        saved_guard_state: dict[str, Any] | None = None,
        guard_turned_on_checkpointing: bool = False,
    ) -> None:
        # No reference to guard.model here: after a failure the guard replaces the wrapper, and a
        # stale reference would keep the old one's gradient buckets in memory.
        self.guard = guard
        self.ddp_model = ddp_model
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.forward_backward = forward_backward
        self.optimizer_step = optimizer_step
        self.watch = optimizer_step.watch
        self.advice = advice
        self.log = log
        self.saved_guard_state = saved_guard_state
        self.guard_turned_on_checkpointing = guard_turned_on_checkpointing
        self.fallbacks = 0
        """OOM fallbacks so far in this process (counted on every rank alike)."""

    def __call__(self, batch: Mapping[str, Any], step: int) -> Any:
        """Run step `step` (1-based, as its step event and SDDOCTOR_FAULT's step= count) on `batch`.

        Returns the guard's or run_step's result: loss (on the device), micro_batch, grad_accum.
        """
        result: Any
        if self.guard is not None:
            result = self.guard.run_step(batch, self.forward_backward, self.optimizer_step, step)
            if result.fell_back:
                self.fallbacks += result.retries  # one retry per fallback
                self.log_fallback(step)
        else:
            result = run_step(
                self.ddp_model,  # type: ignore[arg-type]
                batch,
                self.micro_batch,
                self.grad_accum,
                self.forward_backward,
                self.optimizer_step,
            )
        self.watch.observe(step, loss=result.loss)
        return result

    def settle(self, step: int) -> None:
        """Every rank: finish the OOM guard's agreement on the last optimizer step before the model is read."""
        if self.guard is not None and self.guard.settle():
            self.fallbacks += 1
            self.log_fallback(step)

    def check_finite(self, reduced: list[float] | None = None) -> None:
        """Every rank: stop (NonFiniteError, exit 3) if a loss or gradient was NaN/inf since the start.

        `reduced`: the watch's numbers already MAX-reduced with the stop flag (no collective here);
        None: one small all-reduce here.
        """
        self.watch.check(reduced, "training", self.advice)

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of the guard (call settle() on every rank first)."""
        if self.guard is None:
            return self.saved_guard_state  # keep what an earlier guarded run learnt
        state = self.guard.state_dict()
        state["gradient_checkpointing"] = (
            self.guard.gradient_checkpointing or self.guard_turned_on_checkpointing
        )
        return state

    def log_fallback(self, step: int) -> None:
        """One rank-0 line per fallback; the `oom`/`fallback` events carry the details."""
        assert self.guard is not None
        self.log(fallback_message(self.guard, step))


def fallback_message(guard: OOMGuard, step: int) -> str:
    last = guard.last_fallback or {}
    checkpointing = ", gradient checkpointing on" if guard.gradient_checkpointing else ""
    return (
        f"OOM guard: {last.get('reason', 'out of memory')} at step {last.get('step', step)}: every rank now "
        f"runs micro-batch {guard.micro_batch} x {guard.grad_accum} accumulation{checkpointing} "
        f"(was {last.get('old_micro_batch', '?')} x {last.get('old_grad_accum', '?')}; same global batch); "
        + (
            "the failed optimizer step was completed from a healthy rank"
            if last.get("step_applied")
            else "the step was redone"
        )
    )
