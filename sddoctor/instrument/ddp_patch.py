"""A place to act on every DistributedDataParallel right after it is constructed.

`install()` wraps `DistributedDataParallel.__init__` (the class, so every way of importing it is
covered) to call the registered post-construct callbacks with the new module. The default
callback installs the DDP comm hook of `sddoctor.instrument.ddp_hook` when that module exists
(`ddp_hook.install(model)`), which counts and times the gradient bucket all-reduces.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

PostConstruct = Callable[[Any], None]
_callbacks: list[PostConstruct] = []


def add_post_construct(callback: PostConstruct) -> None:
    """Call `callback(ddp_module)` after every DistributedDataParallel construction."""
    if callback not in _callbacks:
        _callbacks.append(callback)


def install_comm_hook(model: Any) -> None:
    """Install sddoctor's DDP comm hook if this build of sddoctor has one."""
    try:
        from sddoctor.instrument import ddp_hook  # type: ignore[attr-defined]
    except ImportError:
        return
    install = getattr(ddp_hook, "install", None)
    if callable(install):
        install(model)


def install(_module: Any = None) -> bool:
    """Wrap DistributedDataParallel.__init__ (idempotent). True if it is wrapped now."""
    mod = sys.modules.get("torch.nn.parallel.distributed")
    if mod is None:
        import torch.nn.parallel.distributed as mod  # noqa: PLC0415
    cls = mod.DistributedDataParallel
    init = cls.__init__
    if getattr(init, "__sddoctor_original__", None) is not None:
        return True

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        for callback in list(_callbacks):
            try:
                callback(self)
            except Exception as exc:  # noqa: BLE001 - never break the user's model construction
                print(f"sddoctor: DDP post-construct {callback!r} failed: {exc!r}", file=sys.stderr)

    __init__.__sddoctor_original__ = init  # type: ignore[attr-defined]
    cls.__init__ = __init__
    add_post_construct(install_comm_hook)
    return True


def uninstall() -> None:
    mod = sys.modules.get("torch.nn.parallel.distributed")
    if mod is None:
        return
    cls = mod.DistributedDataParallel
    original = getattr(cls.__init__, "__sddoctor_original__", None)
    if original is not None:
        cls.__init__ = original
