"""Where things live inside a run directory.

RUN_DIR/
  run.json                 command, start time, host, world size, sddoctor version, schema version
  ranks/rank-00003.jsonl   append-only events of global rank 3
  ranks/rank-00003.state   latest snapshot of rank 3, replaced atomically about once a second
  timeline/rank-00003.jsonl  rank 3's completed collectives (sddoctor.telemetry.timeline)
  stacks/                  stack dumps taken by the supervisor
  report.json, report.md   the diagnosis
  report.html              the same with each rank's timeline and plots, one self-contained page
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sddoctor.telemetry.schema import SCHEMA_VERSION

#: Environment variable through which `sddoctor run` hands its run directory to every rank.
RUN_DIR_ENV = "SDDOCTOR_RUN_DIR"
#: Where run directories are made by default, under the current directory: `sddoctor run`'s
#: first, the bundled trainer's second. `sddoctor report` and `sddoctor tui` look in both.
RUN_BASES = ("sddoctor-runs", "runs")

_RANK_FILE = re.compile(r"rank-(\d+)\.(jsonl|state)$")


@dataclass(frozen=True)
class RunDir:
    """Paths inside one run directory. Creating the object touches nothing on disk."""

    path: Path

    def __init__(self, path: str | os.PathLike[str]) -> None:
        object.__setattr__(self, "path", Path(path))

    @property
    def run_json(self) -> Path:
        return self.path / "run.json"

    @property
    def ranks_dir(self) -> Path:
        return self.path / "ranks"

    @property
    def stacks_dir(self) -> Path:
        return self.path / "stacks"

    @property
    def report_json(self) -> Path:
        return self.path / "report.json"

    @property
    def report_md(self) -> Path:
        return self.path / "report.md"

    @property
    def report_html(self) -> Path:
        return self.path / "report.html"

    def events_file(self, rank: int) -> Path:
        return self.ranks_dir / f"rank-{rank:05d}.jsonl"

    def state_file(self, rank: int) -> Path:
        return self.ranks_dir / f"rank-{rank:05d}.state"

    @property
    def usage_error_file(self) -> Path:
        """Written by a rank that stopped on a usage error found only once it ran (a fault for a rank
        outside the world an mp.spawn job turned out to have): the run ends with exit code 2."""
        return self.path / "usage-error.txt"

    def fatal_file(self, rank: int) -> Path:
        """Where faulthandler writes the rank's stacks on a fatal signal (SIGSEGV, SIGABRT, ...)."""
        return self.ranks_dir / f"rank-{rank:05d}.fatal"

    def ranks(self) -> list[int]:
        """Global ranks that have written anything, sorted."""
        if not self.ranks_dir.is_dir():
            return []
        found = set()
        try:
            names = [entry.name for entry in self.ranks_dir.iterdir()]
        except OSError:
            return []  # unreadable: the commands say so before they get here
        for name in names:
            m = _RANK_FILE.match(name)
            if m:
                found.add(int(m.group(1)))
        return sorted(found)

    def ensure(self) -> RunDir:
        self.ranks_dir.mkdir(parents=True, exist_ok=True)
        self.stacks_dir.mkdir(parents=True, exist_ok=True)
        return self

    def write_run_info(self, **fields: Any) -> dict[str, Any]:
        """Write run.json (atomically), merged over what is there already."""
        from sddoctor import __version__

        info: dict[str, Any] = {}
        if self.run_json.exists():
            try:
                info = json.loads(self.run_json.read_text())
            except (OSError, ValueError):
                info = {}
        info.setdefault("v", SCHEMA_VERSION)
        info.setdefault("created", time.time())
        info.setdefault("host", socket.gethostname())
        info.setdefault("sddoctor_version", __version__)
        info.update(fields)
        atomic_write_text(self.run_json, json.dumps(info, indent=2, default=str))
        return info

    def run_info(self) -> dict[str, Any]:
        """run.json as written, for merging into it (readers use `runinfo.read_run_info`)."""
        try:
            doc = json.loads(self.run_json.read_text())
        except (OSError, ValueError):
            return {}
        return doc if isinstance(doc, dict) else {}


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader sees the old or the new content, never a mix."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def append_bounded(path: Path, text: str, max_bytes: int) -> None:
    """Append `text` to `path`; past `max_bytes` the file first becomes `<stem>.1<suffix>` (replacing
    an older one), so the pair holds at most about 2 x max_bytes, the most recent lines."""
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    if size and size + len(text) > max_bytes:
        os.replace(path, rotated_path(path))
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(text)


def rotated_path(path: Path) -> Path:
    """Where `append_bounded` moves a full file: timeline/rank-00001.jsonl -> timeline/rank-00001.1.jsonl."""
    return path.with_name(f"{path.stem}.1{path.suffix}")


def new_run_dir(base: str | os.PathLike[str], prefix: str = "run") -> RunDir:
    """Create a fresh, uniquely named run directory under `base` (e.g. ./sddoctor-runs/)."""
    base = Path(base)
    base.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        name = f"{prefix}-{stamp}" if i == 0 else f"{prefix}-{stamp}-{i}"
        candidate = base / name
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return RunDir(candidate).ensure()
    raise RuntimeError(f"could not create a new run directory under {base}")


def find_latest_run(*bases: str | os.PathLike[str]) -> RunDir | None:
    """The most recently modified run directory (one holding run.json or ranks/) under any base."""
    best: tuple[float, Path] | None = None
    for base in bases:
        base = Path(base)
        if not base.is_dir():
            continue
        for candidate in base.iterdir():
            marker = candidate / "ranks"
            if not (marker.is_dir() or (candidate / "run.json").exists()):
                continue
            try:
                mtime = max(
                    p.stat().st_mtime for p in [candidate, *(marker.iterdir() if marker.is_dir() else [])]
                )
            except OSError:
                continue
            if best is None or mtime > best[0]:
                best = (mtime, candidate)
    return RunDir(best[1]) if best else None
