"""run.json, typed: what was run, when, and the options it was judged by, with their defaults.

The defaults of `sddoctor run` live here, once: the command line offers them, the supervisor
and the offline diagnosis judge by them, and every reader of run.json (the TUI, `sddoctor
report`) assumes them when a run directory does not say (a run the bundled trainer wrote
without `sddoctor run`, or an older one).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from sddoctor.telemetry.layout import RunDir
from sddoctor.telemetry.reader import read_json
from sddoctor.telemetry.validate import clean_run_info

#: No progress (no step, no collective issued or completed) for this long is a hang.
HANG_TIMEOUT = 300.0
#: Seconds a rank may spend starting (imports, model loading, rendezvous) before it counts as stuck.
STARTUP_TIMEOUT = 900.0
#: A rank computing this many times longer between collectives than the others is a straggler.
STRAGGLER_RATIO = 2.0
#: What `sddoctor run` does on a hang: "dump" (stacks and report, keep waiting), "kill", "wait".
ON_HANG = "dump"


@dataclass(frozen=True)
class RunOptions:
    """The options a run is judged by (run.json's `options`)."""

    hang_timeout: float = HANG_TIMEOUT
    startup_timeout: float = STARTUP_TIMEOUT
    straggler_ratio: float = STRAGGLER_RATIO
    on_hang: str = ON_HANG

    @classmethod
    def of(cls, options: Any) -> RunOptions:
        """From a checked run.json `options` object (see `validate.clean_run_info`); a missing
        option takes its default."""
        options = options if isinstance(options, dict) else {}

        def number(key: str, default: float) -> float:
            value = options.get(key)
            return float(value) if isinstance(value, (int, float)) and value > 0 else default

        on_hang = options.get("on_hang")
        return cls(
            hang_timeout=number("hang_timeout", HANG_TIMEOUT),
            startup_timeout=number("startup_timeout", STARTUP_TIMEOUT),
            straggler_ratio=number("straggler_ratio", STRAGGLER_RATIO),
            on_hang=on_hang if isinstance(on_hang, str) else ON_HANG,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "hang_timeout": self.hang_timeout,
            "startup_timeout": self.startup_timeout,
            "on_hang": self.on_hang,
            "straggler_ratio": self.straggler_ratio,
        }


@dataclass(frozen=True)
class RunInfo:
    """run.json with its fields checked; `record` keeps the whole (checked) document."""

    record: dict[str, Any] = field(default_factory=dict, repr=False)
    command: tuple[str, ...] = ()
    started: float | None = None
    created: float | None = None
    host: str | None = None
    world_size: int | None = None
    endpoint: str | None = None
    options: RunOptions = RunOptions()

    @classmethod
    def of(cls, document: Any, source: str = "run.json") -> RunInfo:
        """From a run.json document (or the `run` of /api/state), checked field by field."""
        record = clean_run_info(document, source) if document is not None else {}
        started, created = record.get("started"), record.get("created")
        return cls(
            record=record,
            command=tuple(record.get("command") or ()),
            started=float(started) if started is not None else None,
            created=float(created) if created is not None else None,
            host=record.get("host"),
            world_size=record.get("world_size"),
            endpoint=record.get("endpoint"),
            options=RunOptions.of(record.get("options")),
        )

    @property
    def start(self) -> float | None:
        """When the run started (run.json's `started`, else when the folder was made)."""
        return self.started if self.started is not None else self.created


def read_run_info(run_dir: RunDir | str | os.PathLike[str]) -> RunInfo:
    """run.json of a run directory, typed; an empty RunInfo (all defaults) when it is missing or garbled."""
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    return RunInfo.of(read_json(rd.run_json))
