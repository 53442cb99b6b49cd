"""Tolerant readers of run directories.

They survive a torn last line (a rank killed mid-write), a missing rank, unknown fields,
known fields of the wrong type (dropped, see `validate`), oversized files and lines (skipped)
and unreadable files, because they are used on runs that went wrong. What they had to read
around is collected in `validate.PROBLEMS` for the command to print as one warning.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sddoctor.telemetry.layout import RunDir
from sddoctor.telemetry.snapshot import RankSnapshot
from sddoctor.telemetry.validate import PROBLEMS, clean_event, clean_state

#: A JSON file larger than this is not one sddoctor wrote (state snapshots are a few KB).
MAX_JSON_BYTES = 64 << 20
#: An event line longer than this is skipped (events are a few hundred bytes).
MAX_LINE_BYTES = 1 << 20
_CHUNK = 4 << 20


def _source(path: str | os.PathLike[str]) -> str:
    p = Path(path)
    return f"{p.parent.name}/{p.name}" if p.parent.name == "ranks" else p.name


def unreadable(run_dir: str | os.PathLike[str]) -> str | None:
    """Why a run directory (or its ranks/ folder) cannot be read, in a few words; None if it can.
    A missing directory is not this function's business (the caller says "no such directory")."""
    base = Path(run_dir)
    for folder in (base, base / "ranks"):
        try:
            os.listdir(folder)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except PermissionError:
            return f"{folder} cannot be read (permission denied); run as its owner or fix its mode"
        except OSError as exc:
            return f"{folder} cannot be read ({exc.strerror or exc})"
    return None


def read_json(path: str | os.PathLike[str], max_bytes: int = MAX_JSON_BYTES) -> dict[str, Any] | None:
    """A JSON object from a file, or None if it is missing, unreadable, too large or not an object."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        if not isinstance(exc, FileNotFoundError):
            PROBLEMS.note(_source(path), f"cannot be read ({exc.strerror or exc})")
        return None
    if len(data) > max_bytes:
        PROBLEMS.note(_source(path), f"larger than {max_bytes >> 20} MiB: not read")
        return None
    try:
        doc = json.loads(data.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):
        if data.strip():
            PROBLEMS.note(_source(path), "not valid JSON")
        return None
    if not isinstance(doc, dict):
        PROBLEMS.note(_source(path), "not a JSON object")
        return None
    return doc


def read_state(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A rank's state snapshot with its fields checked (see `validate.clean_state`), or None."""
    return clean_state(read_json(path), _source(path)) if os.path.exists(path) else None


def read_snapshot(path: str | os.PathLike[str]) -> RankSnapshot | None:
    """A rank's state snapshot from its file, checked and typed; None when there is none to read."""
    record = read_state(path)
    return RankSnapshot.of(record) if record is not None else None


def read_events(path: str | os.PathLike[str], kinds: set[str] | None = None) -> list[dict[str, Any]]:
    """All complete events in a .jsonl file; a torn, garbled or oversized line is skipped."""
    events = EventTail(path).poll()
    return events if kinds is None else [e for e in events if e.get("kind") in kinds]


def read_events_bounded(
    path: str | os.PathLike[str], *, bulky: str = "step", bulky_bytes: int = 32 << 20
) -> list[dict[str, Any]]:
    """Like `read_events`, but `bulky` events (a long run's step events dwarf everything else) only
    from the last `bulky_bytes` of the file; every other event is kept wherever it is."""
    marker = f'"kind": "{bulky}"'.encode()
    try:
        cutoff = os.path.getsize(path) - bulky_bytes
        fh = open(path, "rb")
    except OSError:
        return []
    events: list[dict[str, Any]] = []
    offset = 0
    with fh:
        for raw in fh:
            start, offset = offset, offset + len(raw)
            if (start < cutoff and marker in raw) or len(raw) > MAX_LINE_BYTES:
                continue
            event = _parse_line(raw.decode("utf-8", errors="replace"), _source(path))
            if event is not None:
                events.append(event)
    return events


def _parse_line(line: str, source: str = "events") -> dict[str, Any] | None:
    if not line.endswith("\n"):
        return None  # torn: the writer has not finished this line
    if not line.strip():
        return None
    try:
        event = json.loads(line)
    except (ValueError, RecursionError):
        PROBLEMS.note(source, "a line that is not JSON")
        return None
    return clean_event(event, source)


class EventTail:
    """Incremental reader of one .jsonl file: each `poll()` returns the events added since the last."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.source = _source(path)
        self._offset = 0
        self._partial = b""
        self._skipping = False  # inside a line longer than MAX_LINE_BYTES
        self._inode: int | None = None

    def poll(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        try:
            fh = open(self.path, "rb")
        except OSError as exc:
            if not isinstance(exc, FileNotFoundError):
                PROBLEMS.note(self.source, f"cannot be read ({exc.strerror or exc})")
            return out
        with fh:
            try:
                stat = os.fstat(fh.fileno())
                if self._inode is not None and (stat.st_ino != self._inode or stat.st_size < self._offset):
                    # the writer rotated the file (timeline files do): read the new one from its start
                    self._offset, self._partial, self._skipping = 0, b"", False
                self._inode = stat.st_ino
                fh.seek(self._offset)
                while chunk := fh.read(_CHUNK):
                    self._offset += len(chunk)
                    self._take(chunk, out)
            except OSError as exc:
                PROBLEMS.note(self.source, f"cannot be read ({exc.strerror or exc})")
        return out

    def _take(self, chunk: bytes, out: list[dict[str, Any]]) -> None:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()  # b"" when the chunk ended on a newline
        for raw in lines:
            if self._skipping:  # the end of an oversized line
                self._skipping = False
                continue
            if len(raw) > MAX_LINE_BYTES:
                PROBLEMS.note(self.source, f"a line over {MAX_LINE_BYTES >> 20} MiB skipped")
                continue
            event = _parse_line(raw.decode("utf-8", errors="replace") + "\n", self.source)
            if event is not None:
                out.append(event)
        if len(self._partial) > MAX_LINE_BYTES:
            PROBLEMS.note(self.source, f"a line over {MAX_LINE_BYTES >> 20} MiB skipped")
            self._partial, self._skipping = b"", True


@dataclass
class RankView:
    """What one rank has written: its events and its latest state snapshot."""

    rank: int
    events: list[dict[str, Any]] = field(default_factory=list)
    state: dict[str, Any] | None = None

    @property
    def snapshot(self) -> RankSnapshot:
        """`state`, typed (all fields None when the rank wrote no snapshot)."""
        return RankSnapshot.of(self.state)

    def last(self, kind: str) -> dict[str, Any] | None:
        for event in self.events[::-1]:
            if event.get("kind") == kind:
                return event
        return None

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("kind") == kind]

    def attempts(self) -> list[RankView]:
        """The rank's events split by process, oldest first: a launcher that restarts its workers
        (torchrun --max-restarts) starts a new process for the rank, which writes a `start` of
        another pid. Each part is a RankView of its own; the snapshot belongs to the last."""
        parts: list[list[dict[str, Any]]] = [[]]
        pid: Any = None
        for event in self.events:
            if event.get("kind") == "start":
                if pid is not None and event.get("pid") != pid and parts[-1]:
                    parts.append([])
                pid = event.get("pid")
            parts[-1].append(event)
        return [
            RankView(rank=self.rank, events=events, state=self.state if i == len(parts) - 1 else None)
            for i, events in enumerate(parts)
        ]


@dataclass
class RunView:
    """A whole run directory read once."""

    run_dir: RunDir
    info: dict[str, Any]
    ranks: dict[int, RankView]

    @classmethod
    def load(cls, run_dir: RunDir | str | os.PathLike[str], *, step_bytes: int | None = None) -> RunView:
        """`step_bytes`: keep step events only from the last that many bytes of each rank's log."""
        rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)

        def events(rank: int) -> list[dict[str, Any]]:
            path = rd.events_file(rank)
            return (
                read_events(path) if step_bytes is None else read_events_bounded(path, bulky_bytes=step_bytes)
            )

        ranks = {
            r: RankView(rank=r, events=events(r), state=read_state(rd.state_file(r))) for r in rd.ranks()
        }
        return cls(run_dir=rd, info=rd.run_info(), ranks=ranks)

    @property
    def world_size(self) -> int | None:
        ws = self.info.get("world_size")
        if isinstance(ws, int):
            return ws
        for view in self.ranks.values():
            start = view.last("start") or {}
            ws = start.get("world_size")
            if isinstance(ws, int):
                return ws
        return None

    def report(self) -> dict[str, Any] | None:
        return read_json(self.run_dir.report_json)
