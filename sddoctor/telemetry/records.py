"""The records of a run directory, field by field: the schema of docs/telemetry.md in code.

Each file's records are a TypedDict here; `validate` derives the type check of every field from
these declarations (`field_kinds`), so a field's documented type is written once. All fields are
optional (`total=False`): readers must live with any of them missing, and keep unknown ones.
The typed views that interpret these records are `snapshot.RankSnapshot` (a rank's state
snapshot) and `runinfo.RunInfo` (run.json).

Python types stand for JSON types: `float` is any finite number (an int too), `int` an integer
(never a bool), `X | None` a value that may be null, `list[...]`/`dict[...]` arrays and objects.
"""

from __future__ import annotations

from typing import Any, TypedDict

# -- ranks/rank-NNNNN.state ----------------------------------------------------------------------

#: One traced call (`collectives.inflight[]`, `last_done`, `failed`). `async` is a Python keyword,
#: hence the functional form.
CollectiveRecord = TypedDict(
    "CollectiveRecord",
    {
        "pg": int | str,
        "seq": int,
        "op": str,
        "shapes": list[Any],
        "dtypes": list[Any],
        "caller": str,
        "since": float,
        "async": bool,
        "waiting": float,
        "t": float,
        "duration": float,
    },
    total=False,
)


class CollectiveTotals(TypedDict, total=False):
    count: float
    seconds: float


class DdpTotals(TypedDict, total=False):
    buckets: float
    seconds: float


class Collectives(TypedDict, total=False):
    """The collective tracer's view (`collectives` of a state snapshot)."""

    inflight: list[CollectiveRecord]
    last_done: CollectiveRecord
    failed: CollectiveRecord
    issued: dict[str, int]
    groups: dict[str, list[int]]
    totals: CollectiveTotals
    ddp: DdpTotals
    recent: list[CollectiveRecord]


class LastStep(TypedDict, total=False):
    """The fields of a finished step (`last_step` of a snapshot; a `step` event carries the same)."""

    step: int
    loss: float
    samples: float
    step_time: float
    micro_batch: int
    grad_accum: int
    mem_alloc: float | None  # null off CUDA
    mem_peak: float | None  # null off CUDA
    mem_reserved: float | None  # null off CUDA
    images_per_s: float
    lr: float
    t: float


class WaitingMarker(TypedDict, total=False):
    """What a rank waits in outside any traced collective (`init_process_group`)."""

    what: str
    since: float
    caller: str


class StateSnapshot(TypedDict, total=False):
    """`ranks/rank-NNNNN.state`: the latest snapshot of one rank."""

    v: int
    t: float
    rank: int
    pid: int
    host: str
    local_rank: int
    world_size: int
    device: int | str
    #: the rank's GPU when it reports it (exact, unlike an index), and the CUDA_VISIBLE_DEVICES its
    #: device index counts in ("4,5" makes cuda:1 the physical GPU 5)
    device_uuid: str
    cuda_visible_devices: str
    backend: str
    status: str
    step: int
    last_step: LastStep
    phase: str
    phase_since: float
    waiting: WaitingMarker | None
    collectives: Collectives
    heartbeat: float
    provider_errors: list[Any]


# -- ranks/rank-NNNNN.jsonl ----------------------------------------------------------------------


class EventBase(TypedDict, total=False):
    """What every event carries."""

    v: int
    t: float
    rank: int
    kind: str


class StartFields(TypedDict, total=False):
    pid: int
    host: str
    local_rank: int
    world_size: int
    argv: list[Any]
    #: how many times the launcher restarted the workers before this process (torchrun --max-restarts)
    restart: int


class StepFields(LastStep, total=False):
    #: when the step ended on the host (on CUDA the event can be written a step later)
    t_end: float
    #: "ddp" / "optimizer" for steps sddoctor inferred from an unchanged program (its DDP model, or
    #: without one its optimizer)
    source: str


class CollectiveSummaryFields(TypedDict, total=False):
    count: float
    seconds: float
    ops: dict[str, Any]
    last_seq: dict[str, Any]


class OomFields(TypedDict, total=False):
    step: int | None
    phase: str
    micro_batch: int
    grad_accum: int
    mem_alloc: float | None  # null off CUDA
    mem_reserved: float | None  # null off CUDA
    mem_total: float | None  # null off CUDA
    message: str


class FallbackFields(TypedDict, total=False):
    step: int | None
    failed_ranks: list[Any]
    step_applied: bool


class WarningFields(TypedDict, total=False):
    code: str
    message: str


class FaultFields(TypedDict, total=False):
    fault: str
    seq: int
    step: int
    caller: str
    pg: int | str
    op: str
    signal: int


class CheckpointFields(TypedDict, total=False):
    step: int | None
    path: str
    seconds: float
    reason: str
    action: str


class ExceptionFields(TypedDict, total=False):
    type: str
    message: str
    traceback: list[str]
    caller: str
    step: int | None


class ExitFields(TypedDict, total=False):
    status: str
    code: int | None
    step: int | None
    #: file:line of the user's code that called sys.exit with a failure status
    caller: str
    #: status "signal": where the main thread was when SIGTERM came (its innermost user frame),
    #: that frame's function, and the main thread's stack ("file:line in func", innermost last)
    at: str
    at_function: str
    stack: list[str]


class ReplicasFields(TypedDict, total=False):
    step: int | None
    params_sha256: str


#: The fields of each event kind beyond `EventBase` (kinds not listed keep whatever they carry).
EVENT_KINDS: dict[str, type] = {
    "start": StartFields,
    "step": StepFields,
    "collective": CollectiveSummaryFields,
    "oom": OomFields,
    "fallback": FallbackFields,
    "warning": WarningFields,
    "fault": FaultFields,
    "checkpoint": CheckpointFields,
    "exception": ExceptionFields,
    "exit": ExitFields,
    "replicas": ReplicasFields,
}


# -- run.json --------------------------------------------------------------------------------------


class RunOptionsRecord(TypedDict, total=False):
    """`options` of run.json: how `sddoctor run` judged the run (see `runinfo.RunOptions`)."""

    hang_timeout: float
    startup_timeout: float
    straggler_ratio: float
    on_hang: str


class RunRecord(TypedDict, total=False):
    """run.json."""

    command: list[str]
    started: float
    created: float
    host: str
    launcher: str
    world_size: int | None
    node_rank: int
    supervisor_pid: int
    options: RunOptionsRecord
    endpoint: str | None
    fault: str | None
