"""A DDP comm hook that averages gradient buckets exactly like DDP's default hook and keeps account.

    from sddoctor.instrument import ddp_hook
    ddp = DDP(model, ...)
    hook = ddp_hook.install(ddp)           # the CommHookState; a second call returns the same one
    ...
    hook.stats()      # {"buckets": 412, "seconds": 3.1, "last_bucket_t": 1764670000.2}
    ddp_hook.stats()  # the same, summed over every live hooked model (state field collectives.ddp)

DDP accepts one comm hook per model. Under `sddoctor run` the bootstrap (`ddp_patch`) installs this
hook at every DDP model's first forward, unless a comm hook was registered on it by then (the
user's own, or the OOM guard's); `install_comm_hook(ddp, state)` on a model that already carries
this hook takes it over instead of registering a second one. A comm hook the user registers on a
model that already carries this hook runs from inside it, in place of its all-reduce
(`adopt_user_hook`), since DDP would refuse it; a built-in one (ALLREDUCE, FP16_COMPRESS) is done by
this hook itself, with the same arithmetic as DDP's C++ hook.

What it adds to the plain all-reduce, all in memory and without a lock (the hook runs on the
autograd thread; counters are plain ints under the GIL):
- which buckets were launched in the current backward (index, numel, dtype, device) and the bucket
  layout of the latest backward that launched every bucket;
- a count and the summed launch-to-completion time of bucket all-reduces (on NCCL the future
  completes when the work is enqueued, so there the time is the CPU side only);
- `complete_missing_buckets`: after a rank failed mid-backward, post all-reduces of zeros for the
  buckets it never launched, so the ranks still inside backward are not left waiting.

Communication still overlaps with backward: each bucket is all-reduced as soon as DDP hands it over.
Works with `gradient_as_bucket_view=True` (the reduction is in place in the bucket buffer).
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sddoctor.instrument import tracing
from sddoctor.instrument.backend_callbacks import BackendCallback
from sddoctor.instrument.safety import internal_error


@dataclass(frozen=True)
class BucketInfo:
    index: int
    numel: int
    dtype: torch.dtype
    device: torch.device


class CommHookState:
    """What the hook knows about the gradient buckets of one DDP model (kept across re-wraps)."""

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.launched: list[BucketInfo] = []  # buckets launched in the current backward, in order
        self.layout: list[BucketInfo] = []  # every bucket of the latest backward that launched them all
        self.full_backwards = 0  # backwards that launched every bucket, since the last attach()
        self.buckets = 0
        self.seconds = 0.0
        self.last_bucket_t: float | None = None
        #: (file, line) of the user's frame that started the current backward (traced records)
        self.caller: tuple[str, int] | None = None
        #: called with the bucket index just before it is launched (fault injection); may raise
        self.before_launch: Callable[[int], None] | None = None
        #: called right after the last bucket of a backward was launched (the OOM guard's agreement)
        self.after_last_launch: Callable[[], None] | None = None
        #: called right after the last bucket too: a synchronised backward ended (step inference);
        #: must not raise
        self.on_synced_backward: Callable[[], None] | None = None
        #: (state, hook) of a comm hook the user registered after this one was installed: DDP takes
        #: one hook per model, so this hook runs the user's in place of its own all-reduce
        self.user_hook: tuple[Any, Callable[..., Any]] | None = None
        #: a built-in hook the user registered after this one: "ALLREDUCE" or "FP16_COMPRESS"
        self.builtin: str | None = None
        #: compiled autograd's Python reducer calls the hook per parameter: no bucket ends a backward
        self.per_parameter = False

    def attach(self, process_group: dist.ProcessGroup | None) -> None:
        """A new DDP wrapper took over: its bucket layout is not known yet."""
        self.process_group = process_group
        self.launched = []
        self.layout = []
        self.full_backwards = 0

    def begin_step(self) -> None:
        """Forget the buckets of the previous step (call before the step's first forward)."""
        self.launched = []

    def stats(self) -> dict[str, Any]:
        return {
            "buckets": self.buckets,
            "seconds": round(self.seconds, 6),
            "last_bucket_t": self.last_bucket_t,
        }

    def take_over(self, previous: CommHookState) -> None:
        """Continue `previous`'s counters and callbacks in this (installed) state; zero `previous`."""
        self.buckets += previous.buckets
        self.seconds += previous.seconds
        if previous.last_bucket_t is not None:
            self.last_bucket_t = max(self.last_bucket_t or 0.0, previous.last_bucket_t)
        self.before_launch = previous.before_launch
        self.after_last_launch = previous.after_last_launch
        self.on_synced_backward = self.on_synced_backward or previous.on_synced_backward
        previous.buckets, previous.seconds, previous.last_bucket_t = 0, 0.0, None

    # Pickling a DDP model drops comm hooks anyway; keep the state picklable for safety.
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["process_group"] = None
        state["before_launch"] = None
        state["after_last_launch"] = None
        state["on_synced_backward"] = None
        state["user_hook"] = None
        return state


# No annotations: DDP inspects them and rejects the strings that `from __future__ import annotations` makes.
def _averaging_allreduce_hook(state, bucket):
    if isinstance(bucket, tuple):
        return _reduce_one_gradient(state, bucket)
    index = bucket.index()
    if state.before_launch is not None:
        state.before_launch(index)  # the OOM guard's fault injection: may raise on purpose
    buffer = bucket.buffer()
    last = bucket.is_last()
    try:
        _account_launch(state, index, buffer, last)
    except Exception as exc:  # noqa: BLE001 - accounting must never break the user's backward
        internal_error("ddp comm hook", exc)
    if state.user_hook is not None:
        return _run_user_hook(state, bucket, last)
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    # Same arithmetic as DDP's default hook (and its FP16_COMPRESS hook, which casts first):
    # divide first, then sum, so the results are bitwise identical.
    compressed = state.builtin == "FP16_COMPRESS"
    sent = buffer.to(torch.float16) if compressed else buffer
    sent.div_(dist.get_world_size(group))
    started = time.perf_counter()

    def _done(fut):
        try:
            state.buckets += 1
            state.seconds += time.perf_counter() - started
            state.last_bucket_t = time.time()
        except Exception as exc:  # noqa: BLE001
            internal_error("ddp comm hook completion", exc)
        # As DDP's default hook does; a failed all-reduce raises here exactly as it would there.
        result = fut.value()[0]
        return buffer.copy_(result) if compressed else result

    if index == 0 or state.caller is None:
        state.caller = tracing.caller_of_backward()  # the same for every bucket of this backward
    # counted until gloo's thread drops it: a drop after the interpreter ended would abort the rank
    fut = tracing.bucket_all_reduce(sent, group, state.caller).get_future().then(BackendCallback(_done))
    if last:
        _after_last_launch(state)
    return fut


def _after_last_launch(state: CommHookState) -> None:
    for callback in (state.after_last_launch, state.on_synced_backward):
        if callback is not None:
            callback()


def _run_user_hook(state: CommHookState, bucket: Any, last: bool) -> Any:
    """The user's own hook on this bucket, exactly as registered (its errors are the user's)."""
    user_state, hook = state.user_hook  # type: ignore[misc]
    fut = hook(user_state, bucket)
    if last:
        _after_last_launch(state)
    return fut


def adopt_user_hook(ddp_model: Any, method: str, args: tuple, kwargs: dict) -> bool:
    """Run a comm hook the user registers on a model that already carries sddoctor's hook (installed
    at its first forward: a user may register theirs after an evaluation forward) from within
    sddoctor's hook, since DDP refuses a second one. False when DDP should take the call itself
    (no sddoctor hook on the model, or a second registration, which DDP refuses as it would anyway).
    The user's hook goes through DDP's own checks first, so a hook DDP rejects is still rejected."""
    state = installed_state(ddp_model)
    if state is None or state.user_hook is not None or state.builtin is not None:
        return False
    if method == "register_comm_hook":
        user_hook = _user_hook_of(args, kwargs)
        if user_hook is None:
            return False
        if hasattr(ddp_model, "_check_comm_hook"):
            ddp_model._check_comm_hook(user_hook[1])  # raises what DDP raises for a bad hook
        state.user_hook = user_hook
        name = getattr(user_hook[1], "__qualname__", None) or repr(user_hook[1])
    else:
        # done here, not by torch's Python versions of these hooks: their future callbacks would
        # be Python objects on gloo's thread that DDP's C++ hook never has (see backend_callbacks)
        kind: Any = args[0] if args else kwargs.get("comm_hook_type")
        builtin = getattr(kind, "name", None)
        if builtin not in ("ALLREDUCE", "FP16_COMPRESS"):
            return False
        state.builtin = builtin
        name = str(kind)  # as DDP names it
    try:
        ddp_model.logger._set_comm_hook_name(name)
    except Exception as exc:  # noqa: BLE001 - DDP's logging only
        internal_error("ddp comm hook name", exc)
    return True


def _user_hook_of(args: tuple, kwargs: dict) -> tuple[Any, Callable[..., Any]] | None:
    """(state, hook) of a `register_comm_hook` call, or None when it names no callable hook."""
    bound = dict(zip(("state", "hook"), args, strict=False)) | kwargs
    return (bound["state"], bound["hook"]) if callable(bound.get("hook")) else None


def _reduce_one_gradient(state: CommHookState, grad_and_param: tuple) -> None:
    """Compiled autograd's Python reducer (torch.compile with optimize_ddp="python_reducer") calls
    comm hooks once per parameter with (grad, param) and ignores what they return: the gradient is
    averaged in place exactly as DDP does there without a hook, or by the user's adopted hook."""
    state.per_parameter = True
    if state.user_hook is not None:
        user_state, hook = state.user_hook
        hook(user_state, grad_and_param)
        return
    import torch.distributed._functional_collectives as fcol

    grad = grad_and_param[0]
    group: Any = state.process_group if state.process_group is not None else dist.group.WORLD
    sent = grad.to(torch.float16) if state.builtin == "FP16_COMPRESS" else grad
    grad.copy_(fcol.all_reduce(sent / group.size(), "sum", group))


def _account_launch(state: CommHookState, index: int, buffer: torch.Tensor, last: bool) -> None:
    if index == 0:
        state.launched = []
    state.launched.append(BucketInfo(index, buffer.numel(), buffer.dtype, buffer.device))
    if last:
        state.layout = list(state.launched)
        state.full_backwards += 1


# The state of every live hooked model, for the process-wide stats(); states die with their models.
_live_states: weakref.WeakSet[CommHookState] = weakref.WeakSet()
_STATE_ATTR = "_sddoctor_comm_hook_state"


def installed_state(ddp_model: torch.nn.Module) -> CommHookState | None:
    """The CommHookState of the sddoctor hook on `ddp_model`, or None if it has none."""
    return getattr(ddp_model, _STATE_ATTR, None)


def install_comm_hook(
    ddp_model: torch.nn.parallel.DistributedDataParallel, state: CommHookState | None = None
) -> CommHookState:
    """Register the accounting all-reduce hook on `ddp_model` (before its first backward).

    Returns the state the registered hook uses. If the model already carries this hook (the
    `sddoctor run` bootstrap installs it at DDP construction), no second hook is registered: the
    installed state is returned, and when `state` is given it takes over `state`'s counters and
    callbacks, so use the returned object from then on.
    """
    installed = installed_state(ddp_model)
    if installed is not None:
        if state is not None and state is not installed:
            installed.take_over(state)
            installed.attach(ddp_model.process_group)
        return installed
    if state is None:
        state = CommHookState(ddp_model.process_group)
    else:
        state.attach(ddp_model.process_group)
    ddp_model.register_comm_hook(state, _averaging_allreduce_hook)
    setattr(ddp_model, _STATE_ATTR, state)
    _live_states.add(state)
    return state


def install(ddp_model: torch.nn.parallel.DistributedDataParallel) -> CommHookState:
    """Install the hook on `ddp_model` once; later calls return the installed state."""
    return install_comm_hook(ddp_model)


_CLAIMED_ATTR = "_sddoctor_comm_hook_claimed"
_USER_HOOK_ATTR = "_sddoctor_user_hook_watch"


class UserHookWatch:
    """A user's own comm hook (PowerSGD, fp16 compression) registered on a model: it keeps
    running as registered, and its last bucket of a backward is reported like sddoctor's own
    hook reports it (step inference ends a step there)."""

    def __init__(self) -> None:
        self.on_synced_backward: Callable[[], None] | None = None


def watching_user_hook(ddp_model: torch.nn.Module, hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook` as DDP will call it, with its last bucket reported; sddoctor's own hook as it is."""
    if hook is _averaging_allreduce_hook or not callable(hook):
        return hook
    watch = UserHookWatch()
    ddp_model.__dict__[_USER_HOOK_ATTR] = watch

    def hook_reporting_last_bucket(state: Any, bucket: Any) -> Any:
        fut = hook(state, bucket)  # the user's hook first, exactly as registered
        try:
            if watch.on_synced_backward is not None and bucket.is_last():
                watch.on_synced_backward()
        except Exception as exc:  # noqa: BLE001 - step accounting never breaks the backward
            internal_error("user comm hook watch", exc)
        return fut

    # DDP checks the hook's signature and logs its name: both stay the user's
    return functools.update_wrapper(hook_reporting_last_bucket, hook)


def user_hook_watch(ddp_model: torch.nn.Module) -> UserHookWatch | None:
    """The watch on the user's own comm hook of `ddp_model`, if it carries one."""
    return ddp_model.__dict__.get(_USER_HOOK_ATTR)


def mark_claimed(ddp_model: torch.nn.Module) -> None:
    """Someone registered a comm hook on `ddp_model` (ddp_patch calls this from DDP's register methods)."""
    ddp_model.__dict__[_CLAIMED_ATTR] = True


def install_on_first_forward(ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
    """Install the hook at the model's first forward, unless a comm hook was registered by then.

    The bootstrap calls this at DDP construction: a user's own comm hook (fp16 compression,
    PowerSGD), registered after construction, must still be accepted, and DDP takes only one.
    """

    def _first_forward(module: torch.nn.Module, args: Any) -> None:
        try:
            handle.remove()
            install_unless_claimed(module)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - the model runs without sddoctor's hook then
            internal_error("ddp comm hook install", exc)

    handle = ddp_model.register_forward_pre_hook(_first_forward)


def install_unless_claimed(ddp_model: torch.nn.parallel.DistributedDataParallel) -> CommHookState | None:
    """The installed state; installs the hook now unless the model carries another comm hook."""
    installed = installed_state(ddp_model)
    if installed is not None or ddp_model.__dict__.get(_CLAIMED_ATTR, False):
        return installed
    return install(ddp_model)


def stats() -> dict[str, Any]:
    """Bucket counters summed over every live hooked model of this process (`collectives.ddp`)."""
    for _ in range(3):  # a DDP constructed on another thread may change the set meanwhile
        try:
            states = list(_live_states)
            break
        except RuntimeError:
            states = []
    last = [s.last_bucket_t for s in states if s.last_bucket_t is not None]
    return {
        "buckets": sum(s.buckets for s in states),
        "seconds": round(sum(s.seconds for s in states), 6),
        "last_bucket_t": max(last) if last else None,
        "models": len(states),
    }


def live_bucket_layout(
    ddp_model: torch.nn.parallel.DistributedDataParallel, state: CommHookState
) -> list[BucketInfo]:
    """The bucket layout the other ranks use in this backward.

    DDP rebuilds its buckets once per wrapper, in the forward after the first synchronised
    backward, so a layout recorded before that is stale. After two full backwards of this wrapper
    the recorded layout is final; before that ask the reducer (a private API that allocates the
    zero buckets once; it exists in torch 1.10 to 2.13).
    """
    if state.full_backwards >= 2 and state.layout:
        return list(state.layout)
    reducer = getattr(ddp_model, "reducer", None)
    if reducer is not None and hasattr(reducer, "_get_zeros_like_grad_buckets"):
        buckets = reducer._get_zeros_like_grad_buckets()
        layout = [
            BucketInfo(b.index(), b.buffer().numel(), b.buffer().dtype, b.buffer().device) for b in buckets
        ]
        del buckets
        return layout
    return list(state.layout)


def complete_missing_buckets(
    ddp_model: torch.nn.parallel.DistributedDataParallel, state: CommHookState
) -> int:
    """All-reduce zeros for every bucket this rank did not launch in the current backward.

    Called by a rank whose step failed, so that the ranks still in backward get every bucket
    all-reduce they wait for. Buckets go in index order (the order DDP launches them). One
    zero buffer per dtype and device is reused bucket after bucket to keep the memory small on
    a rank that just ran out of it. Returns the number of buckets posted.
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    sent = {b.index for b in state.launched}
    missing = [b for b in live_bucket_layout(ddp_model, state) if b.index not in sent]
    scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
    for info in missing:
        key = (info.dtype, info.device)
        need = max(b.numel for b in missing if (b.dtype, b.device) == key)
        buf = scratch.get(key)
        if buf is None:
            # the peers send what the hook sends: a compressed bucket goes as float16
            dtype = torch.float16 if state.builtin == "FP16_COMPRESS" else info.dtype
            buf = scratch[key] = torch.zeros(need, dtype=dtype, device=info.device)
        else:
            buf.zero_()  # the previous all-reduce wrote the other ranks' sum into it
        dist.all_reduce(buf[: info.numel], group=group, async_op=True).wait()
    return len(missing)
