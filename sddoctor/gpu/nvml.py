"""One place that loads NVML (pynvml from the nvidia-ml-py distribution).

Everything that reads NVML goes through `nvml()`, which initialises the library once per
process and says why when it cannot: no pynvml installed, no driver, no GPU. Callers show
that reason instead of crashing, so the TUI and check-nccl still work on a machine without GPUs.
Tests fake NVML at this edge (see `set_nvml_for_tests`).
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here; str() says why in words a user can act on."""


_lock = threading.Lock()
_module: Any = None
_error: str | None = None


def nvml() -> Any:
    """The initialised pynvml module. Raises NvmlUnavailable with the reason."""
    global _module, _error
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise NvmlUnavailable(_error)
        try:
            import pynvml
        except ImportError:
            _error = "pynvml is not installed (pip install nvidia-ml-py)"
            raise NvmlUnavailable(_error) from None
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # pynvml raises NVMLError subclasses; the driver may be absent entirely
            _error = (
                f"NVML could not start ({_describe(exc)}): no NVIDIA driver or GPU visible to this process"
            )
            raise NvmlUnavailable(_error) from None
        _module = pynvml
        return _module


def nvml_available() -> bool:
    try:
        nvml()
    except NvmlUnavailable:
        return False
    return True


def unavailable_reason() -> str | None:
    try:
        nvml()
    except NvmlUnavailable as exc:
        return str(exc)
    return None


def set_nvml_for_tests(module: ModuleType | Any | None, error: str | None = None) -> None:
    """Install a fake pynvml-like module (or an error) in place of the real one."""
    global _module, _error
    with _lock:
        _module, _error = module, error


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if isinstance(text, str) else repr(text)


def as_str(value: Any) -> str:
    """NVML returns bytes in old bindings and str in new ones."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
