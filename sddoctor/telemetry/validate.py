"""What a reader keeps of a telemetry record: the documented fields with the documented types.

Run directories are read after things went wrong: a rank killed mid-write, a disk that filled
up, a file edited by hand, a newer sddoctor. Readers therefore check each record they hand on:
a known field of the wrong type is dropped (the diagnosis treats it as missing), a record that is
not a JSON object is skipped, unknown fields pass through untouched (newer writers may add
them), and numbers must be finite. What was dropped is noted in `PROBLEMS`, which a command
prints as one warning (`sddoctor report`, `sddoctor tui --once`).

Types: "int" (not bool), "num" (int or float, finite, not bool), "str", "bool", "list", "dict",
"num|str", "int?" (int or null). The schema is docs/telemetry.md.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from typing import Any

from sddoctor.telemetry.schema import SCHEMA_VERSION

_COLLECTIVE_RECORD = {
    "pg": "int|str",
    "seq": "int",
    "op": "str",
    "shapes": "list",
    "dtypes": "list",
    "caller": "str",
    "since": "num",
    "async": "bool",
    "waiting": "num",
    "t": "num",
    "duration": "num",
}
_LAST_STEP = {
    "step": "int",
    "loss": "num",
    "samples": "num",
    "step_time": "num",
    "micro_batch": "int",
    "grad_accum": "int",
    "mem_alloc": "num",
    "mem_peak": "num",
    "mem_reserved": "num",
    "images_per_s": "num",
    "lr": "num",
    "t": "num",
}
STATE_FIELDS = {
    "v": "int",
    "t": "num",
    "rank": "int",
    "pid": "int",
    "host": "str",
    "local_rank": "int",
    "world_size": "int",
    "device": "int|str",
    "backend": "str",
    "status": "str",
    "step": "int",
    "last_step": "dict",
    "phase": "str",
    "phase_since": "num",
    "collectives": "dict",
    "heartbeat": "num",
    "provider_errors": "list",
}
_COLLECTIVES = {
    "inflight": "list",
    "last_done": "dict",
    "failed": "dict",
    "issued": "dict",
    "totals": "dict",
    "ddp": "dict",
    "recent": "list",
}
EVENT_FIELDS = {"v": "int", "t": "num", "rank": "int", "kind": "str"}
EVENT_KIND_FIELDS: dict[str, dict[str, str]] = {
    "start": {"pid": "int", "host": "str", "local_rank": "int", "world_size": "int", "argv": "list"},
    "step": _LAST_STEP,
    "collective": {"count": "num", "seconds": "num", "ops": "dict", "last_seq": "dict"},
    "oom": {
        "step": "int?",
        "phase": "str",
        "micro_batch": "int",
        "grad_accum": "int",
        "mem_alloc": "num",
        "mem_reserved": "num",
        "mem_total": "num",
        "message": "str",
    },
    "fallback": {"step": "int?", "failed_ranks": "list", "step_applied": "bool"},
    "warning": {"code": "str", "message": "str"},
    "fault": {"fault": "str", "seq": "int", "step": "int", "caller": "str", "pg": "int|str", "op": "str"},
    "checkpoint": {"step": "int?", "path": "str", "seconds": "num", "reason": "str", "action": "str"},
    "exception": {"type": "str", "message": "str", "traceback": "list", "caller": "str", "step": "int?"},
    "exit": {"status": "str", "code": "int?", "step": "int?"},
    "replicas": {"step": "int?", "params_sha256": "str"},
}
RUN_FIELDS = {
    "command": "list",
    "started": "num",
    "created": "num",
    "host": "str",
    "launcher": "str",
    "world_size": "int?",
    "node_rank": "int",
    "supervisor_pid": "int",
    "options": "dict",
    "endpoint": "str?",
    "fault": "str?",
}
_RUN_OPTIONS = {"hang_timeout": "num", "startup_timeout": "num", "straggler_ratio": "num", "on_hang": "str"}


def _ok(value: Any, kind: str) -> bool:
    for one in kind.split("|"):
        if one.endswith("?"):
            if value is None:
                return True
            one = one[:-1]
        if one == "int" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if (
            one == "num"
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
        ):
            return True
        if one == "str" and isinstance(value, str):
            return True
        if one == "bool" and isinstance(value, bool):
            return True
        if one == "list" and isinstance(value, list):
            return True
        if one == "dict" and isinstance(value, dict):
            return True
    return False


class Problems:
    """Problems met while reading, by file: each command prints them once, as one warning."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_source: dict[str, dict[str, int]] = {}

    def note(self, source: str, problem: str) -> None:
        with self._lock:
            counts = self._by_source.setdefault(source, {})
            if len(counts) < 20 or problem in counts:
                counts[problem] = counts.get(problem, 0) + 1

    def drain(self) -> list[str]:
        """One line per file and problem ('ranks/rank-00001.jsonl: 3 lines not JSON'); forgets them."""
        with self._lock:
            found, self._by_source = self._by_source, {}
        return [
            f"{source}: {problem}" + (f" (x{n})" if n > 1 else "")
            for source, problems in found.items()
            for problem, n in problems.items()
        ]

    def summary(self) -> str | None:
        """The problems as the one warning a command prints, or None."""
        lines = self.drain()
        if not lines:
            return None
        more = f"; and {len(lines) - 3} more" if len(lines) > 3 else ""
        return "read around garbled telemetry: " + "; ".join(lines[:3]) + more


PROBLEMS = Problems()


def clean(record: Any, fields: Mapping[str, str], source: str) -> dict[str, Any] | None:
    """`record` with its known fields of the wrong type dropped; None when it is not an object."""
    if not isinstance(record, dict):
        PROBLEMS.note(source, "a record that is not a JSON object")
        return None
    out = dict(record)
    for key, kind in fields.items():
        if key in out and not _ok(out[key], kind):
            PROBLEMS.note(source, f"field {key!r} of the wrong type")
            del out[key]
    return out


def _records(value: Any, source: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        return []
    return [r for r in (clean(v, _COLLECTIVE_RECORD, source) for v in value) if r is not None]


def clean_state(snapshot: Any, source: str) -> dict[str, Any] | None:
    """A rank's state snapshot (`ranks/rank-NNNNN.state`) fit for the readers."""
    out = clean(snapshot, STATE_FIELDS, source)
    if out is None:
        return None
    _check_version(out, source)
    if "last_step" in out:
        out["last_step"] = clean(out["last_step"], _LAST_STEP, source) or {}
    colls = out.get("collectives")
    if isinstance(colls, dict):
        colls = clean(colls, _COLLECTIVES, source) or {}
        for key in ("inflight", "recent"):
            if key in colls:
                colls[key] = _records(colls[key], source)
        for key in ("last_done", "failed"):
            if key in colls:
                record = clean(colls[key], _COLLECTIVE_RECORD, source)
                if record is None:
                    del colls[key]
                else:
                    colls[key] = record
        if "issued" in colls:
            colls["issued"] = {str(k): v for k, v in colls["issued"].items() if _ok(v, "int")}
        for key, fields in (
            ("totals", {"count": "num", "seconds": "num"}),
            ("ddp", {"buckets": "num", "seconds": "num"}),
        ):
            if key in colls:
                colls[key] = clean(colls[key], fields, source) or {}
        out["collectives"] = colls
    return out


def clean_event(event: Any, source: str) -> dict[str, Any] | None:
    """One event of `ranks/rank-NNNNN.jsonl` fit for the readers (None: skip it)."""
    out = clean(event, EVENT_FIELDS, source)
    if out is None:
        return None
    _check_version(out, source)
    fields = EVENT_KIND_FIELDS.get(str(out.get("kind")))
    if fields:
        out = clean(out, fields, source) or {}
    if out.get("kind") == "exception" and isinstance(out.get("traceback"), list):
        out["traceback"] = [str(x) for x in out["traceback"]]
    return out


def clean_run_info(info: Any, source: str = "run.json") -> dict[str, Any]:
    """run.json fit for the readers ({} when it is not an object)."""
    out = clean(info, RUN_FIELDS, source) or {}
    if isinstance(out.get("command"), list):
        out["command"] = [str(w) for w in out["command"]]
    if "options" in out:
        options = clean(out["options"], _RUN_OPTIONS, source) or {}
        for key in ("hang_timeout", "straggler_ratio"):
            if key in options and options[key] <= 0:
                PROBLEMS.note(source, f"options.{key} is not positive")
                del options[key]
        out["options"] = options
    return out


def _check_version(record: dict[str, Any], source: str) -> None:
    v = record.get("v")
    if isinstance(v, int) and v > SCHEMA_VERSION:
        PROBLEMS.note(source, f"written by a newer sddoctor (schema v{v}; this one reads v{SCHEMA_VERSION})")
