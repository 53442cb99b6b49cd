"""Rank side of the collective timeline: drain the tracer's recent calls into the timeline file.

The training thread only appends each completed call to `Tracer.recent` (a bounded deque, no
lock, no I/O). The heartbeat thread calls `TimelineRecorder.flush` about once a second, which
turns the drained records into rows and appends one line to `timeline/rank-NNNNN.jsonl`
(format: `sddoctor.telemetry.timeline`). Nothing is written while the session does not know its
rank yet (the records wait in the buffer).
"""

from __future__ import annotations

import math
import time
from typing import Any

from sddoctor.instrument.tracing import dtype_name
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
        payload_signature(rec),
    ]


#: collectives every rank must call with tensors of the same dtype and size (and the same reduce op)
_SAME_PAYLOAD = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "broadcast",
        "reduce",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_gather_single",
        "reduce_scatter_single",
    }
)
#: list forms whose tensors may differ in size between ranks (NCCL's uneven all_gather): their
#: dtypes and reduce op must still agree
_SAME_DTYPE = frozenset({"all_gather", "all_gather_coalesced", "reduce_scatter"})
#: rooted calls whose payloads may differ between ranks (the root's list, the others' none): only
#: the root must agree
_SAME_ROOT = frozenset({"gather", "scatter", "broadcast_object_list", "gather_object", "scatter_object_list"})


def payload_signature(rec: Any) -> str | None:
    """What every rank must pass alike to this call, as text ("float32[32] MAX": each tensor's
    dtype and element count, the reduce op, a rooted call's root), for comparing ranks after the
    fact: a call whose ranks disagree on these can complete and still be wrong (SUM on one rank and
    MAX on another, float32 against int32). Shapes are not compared: the backends see flat memory,
    so a tensor viewed in another shape of the same size is not a mistake. None for calls whose
    arguments may differ between ranks (all_to_all, all_gather_object, point-to-point); gather,
    scatter and the rooted object calls compare their root only."""
    try:
        if rec.op in _SAME_PAYLOAD:
            sizes = [math.prod(shape) for shape in rec.shapes]
            tensors = [f"{dtype_name(d)}[{n}]" for d, n in zip(rec.dtypes, sizes, strict=False)]
        elif rec.op in _SAME_DTYPE:
            tensors = [dtype_name(d) for d in rec.dtypes]
        elif rec.op in _SAME_ROOT and getattr(rec, "root", None) is not None:
            tensors = []
        else:
            return None
        reduce = _reduce_name(rec.reduce)
        root = getattr(rec, "root", None)
    except Exception:  # noqa: BLE001 - an odd record is left uncompared, never a lost flush
        return None
    parts = ([";".join(tensors)] if tensors else []) + ([reduce] if reduce else [])
    return " ".join(parts + ([f"root {root}"] if root is not None else []))


def _reduce_name(op: Any) -> str | None:
    """SUM, MAX, ... of a ReduceOp enum value or instance (PREMUL_SUM keeps its factor apart)."""
    if op is None or isinstance(op, str):
        return op
    name = getattr(op, "name", None) or getattr(getattr(op, "op", None), "name", None)
    return name if isinstance(name, str) else None
