"""Parsing of `SDDOCTOR_FAULT`, the one variable that injects faults into a run.

Grammar: faults separated by ';', each `KIND:key=value,key=value`. Examples:

    skip:rank=1,seq=12                 rank 1 does not issue its 12th collective (others hang)
    shape:rank=1,seq=5                 rank 1's 5th collective gets a different shape
    sleep:rank=2,seconds=0.5           rank 2 sleeps 0.5 s before each step (a straggler)
    kill:rank=1,step=3                 rank 1 SIGKILLs itself when step 3 starts
    raise:rank=0,step=2                rank 0 raises RuntimeError at step 2
    oom:rank=1,step=3,phase=backward   rank 1 raises an out-of-memory error in step 3's backward

`rank` takes one rank, several joined by '|' (`rank=0|2`), or `*` for every rank.
`seq=K` counts collectives on one process group, from 1: the default group unless `pg=NAME`
names another (`pg=NAME:p2p` counts that group's send/recv ops, `pg=*` any group).
Every key and value is checked: `seq` and `every` count from 1, `step`, `bucket` and
`micro_batch_above` from 0, `times` from 1, `seconds` is a finite number >= 0, `signal` a signal
of this OS by number or name (9, KILL, SIGKILL), and every rank lies inside the world once its
size is known (`check_world`). A malformed value is an error at start (FaultSpecError, whose
message ends with GRAMMAR), never silently ignored: `sddoctor run` and each rank exit with code 2.
This module only parses; `sddoctor.instrument` and the trainer fire the faults.
"""

from __future__ import annotations

import math
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Any

FAULT_ENV = "SDDOCTOR_FAULT"

#: kind -> (required keys, optional keys)
FAULT_KINDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "skip": (frozenset({"rank", "seq"}), frozenset({"pg"})),
    "shape": (frozenset({"rank", "seq"}), frozenset({"pg"})),
    "sleep": (frozenset({"rank", "seconds"}), frozenset({"step", "seq", "every", "phase", "pg"})),
    "kill": (frozenset({"rank"}), frozenset({"step", "seq", "signal", "pg"})),
    "raise": (frozenset({"rank"}), frozenset({"step", "seq", "message", "phase", "pg"})),
    "oom": (frozenset({"rank", "step"}), frozenset({"phase", "bucket", "times", "micro_batch_above"})),
}

PHASES = ("forward", "backward", "optimizer", "data")
#: integer keys and the smallest value each takes (a collective or a repetition counts from 1)
_INT_MINIMUM = {"seq": 1, "every": 1, "times": 1, "step": 0, "bucket": 0, "micro_batch_above": 0}
_FLOAT_KEYS = {"seconds"}

#: What a FaultSpecError message ends with: the whole grammar, so the fix is on screen.
GRAMMAR = """\
SDDOCTOR_FAULT grammar: faults separated by ';', each KIND:key=value,...
  skip:rank=R,seq=K[,pg=NAME]                 rank R does not issue its K-th collective
  shape:rank=R,seq=K[,pg=NAME]                rank R's K-th collective gets another shape
  sleep:rank=R,seconds=S[,step=N|seq=K][,every=E][,pg=NAME]
  kill:rank=R,step=N|seq=K[,signal=SIG][,pg=NAME]
  raise:rank=R,step=N|seq=K[,message=TEXT][,pg=NAME]
  oom:rank=R,step=N[,phase=forward|backward|optimizer][,bucket=B][,times=T][,micro_batch_above=M]
  R: a rank, ranks joined by '|' (0|2) or '*'; K, E, T >= 1; N, B, M >= 0; S: seconds >= 0;
  SIG: a signal number or name of this OS (9, KILL, SIGTERM). Details: docs/run.md#fault-injection"""


class FaultSpecError(ValueError):
    """SDDOCTOR_FAULT could not be parsed; the message names the problem and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.problem = message

    def __str__(self) -> str:
        return f"{self.problem}\n{GRAMMAR}"


@dataclass(frozen=True)
class Fault:
    kind: str
    ranks: frozenset[int] | None  # None: every rank
    params: dict[str, Any] = field(default_factory=dict)  # numbers and words of the spec
    spec: str = ""

    def applies_to(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    def get(self, key: str, default: Any = None) -> Any:
        return self.params.get(key, default)


def parse_faults(text: str | None) -> list[Fault]:
    """Parse a SDDOCTOR_FAULT value. Empty or None gives no faults."""
    if not text or not text.strip():
        return []
    faults = []
    for part in text.split(";"):
        part = part.strip()
        if part:
            faults.append(_parse_one(part))
    return faults


def faults_from_env(environ: dict[str, str] | None = None) -> list[Fault]:
    """The faults of SDDOCTOR_FAULT, checked against WORLD_SIZE when the environment has it."""
    env = os.environ if environ is None else environ
    faults = parse_faults(env.get(FAULT_ENV))
    world = env.get("WORLD_SIZE", "")
    if faults and world.isdigit():
        check_world(faults, int(world))
    return faults


def check_world(faults: list[Fault], world_size: int | None) -> None:
    """Raise FaultSpecError when a fault names a rank outside a world of `world_size` ranks."""
    if not world_size or world_size < 1:
        return
    for fault in faults:
        outside = sorted(r for r in fault.ranks or () if r >= world_size)
        if outside:
            raise FaultSpecError(
                f"{FAULT_ENV}: rank {'|'.join(map(str, outside))} in {fault.spec!r} is outside the world "
                f"of {world_size} rank(s) (0-{world_size - 1}); it would never fire"
            )


def exit_if_outside_world(faults: list[Fault], world_size: int | None) -> None:
    """In a rank that learns its world size late (mp.spawn, init_process_group): a fault for a rank
    outside it stops the process with exit code 2, as a malformed spec does at start."""
    try:
        check_world(faults, world_size)
    except FaultSpecError as exc:
        try:
            print(f"sddoctor: {exc}", file=sys.stderr, flush=True)
            _tell_supervisor(str(exc))
        finally:
            os._exit(2)


def _tell_supervisor(message: str) -> None:
    """Leave the usage error where `sddoctor run` looks at the end, so that the job's end is
    reported as exit code 2 and not as a crash of this rank."""
    from sddoctor.telemetry.layout import RUN_DIR_ENV, RunDir, atomic_write_text

    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir:
        atomic_write_text(RunDir(run_dir).usage_error_file, message + "\n")


def _parse_one(spec: str) -> Fault:
    kind, sep, rest = spec.partition(":")
    kind = kind.strip().lower()
    if kind not in FAULT_KINDS:
        raise FaultSpecError(
            f"{FAULT_ENV}: unknown fault kind {kind!r} in {spec!r}; valid kinds: {', '.join(sorted(FAULT_KINDS))}"
        )
    if not sep:
        raise FaultSpecError(f"{FAULT_ENV}: {spec!r} has no parameters; write it as {kind}:rank=R,...")
    required, optional = FAULT_KINDS[kind]
    params: dict[str, object] = {}
    ranks: frozenset[int] | None = frozenset()
    for item in rest.split(","):
        item = item.strip()
        if not item:
            continue
        key, eq, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not eq or not value:
            raise FaultSpecError(f"{FAULT_ENV}: {item!r} in {spec!r} is not key=value")
        if key not in required and key not in optional:
            raise FaultSpecError(
                f"{FAULT_ENV}: {kind} does not take {key!r} (in {spec!r}); "
                f"it takes {', '.join(sorted(required | optional))}"
            )
        if key in params:
            raise FaultSpecError(f"{FAULT_ENV}: {key} is given twice in {spec!r}")
        if key == "rank":
            ranks = _parse_ranks(value, spec)
            params["rank"] = value
        elif key == "signal":
            params[key] = _parse_signal(value, spec)
        elif key in _INT_MINIMUM:
            params[key] = _parse_int(key, value, spec, _INT_MINIMUM[key])
        elif key in _FLOAT_KEYS:
            params[key] = _parse_seconds(key, value, spec)
        elif key == "phase":
            if value not in PHASES:
                raise FaultSpecError(
                    f"{FAULT_ENV}: phase={value!r} in {spec!r}; valid phases: {', '.join(PHASES)}"
                )
            params[key] = value
        else:
            params[key] = value
    missing = required - params.keys()
    if missing:
        raise FaultSpecError(f"{FAULT_ENV}: {spec!r} lacks {', '.join(sorted(missing))}")
    if kind in ("kill", "raise") and "step" not in params and "seq" not in params:
        raise FaultSpecError(f"{FAULT_ENV}: {spec!r} needs step=S or seq=K to say when it fires")
    return Fault(kind=kind, ranks=ranks, params=params, spec=spec)


def _parse_ranks(value: str, spec: str) -> frozenset[int] | None:
    if value == "*":
        return None
    try:
        ranks = frozenset(int(v) for v in value.split("|"))
    except ValueError:
        raise FaultSpecError(f"{FAULT_ENV}: rank={value!r} in {spec!r}; use an integer, 0|2, or *") from None
    if any(r < 0 for r in ranks):
        raise FaultSpecError(f"{FAULT_ENV}: rank={value!r} in {spec!r} must not be negative")
    return ranks


def _parse_int(key: str, value: str, spec: str, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise FaultSpecError(f"{FAULT_ENV}: {key}={value!r} in {spec!r} is not an integer") from None
    if number < minimum:
        raise FaultSpecError(
            f"{FAULT_ENV}: {key}={value!r} in {spec!r} must be {minimum} or more"
            + (" (it counts from 1)" if minimum == 1 else " (it must not be negative)")
        )
    return number


def _parse_seconds(key: str, value: str, spec: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise FaultSpecError(f"{FAULT_ENV}: {key}={value!r} in {spec!r} is not a number") from None
    if not math.isfinite(number) or number < 0:
        raise FaultSpecError(f"{FAULT_ENV}: {key}={value!r} in {spec!r} must be a finite number >= 0")
    return number


def _parse_signal(value: str, spec: str) -> int:
    """A signal of this OS by number (9) or name (KILL, SIGKILL, sigterm)."""
    if value.lstrip("-").isdigit():
        number = int(value)
    else:
        name = value.upper()
        known = getattr(signal.Signals, name if name.startswith("SIG") else "SIG" + name, None)
        number = int(known) if known is not None else -1
    if number not in {int(s) for s in signal.valid_signals()} or number == 0:
        raise FaultSpecError(
            f"{FAULT_ENV}: signal={value!r} in {spec!r} is not a signal of this system; use a number "
            f"or a name such as 9, KILL, SIGTERM, SIGABRT"
        )
    return number
