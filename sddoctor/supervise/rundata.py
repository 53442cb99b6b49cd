"""Everything the report views need from a run directory, read once.

report.md's health section, report.html and `sddoctor trace` all look at the same events,
collective timeline and GPU samples; `RunData.load` reads them a single time per report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sddoctor.supervise.gpulog import read_gpu_log
from sddoctor.supervise.timeline import Timeline, load_timeline
from sddoctor.telemetry import RunDir, RunView

#: step events read per rank (the most recent): about 100,000 steps of the trainer's events, so a
#: week-long run's report reads tens of MB per rank, not gigabytes (other events are all read)
STEP_BYTES = 32 << 20


@dataclass
class RunData:
    run_dir: RunDir
    report: dict[str, Any]
    view: RunView
    timeline: Timeline
    gpu_samples: list[dict[str, Any]]

    @classmethod
    def load(cls, run_dir: RunDir, report: dict[str, Any] | None = None) -> RunData:
        view = RunView.load(run_dir, step_bytes=STEP_BYTES)
        report = report if report is not None else (view.report() or {})
        return cls(
            run_dir=run_dir,
            report=report,
            view=view,
            timeline=load_timeline(run_dir, report, view),
            gpu_samples=read_gpu_log(run_dir),
        )
