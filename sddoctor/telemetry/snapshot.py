"""A rank's state snapshot (`ranks/rank-NNNNN.state`), typed: the one place that reads its fields.

`RankSnapshot.of(record)` takes a snapshot record (as `read_state` checked it, a report's rank
entry, a peer's /api/state rank or a test's hand-made dict) and gives its fields with their types,
its collectives as `Collective`s, and the facts every reader derives from them (the last seq a rank
issued on a group, whether it got past its start-up, when it was last alive). Fields of the wrong
type read as missing, so an unchecked record is safe too. `record` keeps the snapshot as it was
(with fields newer writers added) for the places that pass it on (report.json, /api/state).

`StepRecord` does the same for a `step` event (and a snapshot's `last_step`). No I/O here: the
reader of the file is `sddoctor.telemetry.reader.read_snapshot`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: The name traced calls of the default (world) process group carry: every rank is its member, so a
#: call of it that one rank completed was issued by every rank.
DEFAULT_GROUP = "0"


def _num(value: Any) -> float | None:
    """A finite number as a float (what `validate` calls "num"), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class Collective:
    """One traced call as a snapshot records it: in flight, the last one done, or the last that failed."""

    #: the process group's name ("0" for the default group; "<pg>:p2p" numbers send/recv apart)
    pg: str
    seq: int | None = None
    op: str | None = None
    shapes: Any = None
    dtypes: Any = None
    caller: str | None = None
    #: when the rank issued it (unix seconds)
    since: float | None = None
    #: when it completed and how long it took (done calls)
    t: float | None = None
    duration: float | None = None
    #: returned before the collective finished (async_op, isend/irecv, CUDA tensors)
    is_async: bool = False
    #: the other rank of a point-to-point call (send's dst, recv's src)
    peer: int | None = None
    #: the root a rooted collective was given (broadcast's src, reduce's dst...): a global rank,
    #: or "group rank N" when the program passed group_src/group_dst
    root: int | str | None = None
    #: issued by DDP inside a training step: "bucket" (a gradient bucket's all-reduce, in the
    #: backward) or "buffers" (the buffer broadcast before the forward); None for any other call
    ddp: str | None = None
    #: the program asked for a Work back (async_op=True, isend/irecv): it may wait for it later
    user_async: bool = False
    #: issued from a thread other than the rank's main thread
    off_main: bool = False
    #: what a failed call raised, or its Work failed with ("RuntimeError: ... Connection closed by
    #: peer"), recorded even when the program caught it
    error: str | None = None
    record: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> Collective:
        return cls(
            pg=str(record.get("pg")),
            seq=_int(record.get("seq")),
            op=_str(record.get("op")),
            shapes=record.get("shapes"),
            dtypes=record.get("dtypes"),
            caller=_str(record.get("caller")),
            since=_num(record.get("since")),
            t=_num(record.get("t")),
            duration=_num(record.get("duration")),
            is_async=record.get("async") is True,
            peer=_int(record.get("peer")),
            root=_int(record.get("root")) if not isinstance(record.get("root"), str) else record["root"],
            ddp=_str(record.get("ddp")),
            user_async=record.get("user_async") is True,
            off_main=record.get("off_main") is True,
            error=_str(record.get("error")),
            record=record,
        )

    @property
    def enqueued(self) -> float | None:
        """When the rank issued it: `since`, else (a done call of an older writer) `t - duration`."""
        if self.since is not None:
            return self.since
        if self.t is not None and self.duration is not None:
            return self.t - self.duration
        return None

    @property
    def holds_the_rank(self) -> bool:
        """Whether the rank's own work cannot go on until this call completes: a blocking call of
        its main thread, or one DDP waits for within its step. A Work the program asked for
        (async_op=True, isend/irecv) may be left pending on purpose (an early-stop flag polled with
        is_completed()), and a helper thread may wait long on purpose (a listener in recv, a
        metrics thread whose peer starts later) while the rank trains on."""
        return self.ddp is not None or not (self.user_async or self.off_main)

    def to_dict(self) -> dict[str, Any]:
        """The record as it was written (report.json's details)."""
        return dict(self.record)


def _handled(value: Any) -> Mapping[str, Any] | None:
    """A caught error's record, when it names a type and a time."""
    if isinstance(value, dict) and isinstance(value.get("type"), str) and _num(value.get("t")) is not None:
        return value
    return None


def _collective(value: Any) -> Collective | None:
    """The one call a snapshot names (`last_done`, `failed`); an empty record names none."""
    return Collective.of(value) if isinstance(value, dict) and value else None


@dataclass(frozen=True)
class StepRecord:
    """The fields of one finished step: a `step` event, or a snapshot's `last_step`."""

    step: int | None = None
    #: when the event was written (unix seconds)
    t: float | None = None
    #: when the step ended on the host (the trainer on CUDA writes the event a step later)
    t_end: float | None = None
    loss: float | None = None
    samples: float | None = None
    step_time: float | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    mem_alloc: float | None = None
    mem_peak: float | None = None
    mem_reserved: float | None = None
    images_per_s: float | None = None

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> StepRecord:
        return cls(
            step=_int(record.get("step")),
            t=_num(record.get("t")),
            t_end=_num(record.get("t_end")),
            loss=_num(record.get("loss")),
            samples=_num(record.get("samples")),
            step_time=_num(record.get("step_time")),
            micro_batch=_int(record.get("micro_batch")),
            grad_accum=_int(record.get("grad_accum")),
            mem_alloc=_num(record.get("mem_alloc")),
            mem_peak=_num(record.get("mem_peak")),
            mem_reserved=_num(record.get("mem_reserved")),
            images_per_s=_num(record.get("images_per_s")),
        )

    @property
    def ended(self) -> float | None:
        """When the step ended: `t_end`, else when the event was written."""
        return self.t_end if self.t_end is not None else self.t


@dataclass(frozen=True)
class RankSnapshot:
    """One rank's latest state snapshot, typed (fields absent or of the wrong type are None)."""

    record: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    #: when the snapshot was written
    t: float | None = None
    rank: int | None = None
    pid: int | None = None
    host: str | None = None
    local_rank: int | None = None
    world_size: int | None = None
    #: the CUDA device: an index, "cuda:3", or "cpu"
    device: int | str | None = None
    device_uuid: str | None = None
    cuda_visible_devices: str | None = None
    backend: str | None = None
    #: "running" or "exited"
    status: str | None = None
    #: the last finished step
    step: int | None = None
    last_step: StepRecord = StepRecord()
    phase: str | None = None
    #: what the rank waits in outside any traced collective: {what, since, caller}, or None
    waiting: Mapping[str, Any] | None = None
    #: the last error the program caught and reported ({type, message, caller, t}), or None
    handled_error: Mapping[str, Any] | None = None
    #: the last tick of the rank's heartbeat thread (about 1 Hz)
    heartbeat: float | None = None
    #: where the main thread was in the user's code when the snapshot was written ("file:line"),
    #: and in which function
    main_at: str | None = None
    main_function: str | None = None
    #: CPU seconds the rank's main thread had used when the snapshot was written
    main_cpu_s: float | None = None
    #: the calls issued and not known complete, oldest first
    inflight: tuple[Collective, ...] = ()
    last_done: Collective | None = None
    #: the main thread's last completed call, when a helper thread's completed after it
    last_done_main: Collective | None = None
    failed: Collective | None = None
    #: the last seq issued per process group ("0", "0:p2p", ...)
    issued: Mapping[str, int] = field(default_factory=dict)
    #: the global ranks of each subgroup the rank used (the default group is not listed)
    groups: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    #: completed traced calls since the start: how many, and their wall seconds
    total_count: float | None = None
    total_seconds: float | None = None
    #: DDP's gradient bucket all-reduces, when sddoctor's comm hook counts them
    ddp_buckets: float | None = None

    @classmethod
    def of(cls, record: Mapping[str, Any] | None) -> RankSnapshot:
        record = record if isinstance(record, Mapping) else {}
        colls = _dict(record.get("collectives"))
        totals = _dict(colls.get("totals"))
        issued = _dict(colls.get("issued"))
        device = record.get("device")
        waiting = record.get("waiting")
        inflight = colls.get("inflight")
        main_at = _dict(record.get("main_at"))
        return cls(
            record=record,
            t=_num(record.get("t")),
            rank=_int(record.get("rank")),
            pid=_int(record.get("pid")),
            host=_str(record.get("host")),
            local_rank=_int(record.get("local_rank")),
            world_size=_int(record.get("world_size")),
            device=device if isinstance(device, (int, str)) and not isinstance(device, bool) else None,
            device_uuid=_str(record.get("device_uuid")),
            cuda_visible_devices=_str(record.get("cuda_visible_devices")),
            backend=_str(record.get("backend")),
            status=_str(record.get("status")),
            step=_int(record.get("step")),
            last_step=StepRecord.of(_dict(record.get("last_step"))),
            phase=_str(record.get("phase")),
            waiting=waiting if isinstance(waiting, dict) and waiting.get("what") else None,
            handled_error=_handled(record.get("handled_error")),
            heartbeat=_num(record.get("heartbeat")),
            main_at=_str(main_at.get("at")),
            main_function=_str(main_at.get("function")),
            main_cpu_s=_num(record.get("main_cpu_s")),
            inflight=tuple(Collective.of(c) for c in inflight if isinstance(c, dict))
            if isinstance(inflight, list)
            else (),
            last_done=_collective(colls.get("last_done")),
            last_done_main=_collective(colls.get("last_done_main")),
            failed=_collective(colls.get("failed")),
            issued={str(k): v for k, v in issued.items() if _int(v) is not None},
            groups={
                str(k): tuple(r for r in v if _int(r) is not None)
                for k, v in _dict(colls.get("groups")).items()
                if isinstance(v, list)
            },
            total_count=_num(totals.get("count")),
            total_seconds=_num(totals.get("seconds")),
            ddp_buckets=_num(_dict(colls.get("ddp")).get("buckets")),
        )

    @property
    def exited(self) -> bool:
        return self.status == "exited"

    @property
    def alive_at(self) -> float | None:
        """The last time the rank was seen alive: its heartbeat, else when the snapshot was written."""
        return self.heartbeat if self.heartbeat is not None else self.t

    @property
    def started_work(self) -> bool:
        """Whether the rank has finished a step or issued a collective (past its start-up)."""
        return self.step is not None or bool(self.issued) or bool(self.inflight)

    def issued_on(self, pg: str) -> int | None:
        """The last seq this rank issued on `pg` (from `issued`, else from the calls it names)."""
        if pg in self.issued:
            return self.issued[pg]
        seqs = [c.seq for c in (*self.inflight, self.last_done) if c is not None and c.pg == pg]
        known = [s for s in seqs if s is not None]
        return max(known) if known else None
