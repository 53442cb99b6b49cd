"""Run a callback right after a module is first imported, without importing it ourselves.

This is how `sddoctor run` patches torch.distributed in a user's script for free: a process
that never imports torch pays one entry in `sys.meta_path` and nothing else.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

_callbacks: dict[str, list[Callable[[ModuleType], object]]] = {}
_lock = threading.Lock()


def when_imported(name: str, callback: Callable[[ModuleType], object]) -> None:
    """Call `callback(module)` once `name` has been imported (now, if it already is)."""
    module = sys.modules.get(name)
    if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False) is False:
        _run(callback, module)
        return
    with _lock:
        _callbacks.setdefault(name, []).append(callback)
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder())


def _run(callback: Callable[[ModuleType], object], module: ModuleType) -> None:
    try:
        callback(module)
    except Exception as exc:  # noqa: BLE001 - instrumentation must never break the user's import
        from sddoctor.instrument.safety import internal_error

        internal_error(f"instrumentation of {module.__name__}", exc)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of watched modules so callbacks run after exec."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _callbacks:
            return None
        try:
            return self._wrapped_spec(fullname, path, target)
        except Exception as exc:  # noqa: BLE001 - the import goes on through the other finders
            from sddoctor.instrument.safety import internal_error

            internal_error(f"import hook for {fullname}", exc)
            return None

    def _wrapped_spec(self, fullname: str, path: Any, target: Any) -> Any:
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        spec.loader = _Loader(loader, fullname)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, name: str) -> None:
        self._inner = inner
        self._name = name

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # the module's own code must see its real loader (e.g. for importlib.resources)
        module.__loader__ = self._inner
        if module.__spec__ is not None:
            module.__spec__.loader = self._inner
        self._inner.exec_module(module)
        with _lock:
            callbacks = _callbacks.pop(module.__name__, [])
            if not _callbacks:
                sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
        for callback in callbacks:
            _run(callback, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
