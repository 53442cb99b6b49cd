"""PyTorch's NCCL flight recorder: ask every rank for a dump on a hang and summarize it.

With `TORCH_FR_BUFFER_SIZE` / `TORCH_NCCL_TRACE_BUFFER_SIZE` set, each NCCL rank keeps its last collectives in a ring
buffer. Writing to the pipe `TORCH_NCCL_DEBUG_INFO_PIPE_FILE<rank>.pipe` makes the rank write
the buffer to `TORCH_NCCL_DEBUG_INFO_TEMP_FILE<rank>` (a pickle). The rank environment of
`sddoctor run` points both into the run directory. Gloo has no flight recorder.

Nothing read here can run code. A dump is read only when its path lies inside this run's
directory (a prefix the user pointed elsewhere, say /tmp, is not read: anyone may write there),
when it is a regular file (not a link) owned by this user and written after the run started, and
when it is smaller than `MAX_DUMP_BYTES`. It is parsed as JSON when it is JSON (torch's
`_dump_fr_trace_json` format), else by `SafeUnpickler`, which builds plain containers and
scalars only: any other class or function named in the pickle is an error, never imported.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import stat
import time
from pathlib import Path
from typing import Any

from sddoctor.instrument.flight_recorder import pipe_path, trigger_dump
from sddoctor.telemetry.layout import RUN_DIR_ENV
from sddoctor.telemetry.runinfo import read_run_info

PIPE_ENV = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"
DUMP_ENV = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
#: A dump of 2000 entries is well under 10 MB; anything larger is not one.
MAX_DUMP_BYTES = 64 << 20
#: File times are compared with the run's start with this much slack (clock granularity).
MTIME_SLACK = 2.0


def _same(value: Any, *_: Any) -> Any:
    return value


#: The only globals a flight-recorder pickle may name: TorchScript's list builders, which return
#: their argument (`torch/jit/_pickle.py`); older torch builds wrote them around typed lists.
_ALLOWED_GLOBALS = {
    ("torch.jit._pickle", name): _same
    for name in (
        "build_intlist",
        "build_doublelist",
        "build_boollist",
        "build_tensorlist",
        "restore_type_tag",
    )
}


class UnsafeDump(ValueError):
    """A dump that is not plain data (it names a class or function)."""


class SafeUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, tuples, sets, str, bytes, numbers, bools and None; nothing callable."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED_GLOBALS.get((module, name))
        if allowed is None:
            raise UnsafeDump(f"the pickle names {module}.{name}; only plain data is read")
        return allowed

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeDump("the pickle uses persistent ids; only plain data is read")


def safe_loads(data: bytes) -> Any:
    """Plain data from a JSON document or a restricted pickle. Raises ValueError otherwise."""
    if data[:1] in (b"{", b"["):
        return json.loads(data.decode("utf-8"))
    try:
        return SafeUnpickler(io.BytesIO(data)).load()
    except UnsafeDump:
        raise
    except Exception as exc:  # noqa: BLE001 - truncated or garbled: EOFError, UnpicklingError, ...
        raise ValueError(f"not a readable dump ({type(exc).__name__}: {exc})") from None


def _run_dir(env: dict[str, str]) -> Path | None:
    value = env.get(RUN_DIR_ENV)
    return Path(value).resolve() if value else None


def _inside(prefix: str, run_dir: Path | None) -> bool:
    """Whether `prefix` (a path prefix, not a directory) lies inside the run directory."""
    if run_dir is None:
        return False
    parent = Path(prefix).parent.resolve()
    return parent == run_dir or run_dir in parent.parents


def trigger(env: dict[str, str], ranks: list[int]) -> list[int]:
    """Write to each rank's dump pipe (never blocks). Returns the ranks that were asked.

    Only FIFOs of this user inside the run directory are written to."""
    prefix = env.get("TORCH_FR_DEBUG_INFO_PIPE_FILE") or env.get(PIPE_ENV)
    if not prefix or not _inside(prefix, _run_dir(env)):
        return []
    asked = []
    for rank in ranks:
        try:
            st = os.lstat(pipe_path(prefix, rank))
        except OSError:
            continue
        if not stat.S_ISFIFO(st.st_mode) or st.st_uid != os.getuid():
            continue
        if trigger_dump(prefix, rank):  # no reader: not NCCL, or the rank never created the pipe
            asked.append(rank)
    return asked


def collect(
    env: dict[str, str], ranks: list[int], wait: float = 3.0, asked_at: float | None = None
) -> dict[str, Any] | None:
    """Read the dumps that appear within `wait` seconds and keep, per rank, its last entries.

    `asked_at` (epoch seconds of the trigger) is kept with them: a rank that dies of a signal
    shortly after its dump was asked for may have been killed by the dump itself (see
    `diagnose_crash.DUMP_CRASH_WINDOW`)."""
    prefix = env.get("TORCH_FR_DEBUG_INFO_TEMP_FILE") or env.get(DUMP_ENV)
    if not prefix:
        return None
    run_dir = _run_dir(env)
    if not _inside(prefix, run_dir):
        note = f"dumps go to {prefix!r}, outside the run directory: not read (anyone may write there)"
        return {"ranks": {}, "asked_at": asked_at, "problem": note}
    started = read_run_info(run_dir).started if run_dir is not None else None
    deadline = time.monotonic() + wait
    found: dict[str, Any] = {}
    rejected: dict[str, str] = {}
    while time.monotonic() < deadline and len(found) < len(ranks):
        for rank in ranks:
            path = Path(f"{prefix}{rank}")
            if str(rank) in found or not os.path.lexists(path):
                continue
            try:
                summary = summarize(path, since=started)
            except UnsafeDump as exc:
                rejected[str(rank)] = str(exc)
                continue
            if summary is not None:
                found[str(rank)] = summary
        time.sleep(0.2)
    out: dict[str, Any] = {"ranks": found}
    if rejected:
        out["rejected"] = rejected
    if asked_at is not None:
        out["asked_at"] = asked_at  # even with no dump: the request time counts
        return out
    return out if found or rejected else None


def read_dump(path: Path, since: float | None = None) -> Any:
    """The plain data of one dump file, or None when it is not (yet) a dump this run can trust.

    Raises UnsafeDump when the file is a pickle naming a class or function."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None  # missing, unreadable, or a symbolic link
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > MAX_DUMP_BYTES:
            return None
        if since is not None and st.st_mtime < since - MTIME_SLACK:
            return None  # left over from an earlier run
        data = fh.read(MAX_DUMP_BYTES + 1)
    try:
        return safe_loads(data)
    except UnsafeDump:
        raise
    except ValueError:
        return None  # half-written: the next poll reads it again


def summarize(path: Path, last: int = 5, since: float | None = None) -> dict[str, Any] | None:
    """The last entries of one rank's dump: seq, op, sizes, state (scheduled/started/completed)."""
    data = read_dump(path, since)
    if data is None:
        return None
    entries = data.get("entries", []) if isinstance(data, dict) else []
    entries = entries if isinstance(entries, list) else []
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
