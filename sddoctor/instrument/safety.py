"""sddoctor's own failures inside a rank: recorded, never raised into the user's program.

Every hook, patch and wrapper that sddoctor puts into a rank (collective tracing, the DDP comm hook,
exit hooks, the import hook, the public `sdi.*` functions) catches its own errors and hands them to
`internal_error`. That writes one `internal_error` event per site (the report lists it as
sddoctor's problem, never as the user's) and one line on stderr, and the job goes on as it would
without sddoctor.
"""

from __future__ import annotations

import functools
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_reported: set[str] = set()
#: errors seen before a session could record them (written once one exists)
_pending: list[dict[str, Any]] = []


def is_injected(exc: BaseException) -> bool:
    """True for the exceptions that fault injection raises on purpose (they must propagate)."""
    return bool(getattr(type(exc), "sddoctor_injected", False))


def internal_error(where: str, exc: BaseException) -> None:
    """Record that sddoctor failed at `where` (once per site). Never raises."""
    try:
        if where in _reported or _raised_by_signal_handler(exc):
            return
        _reported.add(where)
        frames = traceback.extract_tb(exc.__traceback__)
        fields = {
            "where": where,
            "type": type(exc).__name__,
            "message": str(exc)[:2000],
            "traceback": [f"{fs.filename}:{fs.lineno} in {fs.name}" for fs in frames][-32:],
        }
        print(
            f"sddoctor: internal error in {where} ({type(exc).__name__}: {str(exc)[:200]}); "
            "recorded in the run directory, the job is not affected",
            file=sys.stderr,
            flush=True,
        )
        if not _emit(fields):
            _pending.append(fields)
    except Exception:  # noqa: BLE001 - the last line of defence must not raise either
        pass


def _raised_by_signal_handler(exc: BaseException) -> bool:
    """Whether one of the program's signal handlers raised `exc`: a handler runs wherever the main
    thread is when the signal comes, inside sddoctor's code too (Lightning's SIGTERM handler
    broadcasts, and fails once a peer is gone), and its error is the program's, not sddoctor's."""
    handlers = set()
    for number in signal.valid_signals():
        try:
            handler = signal.getsignal(number)
        except (OSError, ValueError):
            continue
        # a function or bound method has __code__; a callable object, its class's __call__
        call = type(handler).__call__ if callable(handler) else None
        code = getattr(handler, "__code__", None) or getattr(call, "__code__", None)
        if code is not None:
            handlers.add(code)
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in handlers:
            return True
        tb = tb.tb_next
    return False


def flush_pending() -> None:
    """Write the errors recorded before the session existed (the session calls this once it does)."""
    while _pending:
        fields = _pending.pop(0)
        if not _emit(fields):
            _pending.insert(0, fields)
            return


def _emit(fields: dict[str, Any]) -> bool:
    api = sys.modules.get("sddoctor.instrument.api")
    session = api.active() if api is not None else None
    if session is None:
        return False
    from sddoctor.telemetry.schema import EventKind

    session.writer.emit(EventKind.INTERNAL_ERROR, **fields)
    return True


def guarded(where: str, default: Any = None) -> Callable[[F], F]:
    """Decorator: errors of the function are recorded by `internal_error` and `default` is returned.

    Exceptions raised on purpose by fault injection still propagate.
    """

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001
                if is_injected(exc):
                    raise
                internal_error(where, exc)
                return default

        return wrapper  # type: ignore[return-value]

    return decorate
