"""Where the rank's main thread stands in the user's own code, and how busy it is, read from
another thread.

The heartbeat puts it into every state snapshot (`main_at`, about once a second). The supervisor
then knows a rank's line without attaching to it: where py-spy cannot (ptrace not permitted, as in
many containers; `--on-hang wait`), and where nothing can any more, a rank killed by SIGKILL (the
kernel's OOM killer), which runs no code of its own as it dies. Its CPU clock (`main_cpu_s`)
tells the supervisor a rank that computes outside any collective from one that sits blocked.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from typing import Any

from sddoctor.codepaths import current_roots

#: frames walked outwards from the innermost, at most (a deep recursion is not walked to its root)
_MAX_DEPTH = 256


def main_thread_position() -> dict[str, str] | None:
    """The innermost frame of the user's code on the main thread's stack, as {at: "file:line",
    function}; None when the main thread runs no code of the user's (still importing torch, at
    its exit) or cannot be read. Never raises: it runs on the rank's heartbeat."""
    try:
        frame = sys._current_frames().get(threading.main_thread().ident or -1)
        return innermost_user_frame(frame)
    except Exception:  # noqa: BLE001 - a position is a nicety; the rank's work is not
        return None


def main_thread_cpu_seconds() -> float | None:
    """CPU seconds the main thread has used (its own clock; other threads' work is not in it), or
    None where the platform has no per-thread clock. Never raises."""
    try:
        ident = threading.main_thread().ident
        if ident is None:
            return None
        return round(time.clock_gettime(time.pthread_getcpuclockid(ident)), 3)
    except (AttributeError, OSError, OverflowError, ValueError):
        return None


def innermost_user_frame(frame: Any) -> dict[str, str] | None:
    """The innermost frame of the user's code from `frame` outwards (None if there is none)."""
    depth = 0
    while frame is not None and depth < _MAX_DEPTH:
        code = frame.f_code
        if _is_user_file(code.co_filename):
            return {"at": f"{code.co_filename}:{frame.f_lineno}", "function": code.co_name}
        frame = frame.f_back
        depth += 1
    return None


@functools.lru_cache(maxsize=4096)
def _is_user_file(filename: str) -> bool:
    return current_roots().is_user(filename)
