"""Rank side of the collective timeline: drain the tracer's recent calls into the timeline file.

The training thread only appends each completed call to `Tracer.recent` (a bounded deque, no
lock, no I/O). The heartbeat thread calls `TimelineRecorder.flush` about once a second, which
turns the drained records into rows and appends one line to `timeline/rank-NNNNN.jsonl`
(format: `sddoctor.telemetry.timeline`). Nothing is written while the session does not know its
rank yet (the records wait in the buffer).
"""

from __future__ import annotations

import time
from typing import Any

from sddoctor.telemetry.timeline import TimelineWriter


class TimelineRecorder:
    """Moves completed calls from one tracer to the timeline file of the writer's rank."""

    def __init__(self, tracer: Any, file_writer: TimelineWriter | None = None) -> None:
        self.tracer = tracer
        self.file = file_writer or TimelineWriter()
        self._seen = tracer.completed()  # completed calls accounted for so far
        self.dropped = 0

    def flush(self, writer: Any) -> int:
        """Append what completed since the last flush; returns how many calls were written."""
        session = getattr(self.tracer, "session", None)
        if session is not None and not getattr(session, "rank_known", True):
            return 0  # a provisional rank: the file name would be wrong
        total = self.tracer.completed()
        if self.tracer.recent is None:  # the timeline is off: nothing was buffered, nothing dropped
            self._seen = total
            return 0
        records = self.tracer.take_recent()
        expected = total - self._seen
        if len(records) >= expected:
            # calls that completed between the two reads above belong to the next count
            self._seen = total + (len(records) - expected)
            dropped = 0
        else:
            self._seen = total
            dropped = expected - len(records)
        if not records and not dropped:
            return 0
        rows = [_row(rec) for rec in records]
        self.dropped += dropped
        try:
            self.file.write(writer.run_dir, writer.rank, time.time(), rows, dropped)
        except OSError:
            return 0  # a full disk loses these calls, never the heartbeat
        return len(rows)


def _row(rec: Any) -> list[Any]:
    t1 = rec.t1 if rec.t1 is not None else rec.t0
    return [
        rec.key,
        rec.seq,
        rec.op,
        round(rec.t0, 6),
        round(t1 - rec.t0, 6),
        f"{rec.file}:{rec.line}",
        bool(rec.deferred) and not rec.exact_end,  # readers: "completion polled, +-1 s"
        rec.peer,
    ]
