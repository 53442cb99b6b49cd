"""One run, one run directory: `sddoctor run` refuses a run directory that holds another run's
telemetry, unless asked to set that telemetry aside (`--replace`).

Two supervisors never share one at the same time: the first holds the directory's lease
(`lifecycle.SupervisorLease`, an flock), and a second stops with exit 2. A finished or dead run's
files are the other case: reusing the folder would mix the old run's telemetry into the new
verdict. Replacing moves them (run.json, ranks/, timeline/, stacks/, procs/, the reports, the
logs, the lease) to RUN_DIR/replaced/<time>/: nothing is deleted, and the job's own files there (a
trainer's checkpoints, samples, export) stay where they are.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

REPLACED_DIR = "replaced"
#: what one run of `sddoctor run` writes into its run directory
TELEMETRY = (
    "run.json", "ranks", "timeline", "stacks", "procs", "report.json", "report.md", "report.html",
    "trace.json", "stderr.log", "preflight.json", "supervisor.json", "supervisor.lease", "endpoint.token",
    "gpus.jsonl", "gpus.1.jsonl",
)  # fmt: skip


def holds_a_run(folder: Path) -> bool:
    """Whether `folder` has another run's telemetry (run.json, or events under ranks/)."""
    if (folder / "run.json").exists():
        return True
    ranks = folder / "ranks"
    return ranks.is_dir() and any(p.suffix == ".jsonl" for p in ranks.iterdir())


def earlier_run(folder: Path, *, replace: bool) -> bytes | None:
    """None when `folder` holds no earlier run. When it does: with `replace`, the earlier
    supervisor's lease as it was (`set_aside` keeps it with the rest); without, ValueError saying
    what to do (another supervisor still using the folder, or --replace)."""
    if not holds_a_run(folder):
        return None
    from sddoctor.supervise.lifecycle import LEASE_FILE, lease_status

    if (lease_status(folder) or {}).get("state") == "running":
        raise ValueError(f"another sddoctor run is using {folder}; choose another --run-dir")
    if not replace:
        raise ValueError(
            f"{folder} holds the telemetry of an earlier run; give this run a new --run-dir, or add "
            f"--replace to move the earlier run's files to {folder / REPLACED_DIR}/ (other files stay)"
        )
    try:
        return (folder / LEASE_FILE).read_bytes()
    except OSError:
        return b""


def set_aside(folder: Path, earlier_lease: bytes = b"") -> Path:
    """Move the earlier run's telemetry to RUN_DIR/replaced/<time>/ (its lease as it was before this
    run took the folder over) and return that folder."""
    from sddoctor.supervise.lifecycle import LEASE_FILE

    target = folder / REPLACED_DIR / time.strftime("%Y%m%d-%H%M%S")
    suffix = 0
    while target.exists():
        suffix += 1
        target = target.with_name(f"{target.name.split('.')[0]}.{suffix}")
    target.mkdir(parents=True)
    for name in TELEMETRY:
        source = folder / name
        if name != LEASE_FILE and (source.exists() or source.is_symlink()):
            os.replace(source, target / name)
    if earlier_lease:
        (target / LEASE_FILE).write_bytes(earlier_lease)
    return target
