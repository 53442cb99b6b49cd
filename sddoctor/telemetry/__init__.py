"""The contract every part of sddoctor shares: run-directory layout, event schema, writer, reader.

Nothing in this package imports torch: the supervisor, `sddoctor report` and the TUI read
run directories without it. See docs/telemetry.md for the schema.
"""

from sddoctor.telemetry.layout import RunDir, find_latest_run, new_run_dir
from sddoctor.telemetry.reader import (
    EventTail,
    RankView,
    RunView,
    read_events,
    read_json,
    read_snapshot,
    read_state,
)
from sddoctor.telemetry.schema import SCHEMA_VERSION, EventKind
from sddoctor.telemetry.snapshot import Collective, RankSnapshot, StepRecord
from sddoctor.telemetry.writer import TelemetryWriter

__all__ = [
    "SCHEMA_VERSION",
    "Collective",
    "EventKind",
    "EventTail",
    "RankSnapshot",
    "RankView",
    "RunDir",
    "RunView",
    "StepRecord",
    "TelemetryWriter",
    "find_latest_run",
    "new_run_dir",
    "read_events",
    "read_json",
    "read_snapshot",
    "read_state",
]
