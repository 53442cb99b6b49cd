"""Python callbacks that sddoctor hands to a collective backend's threads, and the wait at exit
until those threads have let go of them.

gloo runs a future's callbacks (`then`, `add_done_callback`) on its worker thread and drops each
one after it ran, which takes the GIL. Completing the future wakes the rank's main thread first,
so on a loaded machine the worker can be descheduled between the two while the main thread runs
to the end of the program. If the drop comes after the interpreter began to shut down, taking the
GIL ends the worker thread inside C++ and the process aborts ("terminate called without an active
exception", SIGABRT) after a run that succeeded. DDP's own C++ reducer holds no Python callback, so
a program that never had one must not get that abort from sddoctor's.

So each callback is counted from the moment it starts running until it is dropped, and the rank's
exit (`wait_until_released`, from the session's atexit close) waits, bounded, for the count to
reach zero. A callback whose future never completes (a peer died) is never counted: nothing waits
for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
_alive = 0  # callbacks made and not dropped yet (run or not)
_ran_alive = 0  # of those, the ones that started running

#: how long the exit waits for callbacks that ran to be dropped
RAN_TIMEOUT = 2.0
#: how long it waits for callbacks that have not run: a completed future's run within
#: milliseconds, while one whose collective never completes (a dead peer) never does
PENDING_TIMEOUT = 0.25


class BackendCallback:
    """`fn` as a future's callback, counted until the backend thread that ran it drops it."""

    __slots__ = ("fn", "ran")

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        global _alive
        self.fn = fn
        self.ran = False
        with _lock:
            _alive += 1

    def __call__(self, fut: Any) -> Any:
        global _ran_alive
        if not self.ran:
            with _lock:
                _ran_alive += 1
            self.ran = True
        return self.fn(fut)

    def __del__(self) -> None:
        global _alive, _ran_alive
        try:
            del self.fn  # what `fn` holds goes first: only then is nothing of it left to drop
            with _lock:
                _alive -= 1
                if self.ran:
                    _ran_alive -= 1
        except Exception:  # noqa: BLE001 - module globals may be gone at interpreter shutdown
            pass


def counts() -> tuple[int, int]:
    """(callbacks not dropped yet, of which the ones that ran)."""
    return _alive, _ran_alive


def wait_until_released(
    ran_timeout: float = RAN_TIMEOUT, pending_timeout: float = PENDING_TIMEOUT, poll: float = 0.001
) -> bool:
    """Wait, sleeping so that the GIL is free for the backend threads, until every callback that
    ran has been dropped (at most `ran_timeout`) and every one that has not run has run and been
    dropped (at most `pending_timeout`). True when none is left."""
    start = time.monotonic()
    while True:
        alive, ran = _alive, _ran_alive
        if alive <= 0:
            return True
        waited = time.monotonic() - start
        if waited >= ran_timeout or (ran <= 0 and waited >= pending_timeout):
            return False
        time.sleep(poll)
