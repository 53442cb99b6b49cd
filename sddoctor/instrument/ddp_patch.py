"""A place to act on every DistributedDataParallel right after it is constructed.

`install()` wraps `DistributedDataParallel.__init__` (the class, so every way of importing it is
covered) to call the registered post-construct callbacks with the new module, and DDP's comm-hook
registration methods so that a model remembers it has a hook (sddoctor's own hook then stays off it). The default
callback installs the DDP comm hook of `sddoctor.instrument.ddp_hook` (`ddp_hook.install(model)`),
which counts and times the gradient bucket all-reduces; `OOMGuard` takes that hook over when it
wraps the model (DDP allows one comm hook per model).
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any

from sddoctor.instrument.safety import internal_error

PostConstruct = Callable[[Any], None]
_callbacks: list[PostConstruct] = []
#: every DistributedDataParallel of this process (a skip fault holds the rank at their next use)
_live_models: weakref.WeakSet[Any] = weakref.WeakSet()
# torch 2.x names the built-in one with a leading underscore, torch 1.x without
_REGISTER_METHODS = ("register_comm_hook", "register_builtin_comm_hook", "_register_builtin_comm_hook")


def add_post_construct(callback: PostConstruct) -> None:
    """Call `callback(ddp_module)` after every DistributedDataParallel construction."""
    if callback not in _callbacks:
        _callbacks.append(callback)


def live_models() -> list[Any]:
    """The DistributedDataParallel modules of this process that are still alive."""
    for _ in range(3):  # a DDP constructed on another thread may change the set meanwhile
        try:
            return list(_live_models)
        except RuntimeError:
            continue
    return []


def install_comm_hook(model: Any) -> None:
    """Install sddoctor's accounting DDP comm hook at the model's first forward (see ddp_hook)."""
    from sddoctor.instrument import ddp_hook

    ddp_hook.install_on_first_forward(model)


def _marking_registration(register: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a DDP comm-hook registration method so that the model remembers it has a hook."""

    @functools.wraps(register)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _adopted(self, register.__name__, args, kwargs):
            return None  # sddoctor's hook, already on the model, runs the user's from now on
        if register.__name__ == "register_comm_hook":
            args, kwargs = _user_hook_watched(self, args, kwargs)
        result = register(self, *args, **kwargs)
        try:
            from sddoctor.instrument import ddp_hook

            ddp_hook.mark_claimed(self)
        except Exception as exc:  # noqa: BLE001
            internal_error("ddp comm hook registration", exc)
        return result

    wrapper.__sddoctor_original__ = register  # type: ignore[attr-defined]
    return wrapper


def _adopted(model: Any, method: str, args: tuple, kwargs: dict) -> bool:
    """Whether sddoctor's hook on `model` took the user's registration over (see ddp_hook)."""
    from sddoctor.instrument import ddp_hook

    return ddp_hook.installed_state(model) is not None and ddp_hook.adopt_user_hook(
        model, method, args, kwargs
    )


def _user_hook_watched(model: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """register_comm_hook(state, hook)'s arguments with the hook's last bucket reported."""
    try:
        from sddoctor.instrument import ddp_hook

        if "hook" in kwargs:
            kwargs = {**kwargs, "hook": ddp_hook.watching_user_hook(model, kwargs["hook"])}
        elif len(args) >= 2:
            args = (args[0], ddp_hook.watching_user_hook(model, args[1]), *args[2:])
    except Exception as exc:  # noqa: BLE001 - the user's hook is registered as it came then
        internal_error("ddp comm hook registration", exc)
    return args, kwargs


def install(_module: Any = None) -> bool:
    """Wrap DistributedDataParallel.__init__ (idempotent). True if it is wrapped now."""
    mod: Any = sys.modules.get("torch.nn.parallel.distributed")
    if mod is None:
        import torch.nn.parallel.distributed as mod  # noqa: PLC0415
    cls = mod.DistributedDataParallel
    init = cls.__init__
    if getattr(init, "__sddoctor_original__", None) is not None:
        return True

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        try:
            _live_models.add(self)
        except Exception as exc:  # noqa: BLE001 - never break the user's model construction
            internal_error("DDP registry", exc)
        for callback in list(_callbacks):
            try:
                callback(self)
            except Exception as exc:  # noqa: BLE001 - never break the user's model construction
                internal_error(f"DDP post-construct {getattr(callback, '__name__', callback)}", exc)

    __init__.__sddoctor_original__ = init  # type: ignore[attr-defined]
    cls.__init__ = __init__
    for name in _REGISTER_METHODS:
        method = getattr(cls, name, None)
        if method is not None and getattr(method, "__sddoctor_original__", None) is None:
            setattr(cls, name, _marking_registration(method))
    broadcast = getattr(cls, "_distributed_broadcast_coalesced", None)
    if broadcast is not None and getattr(broadcast, "__sddoctor_original__", None) is None:
        cls._distributed_broadcast_coalesced = _traced_buffer_broadcast(broadcast)
    _trace_bucket_rebuild()
    add_post_construct(install_comm_hook)
    from sddoctor.instrument.importhook import when_imported

    when_imported("torch.distributed._composable.replicate", _patch_replicate)
    return True


def _patch_replicate(module: Any) -> None:
    """Have `replicate()` run its DDP's forward pre-hooks before each forward.

    The composable `replicate` builds a DistributedDataParallel over the module's parameters (at
    the first forward) and drives it through `_pre_forward` from a hook of the user's module, never
    calling the DDP module itself: the forward pre-hooks sddoctor puts on every DDP (step inference
    and its faults, the accounting comm hook, a skip fault's hold) would never run."""
    cls: Any = getattr(module, "_ReplicateState", None)
    hook = getattr(cls, "forward_pre_hook", None)
    if hook is None or getattr(hook, "__sddoctor_original__", None) is not None:
        return

    @functools.wraps(hook)
    def forward_pre_hook(self: Any, user_module: Any, args: tuple, kwargs: dict) -> Any:
        if getattr(self, "_init_args", None) or getattr(self, "_init_kwargs", None):
            self.lazy_init()  # builds the DDP now (the hook would, first thing), so its hooks exist
        ddp = getattr(self, "_ddp", None)
        if ddp is not None:
            args, kwargs = _run_forward_pre_hooks(ddp, args, kwargs)
        return hook(self, user_module, args, kwargs)

    forward_pre_hook.__sddoctor_original__ = hook  # type: ignore[attr-defined]
    cls.forward_pre_hook = forward_pre_hook


def _run_forward_pre_hooks(ddp: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Run `ddp`'s forward pre-hooks as calling it would, with the arguments they may replace.
    An injected fault raised by one goes on to the user's forward line, as from a DDP call."""
    with_kwargs = getattr(ddp, "_forward_pre_hooks_with_kwargs", {})
    for key, pre_hook in list(getattr(ddp, "_forward_pre_hooks", {}).items()):
        if key in with_kwargs:
            result = pre_hook(ddp, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = pre_hook(ddp, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args, kwargs


def _reducer_class() -> Any:
    """torch's C++ Reducer class (None where this torch has none)."""
    try:
        from torch._C._distributed_c10d import Reducer
    except Exception:  # noqa: BLE001 - another torch: the rebuild stays untraced
        return None
    return Reducer


def _trace_bucket_rebuild() -> None:
    """Wrap the Reducer's bucket rebuild, which DDP calls before every training forward and which,
    once per model, broadcasts the new bucket order from rank 0 in C++: a rank late to that forward
    keeps the others waiting there, where the wrappers of torch.distributed do not see them."""
    cls = _reducer_class()
    rebuild = getattr(cls, "_rebuild_buckets", None)
    if rebuild is None or getattr(rebuild, "__sddoctor_original__", None) is not None:
        return
    try:
        cls._rebuild_buckets = _traced_rebuild(rebuild)
    except Exception as exc:  # noqa: BLE001 - a class that refuses new attributes: untraced
        internal_error("ddp bucket rebuild", exc)


def _traced_rebuild(method: Callable[..., Any]) -> Callable[..., Any]:
    def _rebuild_buckets(self: Any) -> Any:
        try:
            model = _model_of(self)
            # after its rebuild, or with find_unused_parameters (without static_graph), a model
            # never rebuilds: its forwards pass straight through
            if (
                model is None
                or getattr(model, "_has_rebuilt_buckets", False)
                or (
                    getattr(model, "find_unused_parameters", False)
                    and not getattr(model, "static_graph", False)
                )
            ):
                return method(self)
            from sddoctor.instrument import tracing

            group = model.process_group
        except Exception as exc:  # noqa: BLE001 - the rebuild runs untraced then
            internal_error("ddp bucket rebuild", exc)
            return method(self)
        return tracing.call_if_collective(lambda: method(self), tracing.BUCKET_REBUILD, group, "rebuild")

    _rebuild_buckets.__sddoctor_original__ = method  # type: ignore[attr-defined]
    _rebuild_buckets.__doc__ = getattr(method, "__doc__", None)
    return _rebuild_buckets


def _model_of(reducer: Any) -> Any:
    """The live DistributedDataParallel whose reducer this is (None when none is)."""
    for model in live_models():
        if model.__dict__.get("reducer") is reducer:
            return model
    return None


def _traced_buffer_broadcast(method: Callable[..., Any]) -> Callable[..., Any]:
    """DDP's method that broadcasts the module buffers before each training forward, traced as a
    broadcast on the model's process group: a rank late to its forward (data loading, a straggler,
    a hang before the forward) keeps the others waiting in that broadcast, which torch issues from
    C++ where the wrappers of torch.distributed do not see it."""

    @functools.wraps(method)
    def wrapper(self: Any, tensors: Any, buffer_size: Any, authoritative_rank: int = 0) -> Any:
        def issue(_group: Any, payload: Any) -> Any:
            return method(self, payload, buffer_size, authoritative_rank)

        try:
            from sddoctor.instrument import tracing

            group = self.process_group
        except Exception as exc:  # noqa: BLE001 - the broadcast runs untraced then
            internal_error("ddp buffer broadcast", exc)
            return issue(None, tensors)
        return tracing.call_traced(issue, tracing.BUFFER_BROADCAST, group, tensors)

    wrapper.__sddoctor_original__ = method  # type: ignore[attr-defined]
    return wrapper


def uninstall() -> None:
    mod: Any = sys.modules.get("torch.nn.parallel.distributed")
    if mod is None:
        return
    cls = mod.DistributedDataParallel
    original = getattr(cls.__init__, "__sddoctor_original__", None)
    if original is not None:
        cls.__init__ = original
    for name in (*_REGISTER_METHODS, "_distributed_broadcast_coalesced"):
        original = getattr(getattr(cls, name, None), "__sddoctor_original__", None)
        if original is not None:
            setattr(cls, name, original)
    reducer = _reducer_class()
    original = getattr(getattr(reducer, "_rebuild_buckets", None), "__sddoctor_original__", None)
    if original is not None:
        reducer._rebuild_buckets = original
