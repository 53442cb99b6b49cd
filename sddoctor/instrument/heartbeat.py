"""The rank's heartbeat: a daemon thread that ticks about once a second.

Each tick polls the tracer's asynchronous works (never blocking), stamps `heartbeat` (the
supervisor tells a live-but-stuck rank from a frozen process by it) and, every
`summary_interval` seconds and at close, emits one `collective` summary event per process
group that did something. Each tick also appends the calls completed since the last tick to the
rank's timeline file (`sddoctor.instrument.timeline`). It feeds the state snapshot through the writer's state provider, so
the training thread never builds a snapshot itself; the snapshot also says where the main thread
is in the user's code (`sddoctor.instrument.position`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from sddoctor.instrument.position import main_thread_cpu_seconds, main_thread_position
from sddoctor.instrument.timeline import TimelineRecorder
from sddoctor.instrument.tracing import Tracer
from sddoctor.telemetry.schema import EventKind
from sddoctor.telemetry.writer import TelemetryWriter


class Heartbeat:
    """Background ticker that owns the `collectives` and `heartbeat` fields of the snapshot."""

    def __init__(
        self,
        writer: TelemetryWriter,
        tracer: Tracer,
        *,
        interval: float = 1.0,
        summary_interval: float = 10.0,
    ) -> None:
        self.writer = writer
        self.tracer = tracer
        self.interval = interval
        self.summary_interval = summary_interval
        self.beat = time.time()
        self._last_summary_t = time.monotonic()
        self._last_summary: dict[str, Any] | None = None
        self.timeline = TimelineRecorder(tracer)
        # one writer of the timeline and the summary at a time: the heartbeat thread, or a
        # process on its way out (flush_now)
        self._writing = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sddoctor-heartbeat", daemon=True)
        writer.add_state_provider(self.state)
        self._thread.start()

    def state(self) -> dict[str, Any]:
        return {
            "collectives": self.tracer.snapshot(),
            "heartbeat": self.beat,
            "main_at": main_thread_position(),
            # the main thread's CPU seconds: the supervisor tells a rank that computes from one
            # that sits blocked (a lock, a read, a sleep) when neither issues collectives nor steps
            "main_cpu_s": main_thread_cpu_seconds(),
        }

    def tick(self) -> None:
        self.tracer.poll()
        self.beat = time.time()
        with self._writing:
            self.timeline.flush(self.writer)
            if time.monotonic() - self._last_summary_t >= self.summary_interval:
                self.emit_summary()

    def flush_now(self) -> None:
        """Write the completed calls and the counts of the last interval now: the process ends
        without atexit (os._exit, with which a worker forked by start_processes ends; a signal),
        and the heartbeat thread dies with it. Gives up after a second rather than hold the exit."""
        if not self._writing.acquire(timeout=1.0):
            return
        try:
            self.timeline.flush(self.writer)
            self.emit_summary()
        except Exception:  # noqa: BLE001 - the exit must happen
            pass
        finally:
            self._writing.release()

    def emit_summary(self) -> None:
        """One `collective` event with counts and seconds per op, if anything changed since the last."""
        self._last_summary_t = time.monotonic()
        summary = self.tracer.summary()
        if not summary["count"] or summary == self._last_summary:
            return
        self._last_summary = summary
        ddp = None
        if self.tracer.ddp_stats is not None:
            try:
                ddp = self.tracer.ddp_stats()
            except Exception:  # noqa: BLE001
                ddp = None
        fields: dict[str, Any] = dict(summary)
        if ddp:
            fields["ddp_buckets"] = ddp.get("buckets")
            fields["ddp_bucket_seconds"] = ddp.get("seconds")
        self.writer.emit(EventKind.COLLECTIVE, **fields)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        try:
            self.tracer.poll()
        except Exception:  # noqa: BLE001 - closing must not raise at exit
            pass
        self.flush_now()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the heartbeat must never kill training
                pass
