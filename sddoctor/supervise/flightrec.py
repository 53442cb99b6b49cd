"""PyTorch's NCCL flight recorder: ask every rank for a dump on a hang and summarize it.

With `TORCH_FR_BUFFER_SIZE` / `TORCH_NCCL_TRACE_BUFFER_SIZE` set, each NCCL rank keeps its last collectives in a ring
buffer. Writing to the pipe `TORCH_NCCL_DEBUG_INFO_PIPE_FILE<rank>.pipe` makes the rank write
the buffer to `TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>` (a pickle). The rank environment of
`sddoctor run` points both into the run directory. Gloo has no flight recorder.
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path
from typing import Any

from sddoctor.instrument.flight_recorder import trigger_dump

PIPE_ENV = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"
DUMP_ENV = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"


def trigger(env: dict[str, str], ranks: list[int]) -> list[int]:
    """Write to each rank's dump pipe (never blocks). Returns the ranks that were asked."""
    prefix = env.get("TORCH_FR_DEBUG_INFO_PIPE_FILE") or env.get(PIPE_ENV)
    if not prefix:
        return []
    asked = []
    for rank in ranks:
        if trigger_dump(prefix, rank):  # no reader: not NCCL, or the rank never created the pipe
            asked.append(rank)
    return asked


def collect(
    env: dict[str, str], ranks: list[int], wait: float = 3.0, asked_at: float | None = None
) -> dict[str, Any] | None:
    """Read the dumps that appear within `wait` seconds and keep, per rank, its last entries.

    `asked_at` (epoch seconds of the trigger) is kept with them: a rank that dies of a signal
    shortly after its dump was asked for may have been killed by the dump itself (see
    `diagnose.DUMP_CRASH_WINDOW`)."""
    prefix = env.get("TORCH_FR_DEBUG_INFO_TEMP_FILE") or env.get(DUMP_ENV)
    if not prefix:
        return None
    deadline = time.monotonic() + wait
    found: dict[str, Any] = {}
    while time.monotonic() < deadline and len(found) < len(ranks):
        for rank in ranks:
            path = Path(f"{prefix}{rank}")
            if str(rank) in found or not path.exists():
                continue
            summary = summarize(path)
            if summary is not None:
                found[str(rank)] = summary
        time.sleep(0.2)
    if asked_at is not None:
        return {"ranks": found, "asked_at": asked_at}  # even with no dump: the request time counts
    return {"ranks": found} if found else None


def summarize(path: Path, last: int = 5) -> dict[str, Any] | None:
    """The last entries of one rank's dump: seq, op, sizes, state (scheduled/started/completed)."""
    try:
        with open(path, "rb") as fh:
            data = pickle.load(fh)  # written by torch in this run's directory
    except Exception:  # noqa: BLE001 - half-written or foreign file
        return None
    entries = data.get("entries", []) if isinstance(data, dict) else []
    keep = []
    for e in entries[-last:]:
        if isinstance(e, dict):
            keep.append(
                {
                    "seq": e.get("collective_seq_id"),
                    "pg": e.get("process_group"),
                    "op": e.get("profiling_name"),
                    "input_sizes": e.get("input_sizes"),
                    "state": e.get("state"),
                    "time_discovered_started_ns": e.get("time_discovered_started_ns"),
                }
            )
    return {"file": str(path), "entries": keep, "total": len(entries)}
