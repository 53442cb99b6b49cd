"""The rank-side API that the trainer and user scripts call.

    from sddoctor.instrument import api as sdi
    sdi.enable()                      # no-op unless a run dir is given or SDDOCTOR_RUN_DIR is set
    for step, batch in enumerate(loader):
        ...
        sdi.step(step, loss=loss.item(), samples=len(batch))

Every function is a cheap no-op when no session is active, so instrumented code runs
unchanged outside `sddoctor run`. A session owns this rank's TelemetryWriter and fires the
step-triggered faults of SDDOCTOR_FAULT (kill, raise, sleep); collective-triggered faults and
the OOM fault belong to the collective tracer and the OOM guard.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from sddoctor.instrument.faults import Fault, faults_from_env
from sddoctor.telemetry.layout import RUN_DIR_ENV, RunDir
from sddoctor.telemetry.schema import EventKind
from sddoctor.telemetry.writer import TelemetryWriter


class InjectedFault(RuntimeError):
    """Raised by a `raise:` fault of SDDOCTOR_FAULT."""


class RankSession:
    """Telemetry and step-level fault injection of one rank process."""

    def __init__(
        self, run_dir: RunDir, rank: int, local_rank: int, world_size: int, faults: list[Fault]
    ) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.faults = [f for f in faults if f.applies_to(rank)]
        self.writer = TelemetryWriter(run_dir, rank)
        self.current_step: int | None = None
        self._fired: set[str] = set()
        self.writer.update_state(local_rank=local_rank, world_size=world_size, status="running")

    def step(self, step: int, **fields: Any) -> None:
        """Record a finished step (fields: loss, samples, step_time, micro_batch, ...) and fire step faults."""
        self.writer.emit(EventKind.STEP, step=step, **fields)
        self.writer.update_state(step=step, last_step=dict(fields, step=step, t=time.time()))
        self.begin_step(step + 1)

    def begin_step(self, step: int) -> None:
        """Mark the start of `step`; fires faults bound to it. `step()` calls this for the next step."""
        self.current_step = step
        for fault in self.faults:
            self._maybe_fire(fault, step)

    def phase(self, name: str) -> None:
        self.writer.update_state(phase=name, phase_since=time.time())

    def _maybe_fire(self, fault: Fault, step: int) -> None:
        at = fault.get("step")
        if fault.kind == "sleep" and fault.get("seq") is None:
            every = fault.get("every")
            if at is None or step == at or (every and step >= at and (step - at) % every == 0):
                time.sleep(float(fault.get("seconds")))  # type: ignore[arg-type]
            return
        if fault.kind not in ("kill", "raise") or at != step or fault.spec in self._fired:
            return
        self._fired.add(fault.spec)
        caller = _caller()
        self.writer.emit(EventKind.FAULT, fault=fault.spec, step=step, caller=caller)
        self.writer.flush()
        if fault.kind == "kill":
            os.kill(os.getpid(), int(fault.get("signal", signal.SIGKILL)))  # type: ignore[arg-type]
            time.sleep(5)  # a catchable signal may return; give it time to act
        raise InjectedFault(str(fault.get("message") or f"injected fault {fault.spec!r} at step {step}"))

    def close(self, status: str = "ok", code: int = 0) -> None:
        self.writer.emit(EventKind.EXIT, status=status, code=code, step=self.current_step)
        self.writer.update_state(status="exited")
        self.writer.close()


_session: RankSession | None = None


def enable(
    run_dir: str | os.PathLike[str] | None = None,
    *,
    rank: int | None = None,
    local_rank: int | None = None,
    world_size: int | None = None,
    **start_fields: Any,
) -> RankSession | None:
    """Start this rank's session (idempotent). Without `run_dir`, uses SDDOCTOR_RUN_DIR or does nothing."""
    global _session
    if _session is not None:
        return _session
    target = run_dir or os.environ.get(RUN_DIR_ENV)
    if not target:
        return None
    rank = _env_int("RANK", 0) if rank is None else rank
    local_rank = _env_int("LOCAL_RANK", rank) if local_rank is None else local_rank
    world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
    _session = RankSession(RunDir(Path(target)), rank, local_rank, world_size, faults_from_env())
    _session.writer.emit(
        EventKind.START,
        pid=os.getpid(),
        host=socket.gethostname(),
        local_rank=local_rank,
        world_size=world_size,
        argv=list(sys.argv),
        **start_fields,
    )
    return _session


def active() -> RankSession | None:
    return _session


def step(step: int, **fields: Any) -> None:
    if _session is not None:
        _session.step(step, **fields)


def begin_step(step: int) -> None:
    if _session is not None:
        _session.begin_step(step)


def phase(name: str) -> None:
    if _session is not None:
        _session.phase(name)


def event(kind: EventKind | str, **fields: Any) -> None:
    if _session is not None:
        _session.writer.emit(kind, **fields)


def update_state(**fields: Any) -> None:
    if _session is not None:
        _session.writer.update_state(**fields)


def disable(status: str = "ok", code: int = 0) -> None:
    """Close the session: an `exit` event and a final flush."""
    global _session
    if _session is not None:
        _session.close(status, code)
        _session = None


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return default


def _caller() -> str:
    """file:line of the first frame outside sddoctor (where the user's code is)."""
    frame = sys._getframe(1)
    here = str(Path(__file__).resolve().parent.parent)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(here):
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"
