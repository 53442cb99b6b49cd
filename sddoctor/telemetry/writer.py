"""The rank-side writer: cheap to call from the training thread, flushed by a background thread.

`emit()` only appends a dict to a deque (no lock, no I/O); a daemon thread turns the queue
into JSON lines every `flush_interval` seconds and rewrites the state snapshot atomically at
most every `state_interval` seconds. State providers (callables returning a dict) let other
components, such as the collective tracer, contribute to the snapshot at flush time instead of
on their hot path.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from sddoctor.telemetry.layout import RunDir, atomic_write_text
from sddoctor.telemetry.schema import SCHEMA_VERSION, STATE_SCHEMA, EventKind

StateProvider = Callable[[], dict[str, Any]]

# how long a process on its way out (a signal, os._exit) waits for another thread's flush
EXIT_FLUSH_TIMEOUT = 2.0


class TelemetryWriter:
    """Buffered event log and state snapshot of one rank."""

    def __init__(
        self,
        run_dir: RunDir | str | os.PathLike[str],
        rank: int,
        *,
        flush_interval: float = 0.5,
        state_interval: float = 1.0,
        start_thread: bool = True,
    ) -> None:
        self.run_dir = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        self.run_dir.ranks_dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.flush_interval = flush_interval
        self.state_interval = state_interval
        self._events: collections.deque[dict[str, Any]] = collections.deque()
        self._state: dict[str, Any] = {
            "schema": STATE_SCHEMA,
            "v": SCHEMA_VERSION,
            "rank": rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }
        self._providers: list[StateProvider] = []
        self._io_lock = threading.Lock()
        self._io_owner: int | None = None  # the thread inside flush(): see flush()
        self._stop = threading.Event()
        self._last_state_write = 0.0
        self._events_path = self.run_dir.events_file(rank)
        self._state_path = self.run_dir.state_file(rank)
        self._closed = False
        self._thread: threading.Thread | None = None
        if start_thread:
            self._thread = threading.Thread(target=self._loop, name=f"sddoctor-telemetry-{rank}", daemon=True)
            self._thread.start()
        atexit.register(self.close)

    # -- called from the training thread: no I/O ---------------------------------------------

    def emit(self, kind: EventKind | str, **fields: Any) -> dict[str, Any]:
        """Queue one event. Returns it (handy in tests)."""
        event = {"v": SCHEMA_VERSION, "t": time.time(), "rank": self.rank, "kind": str(kind), **fields}
        self._events.append(event)
        return event

    def update_state(self, **fields: Any) -> None:
        """Merge fields into the next state snapshot."""
        self._state.update(fields)

    def add_state_provider(self, provider: StateProvider) -> None:
        """Register a callable whose dict is merged into every snapshot (called off the training thread)."""
        self._providers.append(provider)

    # -- I/O ------------------------------------------------------------------------------------

    def flush(self, *, state: bool = True, timeout: float = -1) -> bool:
        """Write queued events now, and the snapshot with `state` or when one is due.

        Safe from any thread, and from a signal handler: one that interrupted this thread's own
        flush (SIGTERM while the rank writes its exception) cannot wait for the lock that the
        interrupted frame holds, so it appends the events on its own and leaves the snapshot to
        that frame. With a `timeout`, gives up (False) rather than wait longer for another
        thread's flush; a process on its way out passes one."""
        me = threading.get_ident()
        if self._io_owner == me:
            self._flush_events()
            return True
        if not self._io_lock.acquire(timeout=timeout):
            return False
        self._io_owner = me
        try:
            self._flush_events()
            if state or time.monotonic() - self._last_state_write >= self.state_interval:
                self._write_state()
        finally:
            self._io_owner = None
            self._io_lock.release()
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        try:
            self.flush()
        except OSError:
            pass

    def _loop(self) -> None:
        while not self._stop.wait(self.flush_interval):
            try:
                self.flush(state=False)  # the snapshot at most every state_interval
            except Exception:  # noqa: BLE001 - telemetry must never kill training
                pass

    def _flush_events(self) -> None:
        if not self._events:
            return
        lines = []
        while self._events:
            try:
                lines.append(json.dumps(self._events.popleft(), default=_json_default))
            except IndexError:
                break
        with open(self._events_path, "a", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")

    def _write_state(self) -> None:
        snapshot = dict(self._state)
        for provider in list(self._providers):
            try:
                snapshot.update(provider())
            except Exception as exc:  # noqa: BLE001
                snapshot.setdefault("provider_errors", []).append(repr(exc))
        snapshot["t"] = time.time()
        atomic_write_text(self._state_path, json.dumps(snapshot, default=_json_default))
        self._last_state_write = time.monotonic()


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if hasattr(obj, "item"):  # numpy / torch scalars
        try:
            return obj.item()
        except Exception:  # noqa: BLE001
            pass
    return str(obj)
