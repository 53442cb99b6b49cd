"""Optimizer steps of an unchanged program, inferred from its DDP model or, without one, its optimizer.

Every DDP program shows sddoctor one event per optimizer step: the last gradient bucket of a
synchronised backward passes through sddoctor's comm hook (`ddp_hook`). Under `no_sync` (gradient
accumulation) DDP all-reduces nothing, so the hook sees optimizer steps, not micro-batches. A
forward pre-hook on the same model counts the samples (the leading dimension of the forward's first
tensor argument) and the micro-batches between two synchronised backwards, and starts the next step
at the next forward: that is where step-bound faults (`kill:...,step=S`) fire, at the user's own
`model(x)` line, never inside backward.

Steps are counted on the first DDP model that trains (a program with several DDP models, a GAN say,
counts the steps of that one). When a torch optimizer holding that model's parameters is known (made
after the optimizer watch was installed, or seen stepping), a step ends at that optimizer's step()
after a synchronised backward instead: several backwards may feed one optimizer step (a GAN's
discriminator on real and on fake images, accumulation without no_sync). A model that carries the user's own
comm hook (PowerSGD, fp16 compression) keeps it; registered in Python, its last bucket is reported
the same way (`ddp_hook.watching_user_hook`), and one registered after sddoctor's own hook runs
from inside it (`ddp_hook.adopt_user_hook`). Only a built-in C++ hook registered before the first
forward (`register_builtin_comm_hook`) and compiled autograd's per-parameter hook calls leave no such
signal: their steps end at the step() of the model's optimizer, or at the next training forward
after a forward that will synchronise. A program that joined a process group but trains no DDP model (FSDP, gradients averaged by
hand, DeepSpeed's engine around a torch optimizer) gets its steps from the first torch optimizer
whose `step()` runs (a global optimizer post-hook): one step per `optimizer.step()`, with its time
but no sample count, and step-bound faults fire as the previous step's `optimizer.step()` returns.
An explicit `sdi.step()`
takes precedence: the first one turns inference off for the rest of the run, and so does
`sdi.enable(infer_steps=False)` or SDDOCTOR_INFER_STEPS=0.
"""

from __future__ import annotations

import functools
import os
import time
import weakref
from typing import Any

import torch

from sddoctor.instrument.safety import internal_error

INFER_ENV = "SDDOCTOR_INFER_STEPS"
_MAX_DEPTH = 3
#: every torch optimizer made since the optimizer watch was installed, so that the one updating the
#: counted DDP model is known before its first step() (see StepInference._owner_known)
_optimizers: weakref.WeakSet[Any] = weakref.WeakSet()


def _register_optimizers() -> None:
    """Have every torch optimizer made from now on join `_optimizers` (idempotent)."""
    from torch.optim import Optimizer

    init = Optimizer.__init__
    if getattr(init, "__sddoctor_original__", None) is not None:
        return

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        try:
            _optimizers.add(self)
        except Exception as exc:  # noqa: BLE001 - an unhashable optimizer is only not known early
            internal_error("optimizer registry", exc)

    __init__.__sddoctor_original__ = init  # type: ignore[attr-defined]
    Optimizer.__init__ = __init__  # type: ignore[method-assign]


def first_batch_size(args: tuple, kwargs: dict) -> int | None:
    """The leading dimension of the first tensor among a forward's arguments (nested one or two levels)."""
    stack: list[tuple[Any, int]] = [(a, 0) for a in (*args, *kwargs.values())]
    stack.reverse()
    while stack:
        value, depth = stack.pop()
        if isinstance(value, torch.Tensor):
            return int(value.shape[0]) if value.dim() > 0 else None
        if depth >= _MAX_DEPTH:
            continue
        if isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1) for v in reversed(value))
        elif isinstance(value, dict):
            stack.extend((v, depth + 1) for v in reversed(list(value.values())))
    return None


class StepInference:
    """Turns a DDP model's forwards and synchronised backwards into `step` events of a session."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.enabled = os.environ.get(INFER_ENV, "1") != "0"
        self.step = 0  # steps finished
        self._primary: weakref.ReferenceType[Any] | None = None
        self._optimizer: weakref.ReferenceType[Any] | None = None  # counted when no DDP model trains
        self._optimizer_hook: Any = None
        self._samples = 0
        self._micro_batches = 0
        self._samples_known = True
        self._step_started: float | None = None
        self._last_end: float | None = None
        self._ended = True  # the previous step ended: the next training forward starts one
        self._sync_pending = False  # forward-only mode: a synchronising forward awaits its end
        # Optimizers that update the counted model's parameters (its owners) and those that do not
        self._owners: weakref.WeakSet[Any] = weakref.WeakSet()
        self._others: weakref.WeakSet[Any] = weakref.WeakSet()
        self._primary_params: set[int] = set()
        self._awaiting_owner = False  # a synchronised backward happened; the step ends at an owner's step()

    def attach(self, ddp_model: Any) -> None:
        """Watch `ddp_model` (a DistributedDataParallel just constructed)."""
        model_ref = weakref.ref(ddp_model)
        ddp_model.register_forward_pre_hook(
            lambda module, args, kwargs: self._on_forward(model_ref, args, kwargs), with_kwargs=True
        )

    def watch_optimizers(self) -> None:
        """Count steps from optimizer.step() while no DDP model trains (installed once)."""
        if self._optimizer_hook is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._optimizer_hook = register_optimizer_step_post_hook(self._on_optimizer_step)
            _register_optimizers()

    # -- hooks -------------------------------------------------------------------------------------

    def _on_forward(self, model_ref: weakref.ReferenceType[Any], args: tuple, kwargs: dict) -> None:
        if not self.enabled:
            return
        try:
            model = model_ref()
            if model is None or not _trains(model) or not torch.is_grad_enabled():
                return
            if self._primary is None or (self._primary is not model_ref and self._retired()):
                self._count(model_ref)  # the first DDP model that trains is the one counted
            elif self._primary is not model_ref:
                return
            hooked = self._watch_backward(model, model_ref)
            if self._sync_pending and not hooked:
                self._end_step(time.time())  # forward-only mode: the previous step is over
            if self._ended:
                self._ended = False
                self._step_started = time.time()
                self.session.begin_step(self.step + 1)  # may fire an injected fault on purpose
            size = first_batch_size(args, kwargs)
            if size is None:
                self._samples_known = False
            else:
                self._samples += size
            self._micro_batches += 1
            if getattr(model, "require_backward_grad_sync", True) and not hooked:
                self._sync_pending = True
        except Exception as exc:  # noqa: BLE001
            from sddoctor.instrument.safety import is_injected

            if is_injected(exc):
                raise
            internal_error("step inference (forward)", exc)

    def _retired(self) -> bool:
        """Whether the counted model can train no more: it is gone, or its process group was
        destroyed (a program that trains in phases, each with a process group and a DDP model of
        its own: the next phase's model is counted then, its steps numbered on)."""
        model = self._primary() if self._primary is not None else None
        if model is None:
            return True
        from torch.distributed import distributed_c10d as c10d

        live = getattr(getattr(c10d, "_world", None), "pg_map", None)
        group = getattr(model, "process_group", None)
        return live is not None and group is not None and group not in live

    def _count(self, model_ref: weakref.ReferenceType[Any]) -> None:
        """Count `model_ref`'s steps from now on; what was learnt of a previous model is dropped."""
        if self._primary is not None:
            self._last_end = None  # the first step of the new model starts at its forward
            self._ended = True
            self._sync_pending = self._awaiting_owner = False
            self._samples, self._micro_batches, self._samples_known = 0, 0, True
        self._primary = model_ref
        self._owners, self._others = weakref.WeakSet(), weakref.WeakSet()
        self._primary_params = set()

    def _watch_backward(self, model: Any, model_ref: weakref.ReferenceType[Any]) -> bool:
        """Have sddoctor's comm hook, or the watch on the user's own, tell when a synchronised
        backward ends. False for a built-in C++ hook (steps then end at the next training forward)."""
        from sddoctor.instrument import ddp_hook

        state: Any = ddp_hook.installed_state(model) or ddp_hook.install_unless_claimed(model)
        if state is None:
            state = ddp_hook.user_hook_watch(model)  # the user's own Python hook reports it then
        if state is None or getattr(state, "per_parameter", False):
            return False  # no bucket tells when a backward ends: steps end at the next forward
        if state.on_synced_backward is None:
            state.on_synced_backward = lambda: self._on_synced_backward(model_ref)
        return True

    def _on_synced_backward(self, model_ref: weakref.ReferenceType[Any]) -> None:
        if not self.enabled:
            return
        try:
            if self._primary is not model_ref or self._ended:
                return
            # Several synchronised backwards may feed one optimizer step (a GAN's discriminator
            # takes one for real and one for fake images, a loop may accumulate without no_sync):
            # with the optimizer of the model's parameters known, the step ends at its step()
            if self._owner_known():
                self._awaiting_owner = True
            else:
                self._end_step(time.time())
        except Exception as exc:  # noqa: BLE001
            internal_error("step inference (backward)", exc)

    def _owner_known(self) -> bool:
        return bool(self._owners) or any(self._is_owner(o) for o in list(_optimizers))

    def _is_owner(self, optimizer: Any) -> bool:
        """Whether `optimizer` updates parameters of the counted DDP model (decided once)."""
        try:
            if optimizer in self._owners:
                return True
            if optimizer in self._others or self._primary is None:
                return False
        except TypeError:  # an unhashable optimizer cannot be remembered: never an owner
            return False
        model = self._primary()
        if model is None:
            return False
        if not self._primary_params:
            self._primary_params = {id(p) for p in model.parameters()}
        groups = getattr(optimizer, "param_groups", None) or []
        owns = any(id(p) in self._primary_params for group in groups for p in group.get("params", ()))
        (self._owners if owns else self._others).add(optimizer)
        return owns

    def _on_optimizer_step(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        if not self.enabled:
            return
        if self._primary is not None:
            self._on_owner_step(optimizer)  # a DDP model's synchronised backwards count the steps
            return
        try:
            if self._optimizer is None:
                # The first optimizer to step is the one counted: a wrapper (ZeroRedundancyOptimizer,
                # accelerate's) steps its inner optimizer first, and a GAN's second one is ignored.
                self._optimizer = weakref.ref(optimizer)
            elif self._optimizer() is not optimizer:
                return
            if not _process_group_joined():
                return  # not a distributed run: nothing to tell the ranks apart by
            self._end_step(time.time(), source="optimizer")
        except Exception as exc:  # noqa: BLE001
            internal_error("step inference (optimizer)", exc)
            return
        try:
            # The next step starts now; its injected faults fire here, in the user's optimizer.step().
            self.session.begin_step(self.step + 1)
        except Exception as exc:  # noqa: BLE001
            from sddoctor.instrument.safety import is_injected

            if is_injected(exc):
                raise
            internal_error("step inference (optimizer)", exc)

    def _on_owner_step(self, optimizer: Any) -> None:
        """An optimizer stepped while a DDP model is counted: the end of its step if it is the
        model's own (a wrapper, ZeroRedundancyOptimizer or accelerate's, steps its inner one first)."""
        try:
            # Without a last bucket (a built-in C++ hook, compiled autograd's per-parameter calls)
            # a synchronising forward is enough: its backward ran before the optimizer's step
            unbucketed = self._sync_pending or self._per_parameter()
            if self._is_owner(optimizer) and not self._ended and (self._awaiting_owner or unbucketed):
                self._end_step(time.time())
        except Exception as exc:  # noqa: BLE001
            internal_error("step inference (optimizer of a DDP model)", exc)

    def _per_parameter(self) -> bool:
        from sddoctor.instrument import ddp_hook

        model = self._primary() if self._primary is not None else None
        state = ddp_hook.installed_state(model) if model is not None else None
        return bool(getattr(state, "per_parameter", False))

    def _end_step(self, now: float, source: str = "ddp") -> None:
        self.step += 1
        begun = self._last_end if self._last_end is not None else self._step_started
        fields: dict[str, Any] = {"source": source}
        if source == "ddp":
            fields["grad_accum"] = self._micro_batches
        if begun is not None:
            fields["step_time"] = round(now - begun, 6)
        if self._samples_known and self._samples:
            fields["samples"] = self._samples
        self.session.record_step(self.step, **fields)
        self._last_end = now
        self._samples = 0
        self._micro_batches = 0
        self._samples_known = True
        self._ended = True
        self._sync_pending = False
        self._awaiting_owner = False

    def stop(self) -> None:
        """An explicit step took over."""
        self.enabled = False
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None


def _trains(ddp_model: Any) -> bool:
    """Whether a forward of `ddp_model` is a training one. Lightning leaves the DDP wrapper in eval
    mode after its first validation and puts only the module inside back into training."""
    return bool(ddp_model.training or getattr(getattr(ddp_model, "module", None), "training", False))


def _process_group_joined() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
