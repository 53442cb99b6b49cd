"""Ranks started by `torch.multiprocessing.spawn` / `start_processes` or `multiprocessing.Process`.

No launcher sets RANK for these: each worker becomes a rank when it calls init_process_group (see
`api.arm_on_init`). What this module adds, for every Python process of a job run by `sddoctor run`:

- `start_processes` (which `mp.spawn` calls) hands each worker its function wrapped in
  `SpawnedWorker`, a picklable object: in the worker it notes the spawn index and pid under
  `RUN_DIR/procs/` (so a worker stuck before init_process_group is named in a startup hang) and
  records the exception that torch's `_wrap` would otherwise swallow into its error queue.
  The parent notes how many workers it started (a hint of the world size before any rank joins).
- `ProcessContext.join` (the parent's wait for its workers) notes the exit status of every worker
  it saw end under `RUN_DIR/procs/exit-PID.json`: sddoctor is not the workers' parent, so without
  it a worker killed hard (SIGKILL, the OOM killer, an injected kill) leaves no record of how it
  ended. torchrun prints such statuses in its failure summary; mp.spawn prints only the first.
- `multiprocessing.process.BaseProcess.run` records the exception of a Process target the same
  way (multiprocessing catches it and prints it; `sys.excepthook` never sees it).

Exceptions are recorded only in a process that is itself a rank, and then re-raised unchanged.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from sddoctor.instrument.safety import internal_error
from sddoctor.telemetry.layout import RUN_DIR_ENV

PROCS_DIR = "procs"


def install() -> None:
    """Arrange the patches for when the modules are imported (cheap: import hooks only)."""
    from sddoctor.instrument.importhook import when_imported

    when_imported("torch.multiprocessing.spawn", _patch_start_processes)
    when_imported("torch.multiprocessing.spawn", _patch_context_join)
    when_imported("multiprocessing.process", _patch_process_run)


#: in a worker: the user's line in the parent that started the workers (see SpawnedWorker)
spawned_at: str | None = None


class SpawnedWorker:
    """A worker function of `mp.spawn`, wrapped: picklable (it holds only the function, the
    number of workers and the parent's line that started them).

    `spawned_at` is where a verdict about the worker points when none of the user's code is on its
    stack: a library that spawns its own workers (Lightning's ddp_spawn runs the whole training
    loop from its worker function) leaves the user's call (`trainer.fit(...)`) in the parent only."""

    def __init__(self, fn: Any, nprocs: int | None, spawned_at: str | None = None) -> None:
        self.fn = fn
        self.nprocs = nprocs
        self.spawned_at = spawned_at

    def __call__(self, index: int, *args: Any) -> Any:
        global spawned_at
        spawned_at = self.spawned_at
        note = {
            "pid": os.getpid(),
            "spawn_index": index,
            "nprocs": self.nprocs,
            "spawned_at": self.spawned_at,
        }
        _note(f"pid-{os.getpid()}", note)
        try:
            return self.fn(index, *args)
        except Exception as exc:
            if not record_exception(exc):
                _note_unjoined_exception(exc, index)
            raise


def _note_unjoined_exception(exc: BaseException, index: int) -> None:
    """A worker that is no rank yet (it failed before init_process_group) notes its exception
    under RUN_DIR/procs/exc-PID.json: no rank file holds it, and the ranks that did join die of
    the parent's SIGTERM, so without it a victim would be blamed. Never raises."""
    try:
        from sddoctor.instrument.exit_hooks import exception_fields

        _note(
            f"exc-{os.getpid()}",
            {"pid": os.getpid(), "spawn_index": index, **exception_fields(exc, exc.__traceback__)},
        )
    except Exception as error:  # noqa: BLE001
        internal_error("exception note of a spawned worker", error)


def record_exception(exc: BaseException) -> bool:
    """Record `exc` as this rank's uncaught exception, if this process is a rank (True then).
    Never raises."""
    try:
        from sddoctor.instrument import api

        session = api.active()
        if session is not None and session.pid == os.getpid():
            session.record_exception(exc, exc.__traceback__)
            return True
    except Exception as error:  # noqa: BLE001
        internal_error("exception record of a spawned worker", error)
    return False


def _patch_start_processes(module: Any) -> None:
    original = getattr(module, "start_processes", None)
    if original is None or getattr(original, "__sddoctor_original__", None) is not None:
        return
    try:
        signature = inspect.signature(original)
    except (TypeError, ValueError):
        return

    @functools.wraps(original)
    def start_processes(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            nprocs = bound.arguments.get("nprocs")
            nprocs = nprocs if isinstance(nprocs, int) else None
            bound.arguments["fn"] = SpawnedWorker(bound.arguments["fn"], nprocs, _user_line())
            _note(f"launcher-{os.getpid()}", {"pid": os.getpid(), "nprocs": nprocs})
            args, kwargs = bound.args, bound.kwargs
        except Exception as exc:  # noqa: BLE001 - the user's call goes through unchanged then
            internal_error("mp.spawn", exc)
        return original(*args, **kwargs)

    start_processes.__sddoctor_original__ = original  # type: ignore[attr-defined]
    module.start_processes = start_processes


def _user_line() -> str | None:
    """'file:line' of the innermost frame of the user's own code calling into here, else None."""
    from sddoctor.instrument.tracing import user_caller

    return user_caller(library_fallback=False)


def _patch_context_join(module: Any) -> None:
    cls: Any = getattr(module, "ProcessContext", None)
    join = getattr(cls, "join", None)
    if join is None or getattr(join, "__sddoctor_original__", None) is not None:
        return

    @functools.wraps(join)
    def patched_join(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            done = join(self, *args, **kwargs)
        except BaseException as exc:
            _note_worker_exits(self, getattr(exc, "error_index", None))
            raise
        _note_worker_exits(self, None)
        return done

    patched_join.__sddoctor_original__ = join  # type: ignore[attr-defined]
    cls.join = patched_join


def _note_worker_exits(context: Any, first: Any) -> None:
    """Note the exit status of each worker of `context` that has ended, once. Never raises.

    `first` is the spawn index torch blames (the first failure it saw): the others it then stopped."""
    try:
        noted: set[int] = context.__dict__.setdefault("_sddoctor_noted", set())
        for index, process in enumerate(context.processes):
            code, pid = process.exitcode, process.pid
            if code is None or pid in noted:
                continue
            noted.add(pid)
            _note(
                f"exit-{pid}", {"pid": pid, "spawn_index": index, "exitcode": code, "first": index == first}
            )
    except Exception as error:  # noqa: BLE001
        internal_error("mp.spawn exit note", error)


def _patch_process_run(module: Any) -> None:
    cls: Any = getattr(module, "BaseProcess", None)
    run = getattr(cls, "run", None)
    if run is None or getattr(run, "__sddoctor_original__", None) is not None:
        return

    @functools.wraps(run)
    def patched_run(self: Any) -> Any:
        try:
            return run(self)
        except Exception as exc:
            record_exception(exc)
            raise

    patched_run.__sddoctor_original__ = run  # type: ignore[attr-defined]
    cls.run = patched_run


def _note(name: str, record: dict[str, Any]) -> None:
    """Write RUN_DIR/procs/NAME.json (small, once per process). Never raises."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    try:
        folder = Path(run_dir) / PROCS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{name}.tmp"
        tmp.write_text(json.dumps({**record, "t": time.time(), "argv": list(sys.argv)[:8]}))
        os.replace(tmp, folder / f"{name}.json")
    except Exception as exc:  # noqa: BLE001
        internal_error("process note", exc)
