"""Tolerant readers of run directories.

They survive a torn last line (a rank killed mid-write), a missing rank and unknown fields,
because they are used on runs that went wrong.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sddoctor.telemetry.layout import RunDir


def read_json(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A JSON object from a file, or None if it is missing or unreadable."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_events(path: str | os.PathLike[str], kinds: set[str] | None = None) -> list[dict[str, Any]]:
    """All complete events in a .jsonl file; a torn or garbled line is skipped."""
    events: list[dict[str, Any]] = []
    try:
        fh = open(path, encoding="utf-8", errors="replace")
    except OSError:
        return events
    with fh:
        for line in fh:
            event = _parse_line(line)
            if event is not None and (kinds is None or event.get("kind") in kinds):
                events.append(event)
    return events


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
            if start < cutoff and marker in raw:
                continue
            event = _parse_line(raw.decode("utf-8", errors="replace"))
            if event is not None:
                events.append(event)
    return events


def _parse_line(line: str) -> dict[str, Any] | None:
    if not line.endswith("\n"):
        return None  # torn: the writer has not finished this line
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


class EventTail:
    """Incremental reader of one .jsonl file: each `poll()` returns the events added since the last."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = ""
        self._inode: int | None = None

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, encoding="utf-8", errors="replace") as fh:
                stat = os.fstat(fh.fileno())
                if self._inode is not None and (stat.st_ino != self._inode or stat.st_size < self._offset):
                    self._offset, self._partial = 0, ""  # the writer rotated the file: a new one
                self._inode = stat.st_ino
                fh.seek(self._offset)
                chunk = fh.read()
                self._offset = fh.tell()
        except OSError:
            return []
        if not chunk:
            return []
        text = self._partial + chunk
        lines = text.split("\n")
        self._partial = lines.pop()  # "" when the chunk ended on a newline
        out = []
        for line in lines:
            event = _parse_line(line + "\n")
            if event is not None:
                out.append(event)
        return out


@dataclass
class RankView:
    """What one rank has written: its events and its latest state snapshot."""

    rank: int
    events: list[dict[str, Any]] = field(default_factory=list)
    state: dict[str, Any] | None = None

    def last(self, kind: str) -> dict[str, Any] | None:
        for event in reversed(self.events):
            if event.get("kind") == kind:
                return event
        return None

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("kind") == kind]


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

        ranks = {r: RankView(rank=r, events=events(r), state=read_json(rd.state_file(r))) for r in rd.ranks()}
        return cls(run_dir=rd, info=rd.run_info(), ranks=ranks)

    @property
    def world_size(self) -> int | None:
        ws = self.info.get("world_size")
        if isinstance(ws, int):
            return ws
        for view in self.ranks.values():
            start = view.last("start")
            if start and isinstance(start.get("world_size"), int):
                return start["world_size"]
        return None

    def report(self) -> dict[str, Any] | None:
        return read_json(self.run_dir.report_json)
