"""OOM guard: recover from out-of-memory in flight, agreed by every rank, with gradient accumulation.

    guard = OOMGuard(unet, wrap=lambda m: DDP(m, device_ids=[dev]), optimizer=opt,
                     micro_batch=8, grad_accum=1)
    for step, batch in enumerate(loader):
        result = guard.run_step(batch, forward_backward=fb, optimizer_step=opt_step, step=step)

One step, as every rank runs it:

    split the batch into micro-batches; no_sync() on all but the last one
    forward/backward ──(OOM or error)──> post zero all-reduces for the buckets not sent
                                         (the others wait for them inside backward)
    agreement: all-reduce (MAX) on a gloo control group of [this step's backward code |
               the previous optimizer step's code] of every rank; a healthy rank launches it
               from the comm hook right after its last gradient bucket, so it overlaps with
               that bucket's all-reduce: one control-plane collective per step, never waited
               on in a step without failure
    previous optimizer step failed somewhere -> repair it (below), redo this step
    this step failed somewhere -> every rank drops its gradients and the DDP wrapper, frees
               memory, halves the micro-batch (largest divisor of the per-rank batch <= half),
               re-wraps, and redoes the same batch
    optimizer_step (after a CPU snapshot only when optimizer state is still to be allocated);
               its outcome travels with the next agreement (next step, or settle())
        some rank failed, some did not -> the failed ranks receive parameters, optimizer
               state and `extra_state` from the lowest healthy rank: every rank has applied
               the full step; later steps use the smaller micro-batch
        every rank failed -> restore the snapshot on every rank and redo that step smaller
               (without a snapshot: OOMGuardError, nothing can be trusted)

The control plane is a separate gloo group so that agreement never interleaves with the
gradient all-reduces of the data plane. An out-of-memory is raised on the host at allocation
time, so agreement never waits for the GPU.

Any other exception inside the step is agreed too: every rank raises (the failing rank its own
exception, the others OOMGuardError naming it) instead of hanging in a collective.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sddoctor.instrument import api
from sddoctor.instrument.ddp_hook import CommHookState, complete_missing_buckets, install_comm_hook
from sddoctor.instrument.faults import Fault, faults_from_env
from sddoctor.instrument.micro_batch import batch_size, split_batch, split_sizes
from sddoctor.telemetry.schema import EventKind

OK, FORWARD, BACKWARD, OPTIMIZER, ERROR = 0, 1, 2, 3, 4
PHASE_NAMES = {FORWARD: "forward", BACKWARD: "backward", OPTIMIZER: "optimizer", ERROR: "error"}
_PHASE_CODES = {"forward": FORWARD, "backward": BACKWARD, "optimizer": OPTIMIZER}

ADVICE = (
    "enable gradient checkpointing (OOMGuard(enable_gradient_checkpointing=...), or "
    "model.enable_gradient_checkpointing() for diffusers), train at a lower resolution, use a "
    "smaller model, bf16 mixed precision, or an optimizer with less state (8-bit Adam, Adafactor)"
)


class OOMGuardError(RuntimeError):
    """The step cannot be made to fit (or another rank failed); raised on every rank alike."""


class InjectedOutOfMemory(torch.cuda.OutOfMemoryError):
    """An `oom:` fault of SDDOCTOR_FAULT (a real torch.cuda.OutOfMemoryError subclass)."""


@dataclass
class StepResult:
    loss: torch.Tensor  # mean over the step's samples, detached, on the loss's device
    micro_batch: int
    grad_accum: int
    retries: int
    fell_back: bool


def is_oom(exc: BaseException) -> bool:
    """torch.cuda.OutOfMemoryError, or a RuntimeError that says "out of memory" (cuDNN, cuBLAS, NCCL)."""
    oom_type = getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def fallback_micro_batch(per_rank_batch: int, micro_batch: int) -> int | None:
    """Largest divisor of `per_rank_batch` that is <= half of `micro_batch`; None below 1."""
    for candidate in range(micro_batch // 2, 0, -1):
        if per_rank_batch % candidate == 0:
            return candidate
    return None


def memory_info(device: torch.device | None) -> dict[str, int | None]:
    """Allocated / reserved / total bytes of a CUDA device (None elsewhere)."""
    info: dict[str, int | None] = {
        "mem_alloc": None,
        "mem_reserved": None,
        "mem_free": None,
        "mem_total": None,
    }
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return info
    try:
        info["mem_alloc"] = torch.cuda.memory_allocated(device)
        info["mem_reserved"] = torch.cuda.memory_reserved(device)
        info["mem_free"], info["mem_total"] = torch.cuda.mem_get_info(device)
    except RuntimeError:  # the context itself may be out of memory
        pass
    return info


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"


class _OOMFaults:
    """The `oom:` faults of SDDOCTOR_FAULT that apply to this rank."""

    def __init__(self, faults: Iterable[Fault], rank: int) -> None:
        self.faults = [f for f in faults if f.kind == "oom" and f.applies_to(rank)]
        self.fired: dict[str, int] = {}

    def check(self, phase: str, step: int, micro_batch: int, bucket: int | None = None) -> None:
        for fault in self.faults:
            if fault.get("phase", "forward") != phase:
                continue
            if phase == "backward" and bucket is not None and bucket != int(fault.get("bucket", 0)):
                continue
            at = int(fault.get("step"))
            above = fault.get("micro_batch_above")
            times = fault.get("times")
            fired = self.fired.get(fault.spec, 0)
            if above is not None:
                if step < at or micro_batch <= int(above) or (times is not None and fired >= int(times)):
                    continue
            elif step != at or fired >= int(times if times is not None else 1):
                continue
            self.fired[fault.spec] = fired + 1
            api.event(EventKind.FAULT, fault=fault.spec, step=step, caller=f"oom_guard:{phase}")
            raise InjectedOutOfMemory(
                f"CUDA out of memory (injected by SDDOCTOR_FAULT {fault.spec!r}, phase {phase}, step {step}, "
                f"micro-batch {micro_batch})"
            )


_RETRY = object()


@dataclass
class _PendingStep:
    """An optimizer step whose outcome the other ranks have not heard of yet."""

    code: int  # this rank's outcome (OK or a failure code)
    snapshot: dict[str, Any] | None
    failure: _Failure | None
    args: tuple[Any, ...]  # run_step's arguments, to redo the step after a roll-back


def _split_codes(
    work: Any, codes: torch.Tensor, world_size: int
) -> tuple[list[int] | None, list[int] | None]:
    """Wait for an agreement; (backward codes, previous optimizer step codes), None where all OK."""
    if work is not None:
        work.wait()
    values = codes.tolist()
    backward, optimizer = values[:world_size], values[world_size:]
    return (backward if any(backward) else None), (optimizer if any(optimizer) else None)


@dataclass
class _Failure:
    code: int
    message: str
    exc: BaseException | None  # kept only for non-OOM errors, to re-raise them


class OOMGuard:
    """Runs training steps so that an out-of-memory on any rank costs one retried step."""

    def __init__(
        self,
        module: torch.nn.Module,
        wrap: Callable[[torch.nn.Module], torch.nn.Module],
        optimizer: torch.optim.Optimizer,
        micro_batch: int,
        grad_accum: int = 1,
        control_group: dist.ProcessGroup | None = None,
        enable_gradient_checkpointing: Callable[[], Any] | None = None,
        telemetry: bool = True,
        extra_state: Iterable[Any] = (),
        optimizer_snapshot: str = "auto",
        faults: Iterable[Fault] | None = None,
    ) -> None:
        if micro_batch < 1 or grad_accum < 1:
            raise ValueError(f"micro_batch ({micro_batch}) and grad_accum ({grad_accum}) must be >= 1")
        if optimizer_snapshot not in ("auto", "always", "never"):
            raise ValueError(f"optimizer_snapshot={optimizer_snapshot!r}; use 'auto', 'always' or 'never'")
        self.module = module
        self.wrap = wrap
        self.optimizer = optimizer
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.per_rank_batch = micro_batch * grad_accum
        self.enable_gradient_checkpointing = enable_gradient_checkpointing
        self.gradient_checkpointing = False
        self.telemetry = telemetry
        self.extra_state = list(extra_state)
        self.optimizer_snapshot = optimizer_snapshot
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        if self.distributed and control_group is None:
            control_group = dist.new_group(backend="gloo")
        self.control_group = control_group
        self._faults = _OOMFaults(faults_from_env() if faults is None else faults, self.rank)
        self._step = 0
        self._phase = "forward"
        self._ddp_forwards = 0  # DDP forwards entered in the current attempt
        self._buffers_sync_at_start = False
        self.hook_state = CommHookState()
        self.hook_state.before_launch = self._before_bucket
        # One agreement per step: [backward code of every rank | previous optimizer step's code]
        self._codes = torch.zeros(2 * self.world_size, dtype=torch.int64)
        self._flag: tuple[Any, torch.Tensor] | None = None
        self._optimizer_state_complete = False
        self._in_last_micro_batch = False
        self._pending: _PendingStep | None = None
        #: the fields of the latest `fallback` event (None before the first fallback)
        self.last_fallback: dict[str, Any] | None = None
        self.hook_state.after_last_launch = self._launch_backward_flag
        module.register_forward_pre_hook(self._on_module_forward)
        module.register_forward_hook(self._on_module_output)
        optimizer.register_step_post_hook(self._after_optimizer_step)
        self.model: torch.nn.Module = self._wrap_module()

    # -- public ----------------------------------------------------------------------------

    def run_step(
        self,
        batch: Mapping[str, Any],
        forward_backward: Callable[[torch.nn.Module, dict[str, Any], float], torch.Tensor],
        optimizer_step: Callable[[], None],
        step: int,
    ) -> StepResult:
        """Train on `batch` (this rank's micro_batch*grad_accum samples) as one optimizer step.

        The agreement on this step's optimizer step completes in the background and is settled
        by the next run_step after its backward (or by settle()), so that no step waits on it.
        """
        fell_back = False
        size = batch_size(batch)
        retries = 0
        while True:
            loss = self._attempt(batch, size, forward_backward, optimizer_step, step)
            if loss is not _RETRY:
                return StepResult(loss, self.micro_batch, self.grad_accum, retries, fell_back)
            fell_back = True
            retries += 1

    def settle(self) -> bool:
        """Finish the agreement on the latest optimizer step and repair it if a rank failed.

        A collective on the control group: call it on every rank before reading the model for a
        checkpoint, an evaluation or the end of training (between steps, run_step's own agreement
        does this). Returns whether a fallback happened.
        """
        fell_back = False
        while self._pending is not None:
            pending, self._pending = self._pending, None
            _, codes = _split_codes(*self._launch_agreement(OK, pending.code), self.world_size)
            fell_back |= self._settle_optimizer_step(pending, codes)
        return fell_back

    def state_dict(self) -> dict[str, Any]:
        """Micro-batch, accumulation and gradient checkpointing; call settle() on every rank first."""
        return {
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "per_rank_batch": self.per_rank_batch,
            "gradient_checkpointing": self.gradient_checkpointing,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume the setting a previous run fell back to (call on every rank)."""
        micro_batch = int(state.get("micro_batch", self.micro_batch))
        if self.per_rank_batch % micro_batch:
            micro_batch = fallback_micro_batch(self.per_rank_batch, 2 * micro_batch + 1) or 1
        if micro_batch < self.micro_batch:
            self.micro_batch = micro_batch
            self.grad_accum = self.per_rank_batch // micro_batch
        if state.get("gradient_checkpointing") and not self.gradient_checkpointing:
            if self.enable_gradient_checkpointing is None:
                raise OOMGuardError(
                    "the checkpoint was trained with gradient checkpointing turned on by the OOM guard; "
                    "pass enable_gradient_checkpointing=... to OOMGuard to resume it"
                )
            self.enable_gradient_checkpointing()
            self.gradient_checkpointing = True
            self._rewrap()

    def stats(self) -> dict[str, Any]:
        """The comm hook's bucket counters (for the `collectives.ddp` state field)."""
        return self.hook_state.stats()

    # -- one attempt -------------------------------------------------------------------------

    def _attempt(self, batch, size, forward_backward, optimizer_step, step):
        """One try at the step; returns the loss, or _RETRY after an agreed failure."""
        self._step = step
        self._ddp_forwards = 0
        self._buffers_sync_at_start = _buffers_sync_before_forward(self.model)
        self._flag = None
        self.hook_state.begin_step()
        self._in_last_micro_batch = False
        chunks = split_batch(batch, self.micro_batch)
        outcome = self._run_micro_batches(chunks, size, forward_backward)
        self._in_last_micro_batch = False
        del chunks
        failure = outcome if isinstance(outcome, _Failure) else None
        losses = None if failure is not None else outcome
        del outcome
        late = None
        if failure is not None and self._flag is not None:
            # This rank had sent every bucket and told the others its backward was fine before it
            # failed: the gradients the others hold are complete. It skips the optimizer step and
            # reports in the optimizer agreement, which re-syncs it from a healthy rank.
            late, failure = failure, None
        elif failure is not None and self.distributed:
            self._complete_data_plane()
        codes, optimizer_codes = self._finish_backward_agreement(failure.code if failure else OK)
        pending, self._pending = self._pending, None
        if pending is not None and self._settle_optimizer_step(pending, optimizer_codes, codes is not None):
            # The previous optimizer step failed somewhere and was repaired (or redone): this
            # step's gradients came from parameters that differed between ranks. Redo it.
            return _RETRY
        if codes is not None:
            losses = None
            self._reset_after_failure(rewrap=True)
            self._fall_back(codes, failure or late, step)
            return _RETRY
        # NaN when this rank failed after its backward was agreed (its loss is lost; the step is
        # completed from a healthy rank at the next settle).
        loss = (
            _mean_loss(losses, split_sizes(size, self.micro_batch), size)
            if losses
            else torch.tensor(float("nan"))
        )
        del losses

        snapshot = self._snapshot() if late is None and self._wants_snapshot() else None
        failure = late
        if late is None:
            self._phase = "optimizer"
            try:
                optimizer_step()
            except Exception as exc:  # noqa: BLE001 - every failure must reach the agreement
                failure = self._failure(exc, OPTIMIZER)
                del exc
        # Its outcome travels with the next agreement (the next step's backward flag, or settle()).
        self._pending = _PendingStep(
            failure.code if failure else OK,
            snapshot,
            failure,
            (batch, forward_backward, optimizer_step, step),
        )
        return loss

    def _settle_optimizer_step(
        self, pending: _PendingStep, codes: list[int] | None, broken_wrapper: bool = False
    ) -> bool:
        """Resolve a finished optimizer agreement; True when a failure was repaired.

        `broken_wrapper`: a rank failed in the backward that preceded this call, so its DDP
        reducer is unusable and every rank needs a fresh wrapper.
        """
        if codes is None:
            return False
        if any(c == ERROR for c in codes):
            self._raise_agreed_error(codes, pending.failure)
        healthy = [r for r in range(self.world_size) if codes[r] == OK]
        step = pending.args[3]
        if healthy:
            self._resync_from(healthy[0])
            self._reset_after_failure(rewrap=broken_wrapper)
            self._fall_back(codes, pending.failure, step, applied=True)
            return True
        if pending.snapshot is None and OPTIMIZER in codes:
            raise OOMGuardError(
                f"step {step}: the optimizer step ran out of memory on every rank and there is no "
                "snapshot to roll back to (parameters may be partly updated); pass "
                f"optimizer_snapshot='always' to OOMGuard to make this recoverable. Advice: {ADVICE}"
            )
        if pending.snapshot is not None:
            self._restore(pending.snapshot)
        pending.snapshot = None
        self._reset_after_failure(rewrap=broken_wrapper)
        self._fall_back(codes, pending.failure, step)
        self.run_step(*pending.args)  # redo the step; its own agreement is settled by the caller's loop
        return True

    def _run_micro_batches(self, chunks, size, forward_backward):
        losses: list[torch.Tensor] = []
        last = len(chunks) - 1
        try:
            for i, chunk in enumerate(chunks):
                no_sync = getattr(self.model, "no_sync", None)
                ctx = no_sync() if (i < last and no_sync is not None) else contextlib.nullcontext()
                self._in_last_micro_batch = i == last
                with ctx:
                    self._phase = "forward"
                    loss = forward_backward(self.model, chunk, batch_size(chunk) / size)
                losses.append(loss.detach() if isinstance(loss, torch.Tensor) else torch.as_tensor(loss))
                del loss
        except Exception as exc:  # noqa: BLE001 - every failure must reach the agreement
            return self._failure(exc, _PHASE_CODES[self._phase])
        return losses

    def _failure(self, exc: BaseException, phase_code: int) -> _Failure:
        if not is_oom(exc):
            return _Failure(ERROR, f"{type(exc).__name__}: {exc}", exc)
        message = str(exc).splitlines()[0][:500] if str(exc) else type(exc).__name__
        exc.__traceback__ = None  # the frames hold activations; let them go
        self._emit_oom(PHASE_NAMES[phase_code], message)
        return _Failure(phase_code, message, None)

    # -- data plane and agreement -------------------------------------------------------------

    def _complete_data_plane(self) -> None:
        """Issue the DDP collectives the healthy ranks still expect from this rank in this attempt."""
        ddp = self.model
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            return
        gc.collect()
        _empty_cache()
        if self._ddp_forwards == 0:
            # This rank failed before its first DDP forward of the step. The others ran it, and
            # with it the two collectives DDP may issue before a forward: the one-time bucket
            # rebuild (a broadcast from rank 0, in the first forward after the first synchronised
            # backward) and the buffer broadcast (only when the previous forward was synchronised,
            # so never on the later micro-batches of a no_sync accumulation).
            if torch.is_grad_enabled():
                ddp.reducer._rebuild_buckets()
            if self._buffers_sync_at_start:
                ddp._sync_buffers()
        complete_missing_buckets(ddp, self.hook_state)

    def _launch_agreement(self, code: int, optimizer_code: int) -> tuple[Any, torch.Tensor]:
        """Start the all-reduce (MAX) of every rank's codes on the control group."""
        codes = self._codes
        codes.zero_()
        codes[self.rank] = code
        codes[self.world_size + self.rank] = optimizer_code
        if not self.distributed:
            return None, codes
        return dist.all_reduce(codes, op=dist.ReduceOp.MAX, group=self.control_group, async_op=True), codes

    def _launch_backward_flag(self) -> None:
        # Called by the comm hook right after the last bucket of the last micro-batch went out:
        # this rank's backward is as good as done, so its "all fine" travels now and the round
        # trip overlaps with the last bucket's all-reduce instead of following it.
        if self._in_last_micro_batch and self._flag is None:
            self._flag = self._launch_agreement(OK, self._pending_code())

    def _pending_code(self) -> int:
        return self._pending.code if self._pending is not None else OK

    def _finish_backward_agreement(self, code: int) -> tuple[list[int] | None, list[int] | None]:
        """The agreement after backward, which also carries the previous optimizer step's outcome.

        Returns (backward codes, previous optimizer codes), each None when every rank is fine.
        """
        if self._flag is None or code != OK:
            self._flag = self._launch_agreement(code, self._pending_code())
        work, codes = self._flag
        self._flag = None
        return _split_codes(work, codes, self.world_size)

    def _raise_agreed_error(self, codes: list[int], failure: _Failure | None) -> None:
        if failure is not None and failure.exc is not None:
            raise failure.exc
        bad = [r for r, c in enumerate(codes) if c == ERROR]
        raise OOMGuardError(
            f"step {self._step}: rank(s) {bad} failed with an error that is not an out-of-memory; "
            "this rank stopped with them instead of waiting in a collective (see that rank's traceback)"
        )

    # -- recovery -----------------------------------------------------------------------------

    def _fall_back(
        self, codes: list[int], failure: _Failure | None, step: int, applied: bool = False
    ) -> None:
        if any(c == ERROR for c in codes):
            self._raise_agreed_error(codes, failure)
        failed = {r: PHASE_NAMES[c] for r, c in enumerate(codes) if c != OK}
        phases = sorted(set(failed.values()))
        reason = f"out of memory in {'/'.join(phases)} on rank(s) {sorted(failed)}"
        old_mb, old_ga = self.micro_batch, self.grad_accum
        new_mb = fallback_micro_batch(self.per_rank_batch, self.micro_batch)
        if new_mb is not None:
            self.micro_batch, self.grad_accum = new_mb, self.per_rank_batch // new_mb
        elif self.enable_gradient_checkpointing is not None and not self.gradient_checkpointing:
            self.enable_gradient_checkpointing()
            self.gradient_checkpointing = True
            self._rewrap()
        elif applied:
            reason += " (step applied; nothing smaller left for later steps)"
        else:
            mem = memory_info(_device_of(self.module))
            mine = (
                f"this rank (rank {self.rank}) failed in {failed[self.rank]}: {failure.message if failure else ''}; "
                if self.rank in failed
                else f"see rank {min(failed)} for its message; "
            )
            raise OOMGuardError(
                f"step {step}: out of memory at micro-batch 1 on rank(s) {sorted(failed)} "
                f"({', '.join(phases)}), gradient checkpointing "
                f"{'already on' if self.gradient_checkpointing else 'not available'}; nothing smaller to fall back to. "
                f"{mine}memory on rank {self.rank}: allocated {_gib(mem['mem_alloc'])}, reserved "
                f"{_gib(mem['mem_reserved'])}, free {_gib(mem['mem_free'])} of {_gib(mem['mem_total'])}. "
                f"To fit: {ADVICE}."
            )
        self.last_fallback = {
            "step": step,
            "old_micro_batch": old_mb,
            "new_micro_batch": self.micro_batch,
            "old_grad_accum": old_ga,
            "new_grad_accum": self.grad_accum,
            "reason": reason,
            "gradient_checkpointing": self.gradient_checkpointing,
            "failed_ranks": sorted(failed),
            "step_applied": applied,
        }
        if self.telemetry:
            api.event(EventKind.FALLBACK, **self.last_fallback)

    def _reset_after_failure(self, rewrap: bool) -> None:
        """Drop gradients (and the DDP wrapper), free memory, wrap again."""
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.module.parameters():
            p.grad = None
        if rewrap:
            self._rewrap()
        else:
            gc.collect()
            _empty_cache()

    def _rewrap(self) -> None:
        # Every rank re-wraps, so that bucket layouts and the once-per-wrapper bucket rebuild
        # stay identical across ranks; the failed rank's reducer is mid-backward and unusable.
        old: Any = self.model
        self.model = None  # type: ignore[assignment]  # no wrapper until the new one, just below
        # A reducer kept alive by a stray reference would still all-reduce in the next backward.
        if hasattr(getattr(old, "reducer", None), "_remove_autograd_hooks"):
            old.reducer._remove_autograd_hooks()
        del old
        gc.collect()
        _empty_cache()
        self.model = self._wrap_module()

    def _wrap_module(self) -> torch.nn.Module:
        model = self.wrap(self.module)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            if model.find_unused_parameters:
                raise ValueError(
                    "OOMGuard does not support DDP(find_unused_parameters=True) yet (its extra all-reduce "
                    "cannot be completed by a failed rank); use find_unused_parameters=False"
                )
            # Under `sddoctor run` the bootstrap already hooked this wrapper (one comm hook per
            # DDP model): install_comm_hook then hands back that hook's state, which takes over ours.
            self.hook_state = install_comm_hook(model, self.hook_state)
            model.register_forward_pre_hook(self._on_ddp_forward)
        return model

    # -- optimizer snapshot and re-sync --------------------------------------------------------

    def _wants_snapshot(self) -> bool:
        if self.optimizer_snapshot == "never":
            return False
        if self.optimizer_snapshot == "always":
            return True
        # Lazily allocated state (Adam's moments, momentum buffers) is the classic optimizer OOM,
        # so snapshot exactly when some parameter with a gradient has no state yet. Once every
        # parameter has state the answer stays no (until a restore or re-sync), so stop asking.
        if self._optimizer_state_complete:
            return False
        state = self.optimizer.state
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        missing = any(p.grad is not None and not state.get(p) for p in params)
        self._optimizer_state_complete = not missing and all(state.get(p) for p in params)
        return missing

    def _snapshot(self) -> dict[str, Any]:
        return {
            "module": {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()},
            "optimizer": _to_cpu(self.optimizer.state_dict()),
            "extra": [_to_cpu(obj.state_dict()) for obj in self.extra_state],
        }

    def _restore(self, snapshot: dict[str, Any]) -> None:
        self._optimizer_state_complete = False
        with torch.no_grad():
            self.module.load_state_dict(snapshot["module"])
        self.optimizer.load_state_dict(snapshot["optimizer"])
        for obj, state in zip(self.extra_state, snapshot["extra"], strict=True):
            obj.load_state_dict(state)

    def _resync_from(self, src: int) -> None:
        """Make every rank hold rank `src`'s parameters, optimizer state and extra state."""
        self._optimizer_state_complete = False
        data_group = getattr(self.model, "process_group", None)
        with torch.no_grad():
            for tensor in self.module.state_dict().values():
                dist.broadcast(tensor, src, group=data_group)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        meta: list[Any] = [None]
        if self.rank == src:
            meta[0] = {
                "groups": [
                    {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
                ],
                "state": [
                    (i, _describe_state(self.optimizer.state.get(p, {}), p)) for i, p in enumerate(params)
                ],
                "extra": [_to_cpu(obj.state_dict()) for obj in self.extra_state],
            }
        dist.broadcast_object_list(meta, src=src, group=self.control_group)
        desc = meta[0]
        for i, entries in desc["state"]:
            p = params[i]
            state = self.optimizer.state[p]
            if self.rank != src:
                for key in list(state):
                    if key not in entries:
                        del state[key]
            for key, (kind, value) in entries.items():
                if kind == "value":
                    if self.rank != src:
                        state[key] = value
                    continue
                shape, dtype = value
                tensor = state.get(key)
                if self.rank != src and not (
                    isinstance(tensor, torch.Tensor)
                    and tuple(tensor.shape) == tuple(shape)
                    and tensor.dtype == dtype
                    and tensor.device == p.device
                ):
                    tensor = state[key] = torch.empty(shape, dtype=dtype, device=p.device)
                dist.broadcast(tensor, src, group=data_group)
            if not entries and self.rank != src:
                self.optimizer.state.pop(p, None)
        if self.rank != src:
            for group, hyper in zip(self.optimizer.param_groups, desc["groups"], strict=True):
                group.update(hyper)
            for obj, state in zip(self.extra_state, desc["extra"], strict=True):
                obj.load_state_dict(state)

    # -- hooks: phase tracking and fault injection ---------------------------------------------

    def _on_ddp_forward(self, module: torch.nn.Module, args: Any) -> None:
        self._ddp_forwards += 1

    def _on_module_forward(self, module: torch.nn.Module, args: Any) -> None:
        self._phase = "forward"
        self._faults.check("forward", self._step, self.micro_batch)

    def _on_module_output(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        # The first gradient that reaches the module's output marks the start of its backward.
        tensor = _first_grad_tensor(output)
        if tensor is not None:
            tensor.register_hook(self._on_backward_start)

    def _on_backward_start(self, grad: torch.Tensor) -> None:
        self._phase = "backward"

    def _before_bucket(self, index: int) -> None:
        self._phase = "backward"
        self._faults.check("backward", self._step, self.micro_batch, bucket=index)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # Fires after the parameters were updated: the hardest case (a partly applied step).
        self._faults.check("optimizer", self._step, self.micro_batch)

    # -- telemetry -----------------------------------------------------------------------------

    def _emit_oom(self, phase: str, message: str) -> None:
        if not self.telemetry:
            return
        mem = memory_info(_device_of(self.module))
        api.event(
            EventKind.OOM,
            step=self._step,
            phase=phase,
            micro_batch=self.micro_batch,
            grad_accum=self.grad_accum,
            mem_alloc=mem["mem_alloc"],
            mem_reserved=mem["mem_reserved"],
            mem_total=mem["mem_total"],
            message=message,
        )


# -- helpers -------------------------------------------------------------------------------


def _empty_cache() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _buffers_sync_before_forward(model: torch.nn.Module) -> bool:
    """Whether DDP's next forward starts with a buffer broadcast (DDP's own test, private API)."""
    check = getattr(model, "_check_sync_bufs_pre_fwd", None)
    return bool(check()) if check is not None else False


def _device_of(module: torch.nn.Module) -> torch.device | None:
    for p in module.parameters():
        return p.device
    return None


def _mean_loss(losses: list[torch.Tensor], sizes: list[int], size: int) -> torch.Tensor | None:
    if not losses:
        return None
    if all(n == sizes[0] for n in sizes):
        return torch.stack([loss.float().reshape(()) for loss in losses]).mean()
    return sum(loss.float().reshape(()) * (n / size) for loss, n in zip(losses, sizes, strict=True))  # type: ignore[return-value]


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        for item in output:
            found = _first_grad_tensor(item)
            if found is not None:
                return found
    return None


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_cpu(v) for v in obj)
    return obj


def _describe_state(state: Mapping[str, Any], param: torch.Tensor) -> dict[str, tuple[str, Any]]:
    """Per-key description: tensors on the parameter's device go over the data plane, the rest pickled."""
    out: dict[str, tuple[str, Any]] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.device == param.device and value.dim() > 0:
            out[key] = ("tensor", (tuple(value.shape), value.dtype))
        else:
            out[key] = ("value", _to_cpu(value))
    return out
