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
A malformed value is an error at start (FaultSpecError), never silently ignored.
This module only parses; `sddoctor.instrument` and the trainer fire the faults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

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
_INT_KEYS = {"seq", "step", "every", "bucket", "times", "micro_batch_above", "signal"}
_FLOAT_KEYS = {"seconds"}


class FaultSpecError(ValueError):
    """SDDOCTOR_FAULT could not be parsed; the message names the problem and the fix."""


@dataclass(frozen=True)
class Fault:
    kind: str
    ranks: frozenset[int] | None  # None: every rank
    params: dict[str, object] = field(default_factory=dict)
    spec: str = ""

    def applies_to(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    def get(self, key: str, default: object = None) -> object:
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
    env = os.environ if environ is None else environ
    return parse_faults(env.get(FAULT_ENV))


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
        if key == "rank":
            ranks = _parse_ranks(value, spec)
            params["rank"] = value
        elif key in _INT_KEYS:
            params[key] = _parse_number(int, key, value, spec)
        elif key in _FLOAT_KEYS:
            params[key] = _parse_number(float, key, value, spec)
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


def _parse_number(kind: type, key: str, value: str, spec: str) -> int | float:
    try:
        number = kind(value)
    except ValueError:
        raise FaultSpecError(f"{FAULT_ENV}: {key}={value!r} in {spec!r} is not a {kind.__name__}") from None
    if number < 0:
        raise FaultSpecError(f"{FAULT_ENV}: {key}={value!r} in {spec!r} must not be negative")
    return number
