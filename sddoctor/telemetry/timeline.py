"""The collective timeline of one rank: `timeline/rank-NNNNN.jsonl`, its writer and its reader.

The state snapshot only holds the collective in flight and the last one completed, and the
periodic `collective` event only counts; neither says when each rank entered each collective,
which is what "who waited for whom" needs. So every rank also keeps its recently completed
traced calls in a bounded in-memory buffer (`Tracer.recent`), and its heartbeat thread appends
them here about once a second, one JSON line per flush:

    {"v": 1, "t": 1796206650.0, "rank": 3,
     "fields": ["pg", "seq", "op", "t0", "duration", "caller", "async", "peer", "sig"],
     "calls": [["0", 57, "all_reduce", 1796206649.12, 0.0061, 0, false, null, "float32[1024] SUM"], ...],
     "callers": ["/src/train.py:57"], "dropped": 0}

- `fields` names the columns of `calls` (readers map by name, so columns can be added);
  `caller` is an index into this line's `callers`.
- `t0` is the enqueue time (unix seconds), `duration` enqueue to completion. For calls completed
  by polling (`async`: async_op, isend/irecv, any call on CUDA tensors) the completion is known
  to within the heartbeat interval (about a second); `t0` is exact either way.
- `sig`: what every rank must pass alike to the call (its tensors' dtypes and element counts, the
  reduce op), for comparing ranks after the fact; null for calls whose arguments may differ between
  ranks (gather, scatter, all_to_all, object collectives, point-to-point). Older files lack it.
- `dropped`: completed calls that did not fit the buffer since the previous line (more than
  `Tracer.RECENT_MAX` calls within one flush interval).
- The file is bounded: past `MAX_BYTES` it is renamed to `timeline/rank-NNNNN.1.jsonl` (replacing
  the previous one) and a new one is started, so a rank keeps at most about 2 x MAX_BYTES, the
  most recent calls. Readers read the `.1` file first.

Nothing here imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from sddoctor.telemetry.layout import RunDir, append_bounded, rotated_path
from sddoctor.telemetry.reader import read_events
from sddoctor.telemetry.schema import SCHEMA_VERSION

#: folder of the timeline files, beside ranks/
TIMELINE_DIR = "timeline"
FIELDS: tuple[str, ...] = ("pg", "seq", "op", "t0", "duration", "caller", "async", "peer", "sig")
MAX_BYTES = 4 << 20


def timeline_file(run_dir: RunDir, rank: int) -> Path:
    return run_dir.path / TIMELINE_DIR / f"rank-{rank:05d}.jsonl"


class TimelineWriter:
    """Appends flushed calls of one rank. Called from a background thread only (it does I/O)."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes

    def write(
        self, run_dir: RunDir, rank: int, t: float, calls: Sequence[Sequence[Any]], dropped: int = 0
    ) -> None:
        """One line with `calls` (rows in FIELDS order, `caller` as a "file:line" string)."""
        if not calls and not dropped:
            return
        callers: dict[str, int] = {}
        rows = []
        for call in calls:
            row = list(call)
            row[5] = callers.setdefault(str(row[5]), len(callers))
            rows.append(row)
        line = {
            "v": SCHEMA_VERSION,
            "t": t,
            "rank": rank,
            "fields": list(FIELDS),
            "calls": rows,
            "callers": list(callers),
            "dropped": dropped,
        }
        text = json.dumps(line, separators=(",", ":"), default=str) + "\n"
        path = timeline_file(run_dir, rank)
        if not path.parent.is_dir():
            path.parent.mkdir(parents=True, exist_ok=True)
        append_bounded(path, text, self.max_bytes)


def read_timeline(run_dir: RunDir, rank: int) -> tuple[list[dict[str, Any]], int]:
    """The calls this rank flushed (oldest first, as dicts keyed by FIELDS) and how many were dropped.

    Tolerates a torn last line, unknown columns and a missing file (no calls).
    """
    calls: list[dict[str, Any]] = []
    dropped = 0
    path = timeline_file(run_dir, rank)
    for part in (rotated_path(path), path):
        for line in read_events(part):
            dropped += int(line.get("dropped") or 0)
            calls.extend(decode_calls(line))
    calls.sort(key=lambda c: c["t0"])
    return calls, dropped


def decode_calls(line: dict[str, Any]) -> Iterable[dict[str, Any]]:
    """The calls of one timeline line, as dicts keyed by FIELDS (bad rows are skipped)."""
    fields = line.get("fields")
    rows = line.get("calls")
    callers = line.get("callers") or []
    if not isinstance(fields, list) or not isinstance(rows, list):
        return
    for row in rows:
        if not isinstance(row, list) or len(row) != len(fields):
            continue
        call = dict(zip(fields, row, strict=True))
        if not isinstance(call.get("t0"), (int, float)) or not isinstance(call.get("duration"), (int, float)):
            continue
        index = call.get("caller")
        if isinstance(index, int) and 0 <= index < len(callers):
            call["caller"] = callers[index]
        call["pg"] = str(call.get("pg"))
        yield call
