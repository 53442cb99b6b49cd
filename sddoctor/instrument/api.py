"""The rank-side API that the trainer and user scripts call.

    from sddoctor.instrument import api as sdi
    sdi.enable()                      # no-op unless a run dir is given or SDDOCTOR_RUN_DIR is set
    for step, batch in enumerate(loader):
        ...
        sdi.step(step, loss=loss.item(), samples=len(batch))

Every function is a cheap no-op when no session is active, so instrumented code runs
unchanged outside `sddoctor run`. A session owns this rank's TelemetryWriter and fires the
step-triggered faults of SDDOCTOR_FAULT (kill, raise, sleep); collective-triggered faults
(`seq=`, skip, shape) are fired by the collective tracer through `RankSession.fire_fault`, and the
OOM fault belongs to the OOM guard.

With `trace=True` (the default) the session also traces torch.distributed collectives, runs the
heartbeat thread, and records the uncaught exception and SIGTERM (see `tracing`, `heartbeat`,
`exit_hooks`). If torch is not imported yet, tracing is installed when torch.distributed is.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from sddoctor.codepaths import current_roots
from sddoctor.instrument import backend_callbacks
from sddoctor.instrument.faults import Fault, FaultSpecError, exit_if_outside_world, faults_from_env
from sddoctor.instrument.safety import flush_pending, guarded, internal_error
from sddoctor.telemetry.environment import comm_env
from sddoctor.telemetry.layout import RUN_DIR_ENV, RunDir
from sddoctor.telemetry.redact import redact_argv
from sddoctor.telemetry.schema import EventKind
from sddoctor.telemetry.writer import EXIT_FLUSH_TIMEOUT, TelemetryWriter


class InjectedFault(RuntimeError):
    """Raised by a `raise:` fault of SDDOCTOR_FAULT."""

    sddoctor_injected = True  # raised on purpose: sddoctor's own guards let it through


class RankSession:
    """Telemetry and step-level fault injection of one rank process."""

    def __init__(
        self,
        run_dir: RunDir,
        rank: int,
        local_rank: int,
        world_size: int,
        faults: list[Fault],
        *,
        rank_known: bool = True,
    ) -> None:
        self.run_dir = run_dir
        self.pid = os.getpid()  # a forked child inherits this object; it is not this rank
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.all_faults = list(faults)
        self.faults = [f for f in faults if f.applies_to(rank)]
        # Until the rank is known (no RANK in the environment, init_process_group not called yet)
        # nothing is written: another process may be buffering under the same provisional rank.
        # init_process_group, the first step, or the end settles it (see _settle_rank).
        self.rank_known = rank_known
        self.writer = TelemetryWriter(run_dir, rank, start_thread=rank_known)
        if not rank_known:
            atexit.unregister(self.writer.close)  # it must not flush under the provisional rank
        self.current_step: int | None = None
        self.tracer: Any = None
        self.heartbeat: Any = None
        #: steps inferred from the DDP model (see `steps`); None until tracing is installed
        self.inference: Any = None
        self.infer_steps = True
        self._fired: set[str] = set()
        self._exit: tuple[str, int | None] | None = None
        self._exit_written = False
        # SIGTERM reaches both the watcher thread and the main thread's handler: the one that did not
        # write the exit event waits until it is on disk, so that neither ends the process before
        self._exit_claim = threading.RLock()
        self._exit_writer: int | None = None
        self._exit_done = threading.Event()
        self._exit_call: str | None = None  # where sys.exit(status != 0) was called
        #: the last error the program caught and reported (a printed traceback, logger.exception,
        #: sys.exit(0) inside `except`): a clean exit's `handled_error`
        self._handled_error: dict[str, Any] | None = None
        self._signal_position: dict[str, Any] = {}  # where the main thread was when SIGTERM came
        self._uncaught_recorded = False
        self._fatal_dump = False
        self._closed = False
        self.writer.update_state(local_rank=local_rank, world_size=world_size, status="running")

    def _settle_rank(self) -> None:
        """Training has begun and the rank is still unknown: take the process group's, else 0.

        No RANK in the environment means mp.spawn-style (the group tells the rank once it
        exists) or a single process (rank 0); by the first step the group exists if there is one.
        """
        rank, known = _initialized_rank()
        if known:
            import torch.distributed as dist

            self.set_rank(rank, dist.get_world_size())
        else:
            self.set_rank(0)

    def step(self, step: int, **fields: Any) -> None:
        """Record a finished step (fields: loss, samples, step_time, micro_batch, ...) and fire step faults.

        An explicit step turns step inference off: the program counts its own steps.
        """
        self.infer_steps = False
        if self.inference is not None:
            self.inference.stop()
        self.record_step(step, **fields)
        self.begin_step(step + 1)

    def record_step(self, step: int, **fields: Any) -> None:
        """Write a finished step without starting the next one (inferred steps start at the next forward)."""
        if not self.rank_known:
            self._settle_rank()
        self.writer.emit(EventKind.STEP, step=step, **fields)
        self.writer.update_state(step=step, last_step=dict(fields, step=step, t=time.time()))

    def waiting(self, what: str | None, caller: str | None = None, **fields: Any) -> None:
        """Mark that this rank waits for its peers outside any traced collective (rendezvous, DDP's
        construction), or that it no longer does (`what=None`). `fields` say more (the world size
        an init_process_group waits for)."""
        marker = {"what": what, "since": time.time(), "caller": caller, **fields} if what else None
        self.writer.update_state(waiting=marker)

    def waiting_in_init(self, world_size: int | None) -> None:
        """init_process_group was entered: waiting for `world_size` ranks (the call's own, else the
        launcher's WORLD_SIZE), which the supervisor compares with the processes the job has."""
        from sddoctor.instrument import tracing

        world = world_size if isinstance(world_size, int) and world_size > 0 else self.world_size
        extra = {"world_size": world} if isinstance(world, int) and world > 0 else {}
        self.waiting("init_process_group", tracing.user_caller(), **extra)

    def begin_step(self, step: int) -> None:
        """Mark the start of `step`; fires faults bound to it. `step()` calls this for the next step."""
        if not self.rank_known:
            self._settle_rank()
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
                if fault.spec not in self._fired:  # one `fault` event, the first time it fires
                    self._fired.add(fault.spec)
                    self.writer.emit(EventKind.FAULT, fault=fault.spec, step=step, caller=_caller())
                time.sleep(float(fault.get("seconds")))
            return
        if fault.kind not in ("kill", "raise") or at != step or fault.get("seq") is not None:
            return
        if fault.spec in self._fired:
            return
        self.fire_fault(fault, step=step, caller=_caller())

    def fire_fault(self, fault: Fault, /, **where: Any) -> None:
        """Fire a kill/raise fault now: a `fault` event (flushed), then the signal or the exception."""
        self._fired.add(fault.spec)
        number = int(fault.get("signal", signal.SIGKILL))
        # the signal, so that a death by it reads as injected, whoever reports the exit status
        extra = {"signal": number} if fault.kind == "kill" else {}
        self.writer.emit(EventKind.FAULT, **{**where, **extra, "fault": fault.spec})
        self.writer.flush()
        if fault.kind == "kill":
            os.kill(os.getpid(), number)
            time.sleep(5)  # a catchable signal may return; give it time to act
        at = f"step {where['step']}" if "step" in where else f"collective #{where.get('seq')}"
        raise InjectedFault(str(fault.get("message") or f"injected fault {fault.spec!r} at {at}"))

    def record_exception(self, exc: BaseException, tb: Any, *, handled: bool = False) -> None:
        """An `exception` event for an uncaught exception (or, `handled`, one the program caught
        before it exited with a failure status), flushed at once (the process is dying)."""
        from sddoctor.instrument.exit_hooks import exception_fields

        fields = exception_fields(exc, tb)
        failed = getattr(self.tracer, "last_failed", None)
        if failed is not None and time.time() - failed.t1 < 5.0:
            fields["collective"] = failed.as_dict()  # the exception came out of this collective
        if handled:
            fields["handled"] = True
        else:
            self._uncaught_recorded = True
        self.writer.emit(EventKind.EXCEPTION, step=self.current_step, **fields)
        self.mark_exit("error", 1)
        self.writer.flush()

    def note_thread_exception(self, message: str, **fields: Any) -> None:
        """A thread of this rank died of an uncaught exception (exit_hooks): a `thread_exception`
        warning, flushed at once (the thread's collectives stop with it, and a hang may follow)."""
        self.writer.emit(
            EventKind.WARNING, code="thread_exception", message=message, step=self.current_step, **fields
        )
        self.writer.flush()

    def note_exit_call(
        self, caller: str | None, status: object, handling: BaseException | None = None
    ) -> None:
        """sys.exit(status) or os._exit(status) with a failure status was called at `caller`
        (exit_hooks), while `handling` that exception (`except ...: sys.exit(1)`, the usual end of a
        script that prints its own traceback): that exception is what failed, and is recorded.
        The first call is kept: multiprocessing's spawn_main calls sys.exit again with the status.

        Called from a sys.excepthook of the program's own that ends the process (`os._exit(1)`, not to
        hang in the teardown), no exception is being handled and the process will not reach the exit
        where a missed uncaught exception is looked for: it is looked for now."""
        if handling is None and not self._uncaught_recorded:
            self._record_missed_uncaught()
        if self._exit_call is None and handling is not None and not isinstance(handling, SystemExit):
            self.mark_exit("error", status if isinstance(status, int) else 1)
            self.record_exception(handling, handling.__traceback__, handled=True)
        self._exit_call = self._exit_call or caller
        self.mark_exit("error", status if isinstance(status, int) else 1)

    def note_clean_exit_call(self, caller: str | None, handling: BaseException | None = None) -> None:
        """sys.exit(0) or os._exit(0) was called at `caller`: kept as the exit event's `caller`, so
        a rank that leaves its loop early that way is named at that line. Called inside `except`,
        the exception it handles is what made it leave (`handled_error`)."""
        self._exit_call = self._exit_call or caller
        if handling is not None and not isinstance(handling, SystemExit):
            self.note_handled_error(handling)

    def note_handled_error(self, exc: BaseException) -> None:
        """The program caught `exc` and reported it (exit_hooks): kept, the last one, for the `exit`
        event of a rank that then ends with code 0, which would otherwise say nothing of it. Only
        its type, message and lines are kept: the traceback holds frames (and their tensors)."""
        from sddoctor.instrument.exit_hooks import handled_error_fields

        self._handled_error = handled_error_fields(exc)
        self.writer.update_state(handled_error=self._handled_error)  # a hang's verdict may need it

    def _record_missed_uncaught(self) -> None:
        """The script replaced sys.excepthook without calling ours (a logging hook that calls
        sys.__excepthook__): its uncaught exception, which Python keeps in sys.last_value, is
        recorded at exit instead."""
        try:
            from sddoctor.instrument.exit_hooks import uncaught_exception

            exc = uncaught_exception()
            if exc is not None:
                self.record_exception(exc, exc.__traceback__)
        except Exception as exc:  # noqa: BLE001 - the rank is exiting; its exit event must still be written
            internal_error("uncaught exception at exit", exc)

    def note_signal_position(self, position: dict[str, Any]) -> None:
        """Where the main thread was when SIGTERM came (exit_hooks); the first signal is kept. The
        `exit` event carries it when the process dies of that signal."""
        self._signal_position = self._signal_position or position

    def _exit_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"caller": self._exit_call} if self._exit_call else {}
        if self._handled_error is not None and (self._exit is None or self._exit[0] == "ok"):
            fields["handled_error"] = self._handled_error
        if self._exit is not None and self._exit[0] == "signal":
            fields.update(self._signal_position)
        return fields

    def mark_exit(self, status: str, code: int | None) -> None:
        """Remember how the process ends; the `exit` event is written once, at close."""
        if self._exit is None or self._exit[0] == "ok":
            self._exit = (status, code)

    def exit_now(self, status: str, code: int | None) -> None:
        """Write the `exit` event and flush now: the process is about to die without atexit."""
        self.mark_exit(status, code)
        if not self.rank_known:
            self._settle_rank()
        if not self._claim_exit():
            return
        try:
            if self.heartbeat is not None:
                self.heartbeat.flush_now()  # the last second of collectives, before the exit event
            status, code = self._exit  # type: ignore[misc]
            self.writer.emit(
                EventKind.EXIT, status=status, code=code, step=self.current_step, **self._exit_fields()
            )
            self.writer.update_state(status="exited")
            self.writer.flush(timeout=EXIT_FLUSH_TIMEOUT)
        finally:
            self._exit_done.set()

    def _claim_exit(self) -> bool:
        """True for the one caller that writes the exit event. Another thread waits (bounded) until
        that write is done; the writing thread itself, re-entered by a signal handler, does not."""
        me = threading.get_ident()
        # reentrant and bounded: a signal handler may run on this thread inside the lines it guards
        got = self._exit_claim.acquire(timeout=1.0)
        try:
            if not self._exit_written:
                self._exit_written, self._exit_writer = True, me
                return True
        finally:
            if got:
                self._exit_claim.release()
        if self._exit_writer != me:
            self._exit_done.wait(EXIT_FLUSH_TIMEOUT + 1.0)
        return False

    def set_rank(self, rank: int, world_size: int | None = None) -> None:
        """Learn the global rank once the process group knows it (events move to the right file)."""
        if world_size is not None:
            self.world_size = world_size
            self.writer.update_state(world_size=world_size)
        if self.rank_known and rank == self.rank:
            return
        old = self.writer
        new = TelemetryWriter(self.run_dir, rank, start_thread=True)
        atexit.unregister(new.close)  # the session closes it, after its own last events
        new._state.update({k: v for k, v in old._state.items() if k not in ("rank", "pid", "host")})
        while old._events:
            event = dict(old._events.popleft(), rank=rank)
            if event.get("kind") == EventKind.START.value:
                event["world_size"] = self.world_size
            new._events.append(event)
        for provider in old._providers:
            new.add_state_provider(provider)
        old._closed = True  # never flushed: it wrote nothing, and must not write under the wrong rank
        old._stop.set()
        self.writer = new
        self.rank = rank
        self.rank_known = True
        self.faults = [f for f in self.all_faults if f.applies_to(rank)]
        if self._fatal_dump:
            self.enable_fatal_dump()
        if self.heartbeat is not None:
            self.heartbeat.writer = new
        if self.tracer is not None:
            self.tracer.rank = rank
            self.tracer.set_faults(self.all_faults)
        self.announce()

    def announce(self) -> None:
        """Write the start event and the snapshot now, not at the next flush: a rank killed within
        the flush interval would otherwise leave no file naming its pid as this rank."""
        try:
            self.writer.flush()
        except OSError:
            pass

    def enable_fatal_dump(self) -> None:
        """Python stacks of a fatal signal (SIGABRT, SIGSEGV) go to ranks/rank-NNNNN.fatal."""
        from sddoctor.instrument.exit_hooks import enable_fatal_dump

        self._fatal_dump = True
        if not self.rank_known:
            return  # set_rank() comes back here
        try:
            enable_fatal_dump(self.run_dir.fatal_file(self.rank))
        except OSError:
            pass

    def install_tracing(self) -> None:
        """Trace torch.distributed collectives and start the heartbeat (idempotent)."""
        if self.tracer is not None:
            return
        from sddoctor.instrument import tracing
        from sddoctor.instrument.heartbeat import Heartbeat

        self.tracer = tracing.install(self.rank, self.all_faults, self)
        self.heartbeat = Heartbeat(self.writer, self.tracer)
        tracing._before_init.append(self._before_init)
        tracing._after_init.append(self._after_init)
        from sddoctor.instrument import ddp_patch
        from sddoctor.instrument.importhook import when_imported

        when_imported("torch.nn.parallel.distributed", ddp_patch.install)
        ddp_patch.add_post_construct(self._on_ddp_model)
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                self._after_init()
        except Exception:  # noqa: BLE001
            pass
        # Gradient bucket counts and times of every DDP model the bootstrap (ddp_patch) hooked; looked
        # up at each call, since ddp_hook may still be importing here (the user imported it first).
        self.tracer.ddp_stats = _ddp_stats

    def _on_ddp_model(self, ddp_model: Any) -> None:
        """A DistributedDataParallel was constructed: infer steps from it unless the program counts
        its own."""
        inference = self._step_inference()
        if inference is not None:
            inference.attach(ddp_model)

    def _step_inference(self) -> Any:
        """The step inference of this session, made on first use; None when the program counts its own."""
        if not self.infer_steps or _session is not self:
            return None
        if self.inference is None:
            from sddoctor.instrument.steps import StepInference

            self.inference = StepInference(self)
        return self.inference

    def _before_init(self, rank: int | None, world_size: int | None) -> None:
        if _session is self:
            self.waiting_in_init(world_size)

    def _after_init(self) -> None:
        import torch.distributed as dist

        if self.writer._state.get("waiting"):
            self.waiting(None)

        rank, world = dist.get_rank(), dist.get_world_size()
        exit_if_outside_world(self.all_faults, world)
        if not self.rank_known:
            self.set_rank(rank, world)
        elif world != self.world_size:
            self.world_size = world
            self.writer.update_state(world_size=world)
        from sddoctor.instrument.flight_recorder import default_backend

        backend = default_backend()
        if backend is not None:
            self.writer.update_state(backend=backend)
        inference = self._step_inference()
        if inference is not None:
            inference.watch_optimizers()  # steps for a program that trains no DDP model

    def close(self, status: str = "ok", code: int | None = 0) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._uncaught_recorded and self.pid == os.getpid():
            self._record_missed_uncaught()
        if self._exit is not None:
            status, code = self._exit
        if not self.rank_known:
            self._settle_rank()  # a single process that never reported a step
        if self.heartbeat is not None:
            self.heartbeat.close()
        claimed = self._claim_exit()
        if claimed:
            self.writer.emit(
                EventKind.EXIT, status=status, code=code, step=self.current_step, **self._exit_fields()
            )
            self.writer.update_state(status="exited")
        try:
            self.writer.close()
        finally:
            if claimed:
                self._exit_done.set()


_session: RankSession | None = None


def _spawn_fields() -> dict[str, Any]:
    """A spawned worker's `spawned_at`: the user's line in the parent that started it."""
    spawn = sys.modules.get("sddoctor.instrument.spawn")
    line = getattr(spawn, "spawned_at", None)
    return {"spawned_at": line} if line else {}


def enable(
    run_dir: str | os.PathLike[str] | None = None,
    *,
    rank: int | None = None,
    local_rank: int | None = None,
    world_size: int | None = None,
    trace: bool = True,
    infer_steps: bool = True,
    **start_fields: Any,
) -> RankSession | None:
    """Start this rank's session (idempotent). Without `run_dir`, uses SDDOCTOR_RUN_DIR or does nothing.

    `trace`: also trace torch.distributed collectives, run the heartbeat and record the uncaught
    exception (installed now if torch is imported, else as soon as torch.distributed is).
    Safe before or after init_process_group. The rank comes from `rank`, else RANK, else the
    default process group once it exists. A second call adds its `start_fields` (device,
    backend, ...) to the state snapshot and may turn tracing on.
    `infer_steps=False`: the program reports its steps itself (`step()`); do not infer them from DDP.
    Errors of sddoctor's own are recorded (`internal_error`), never raised; a malformed
    SDDOCTOR_FAULT raises FaultSpecError.
    """
    try:
        return _enable(run_dir, rank, local_rank, world_size, trace, infer_steps, start_fields)
    except FaultSpecError:
        raise
    except Exception as exc:  # noqa: BLE001
        internal_error("enable", exc)
        return _session


def _enable(
    run_dir: str | os.PathLike[str] | None,
    rank: int | None,
    local_rank: int | None,
    world_size: int | None,
    trace: bool,
    infer_steps: bool,
    start_fields: dict[str, Any],
) -> RankSession | None:
    global _session
    if _session is not None:
        if not infer_steps:
            _session.infer_steps = False
            if _session.inference is not None:
                _session.inference.stop()
        if start_fields:
            _session.writer.update_state(**start_fields)
        if trace:
            _trace_when_possible(_session)
        return _session
    target = run_dir or os.environ.get(RUN_DIR_ENV)
    if not target:
        return None
    rank_known = rank is not None or "RANK" in os.environ
    if rank is None:
        rank = _env_int("RANK", 0)
        if not rank_known:
            rank, rank_known = _initialized_rank()
    local_rank = _env_int("LOCAL_RANK", rank) if local_rank is None else local_rank
    world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
    _session = RankSession(
        RunDir(Path(target)), rank, local_rank, world_size, faults_from_env(), rank_known=rank_known
    )
    _session.infer_steps = infer_steps
    atexit.register(_close_at_exit, _session)
    if start_fields:
        _session.writer.update_state(**{k: v for k, v in start_fields.items() if k in ("device", "backend")})
    _session.writer.emit(
        EventKind.START,
        pid=os.getpid(),
        host=socket.gethostname(),
        local_rank=local_rank,
        world_size=world_size,
        argv=redact_argv(sys.argv),
        code_roots=current_roots().to_dict(),
        comm_env=comm_env(os.environ),
        restart=_env_int("TORCHELASTIC_RESTART_COUNT", 0),  # torchrun --max-restarts: attempt - 1
        **_spawn_fields(),
        **start_fields,
    )
    flush_pending()
    if rank_known:
        _session.announce()
    if trace:
        from sddoctor.instrument import exit_hooks

        exit_hooks.install(_session)
        _session.enable_fatal_dump()
        _trace_when_possible(_session)
    return _session


def arm_on_init() -> None:
    """For a job process that is not a rank yet (no RANK in its environment: an mp.spawn worker, a
    multiprocessing.Process, a plain script): trace torch.distributed from its import on, and make
    this process a rank when it calls init_process_group, with the rank and world size of that call.
    A process that never joins a process group (the parent that only spawns) stays out."""
    from sddoctor.instrument.importhook import when_imported

    when_imported("torch.distributed", _arm)


def _arm(_module: Any = None) -> None:
    import torch.distributed as dist

    if not dist.is_available():
        return
    from sddoctor.instrument import tracing

    tracing.patch()
    if _join_at_init not in tracing._before_init:
        tracing._before_init.append(_join_at_init)
        tracing._after_init.append(_joined)


def _join_at_init(rank: int | None, world_size: int | None) -> None:
    """init_process_group was called: this process becomes that rank (if the call says which)."""
    if _session is not None or rank is None:
        return
    _become_rank(rank, world_size)
    if _session is not None:
        _session.waiting_in_init(world_size)


def _joined() -> None:
    """init_process_group returned: a rank not known at its entry is known now."""
    if _session is None:
        rank, known = _initialized_rank()
        if known:
            import torch.distributed as dist

            _become_rank(rank, dist.get_world_size())
    elif _session.writer._state.get("waiting"):
        _session.waiting(None)


def _become_rank(rank: int, world_size: int | None) -> None:
    from sddoctor.instrument.boot import RANK_PID_ENV

    os.environ[RANK_PID_ENV] = str(os.getpid())  # this process's children are not ranks
    try:
        enable(rank=rank, world_size=world_size, bootstrap=True, joined_at="init_process_group")
    except FaultSpecError as exc:  # checked at start-up already; kept for safety
        print(f"sddoctor: {exc}", file=sys.stderr, flush=True)
        os._exit(2)


def _ddp_stats() -> dict[str, Any]:
    from sddoctor.instrument import ddp_hook

    return ddp_hook.stats()


def _trace_when_possible(session: RankSession) -> None:
    """Install tracing now if torch is imported, else the moment torch.distributed is."""

    def install(_module: Any = None) -> None:
        import torch.distributed as dist

        if dist.is_available() and _session is session:
            session.install_tracing()

    if "torch.distributed" in sys.modules:
        install()
    else:
        from sddoctor.instrument.importhook import when_imported

        when_imported("torch.distributed", install)


def _initialized_rank() -> tuple[int, bool]:
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank(), True
    except Exception:  # noqa: BLE001
        pass
    return 0, False


def _close_at_exit(session: RankSession) -> None:
    global _session
    try:
        session.close()
    finally:
        if _session is session:
            _session = None
        # after the exit event is written: the backend's threads must have let go of sddoctor's
        # callbacks before the interpreter ends, or the rank aborts (see backend_callbacks)
        try:
            backend_callbacks.wait_until_released()
        except KeyboardInterrupt:  # told to stop while waiting (mp.spawn's parent): end quietly
            pass


def active() -> RankSession | None:
    return _session


@guarded("sdi.step")
def step(step: int, **fields: Any) -> None:
    if _session is not None:
        _session.step(step, **fields)


@guarded("sdi.begin_step")
def begin_step(step: int) -> None:
    if _session is not None:
        _session.begin_step(step)


@guarded("sdi.phase")
def phase(name: str) -> None:
    if _session is not None:
        _session.phase(name)


@guarded("sdi.event")
def event(kind: EventKind | str, **fields: Any) -> None:
    if _session is not None:
        _session.writer.emit(kind, **fields)


@guarded("sdi.update_state")
def update_state(**fields: Any) -> None:
    if _session is not None:
        _session.writer.update_state(**fields)


@guarded("sdi.disable")
def disable(status: str = "ok", code: int = 0) -> None:
    """Close the session: an `exit` event and a final flush. Tracing is removed."""
    global _session
    if _session is not None:
        if _session.tracer is not None:
            from sddoctor.instrument import tracing

            if tracing.active() is _session.tracer:
                tracing.uninstall()
        _session.close(status, code)
        _session = None


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return default


def _caller() -> str:
    """file:line of the innermost frame of the user's own code (else the first outside sddoctor)."""
    roots = current_roots()
    frame = sys._getframe(1)
    fallback = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if roots.is_user(filename):
            return f"{filename}:{frame.f_lineno}"
        if fallback is None and not roots.is_internal(filename):
            fallback = f"{filename}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return fallback or "?"
