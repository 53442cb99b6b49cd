"""One run, one run directory: `sddoctor run` locks its run directory and refuses one that holds
another run's telemetry, unless asked to set that telemetry aside (`--replace`).

The lock is an advisory `flock` on RUN_DIR/.lock, held for the supervisor's life (the kernel drops
it when the process dies, however it dies), with the holder's pid written in the file for the
message a second supervisor prints. Replacing moves the old run's files (run.json, ranks/, stacks/,
procs/, the reports, job.log, preflight.json) to RUN_DIR/replaced/<time>/: nothing is deleted, and
the job's own files there (a trainer's checkpoints, samples, export) stay where they are.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import IO

LOCK_FILE = ".lock"
REPLACED_DIR = "replaced"
#: what one run of `sddoctor run` writes into its run directory
TELEMETRY = ("run.json", "ranks", "stacks", "procs", "report.json", "report.md", "report.html", "job.log",
             "preflight.json", "supervisor.json")  # fmt: skip


class RunDirBusy(RuntimeError):
    """The run directory cannot be used; the message says why and what to do."""


def holds_a_run(folder: Path) -> bool:
    """Whether `folder` has another run's telemetry (run.json, or events under ranks/)."""
    if (folder / "run.json").exists():
        return True
    ranks = folder / "ranks"
    return ranks.is_dir() and any(p.suffix == ".jsonl" for p in ranks.iterdir())


def lock_run_dir(folder: Path, *, replace: bool) -> IO[str]:
    """Lock `folder` for this process; set a previous run's telemetry aside when `replace`.

    Returns the open lock file: keep it open as long as the run lasts. Raises RunDirBusy when
    another supervisor holds the lock, or the folder holds another run and `replace` is False.
    """
    folder.mkdir(parents=True, exist_ok=True)
    handle = open(folder / LOCK_FILE, "a+")  # noqa: SIM115 - held for the life of the run
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise RunDirBusy(
            f"{folder} is in use by another `sddoctor run` (pid {holder}); give this run its own --run-dir"
        ) from None
    if holds_a_run(folder):
        if not replace:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
            handle.close()
            raise RunDirBusy(
                f"{folder} holds the telemetry of an earlier run; give this run a new --run-dir, or add "
                f"--replace to move the earlier run's files to {folder / REPLACED_DIR}/ (other files stay)"
            )
        set_aside(folder)
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def set_aside(folder: Path) -> Path:
    """Move the previous run's telemetry to RUN_DIR/replaced/<time>/ and return that folder."""
    target = folder / REPLACED_DIR / time.strftime("%Y%m%d-%H%M%S")
    suffix = 0
    while target.exists():
        suffix += 1
        target = target.with_name(f"{target.name.split('.')[0]}.{suffix}")
    target.mkdir(parents=True)
    for name in TELEMETRY:
        source = folder / name
        if source.exists() or source.is_symlink():
            os.replace(source, target / name)
    return target
