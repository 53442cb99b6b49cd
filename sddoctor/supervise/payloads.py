"""Collectives that completed although the ranks passed different things: a silent mismatch.

A collective whose ranks disagree on the size of the data usually fails loudly (gloo aborts on
the size, NCCL hangs: `hang.mismatch`). Two mistakes pass unseen: a different reduce op (SUM on
one rank, MAX or AVG on another) and a different dtype of the same width (float32 against
int32). The call completes on every backend and every rank goes on with a result none of them
meant. Each rank's timeline (`timeline/rank-N.jsonl`) keeps, per completed call, a signature of
what all ranks must pass alike (`sig`: dtypes, element counts, reduce op; see
`sddoctor.instrument.timeline.payload_signature`); this module compares them across ranks by
(process group, sequence number) once the run has ended.

Calls whose arguments may legitimately differ (all_to_all, all_gather_object, point-to-point)
carry no signature and are not compared; gather, scatter and the rooted object calls compare
their root only. A (group, seq) that one rank recorded
twice (a torchrun restart numbers its calls from 1 again) is skipped rather than guessed at.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sddoctor.supervise.diagnose_base import lone_rank
from sddoctor.supervise.state import RunState, Verdict
from sddoctor.telemetry import RunDir
from sddoctor.telemetry.timeline import read_timeline

#: what a rank passed to one call: (op, signature, caller)
Passed = tuple[str, str, str | None]


def signatures(calls: Iterable[Mapping[str, Any]]) -> dict[tuple[str, int], Passed | None]:
    """One rank's compared calls by (group, seq); None where the rank recorded that call twice."""
    out: dict[tuple[str, int], Passed | None] = {}
    for call in calls:
        sig, seq, pg = call.get("sig"), call.get("seq"), str(call.get("pg"))
        if not isinstance(sig, str) or not isinstance(seq, int) or pg.endswith(":p2p"):
            continue
        key = (pg, seq)
        caller = call.get("caller")
        out[key] = (
            None if key in out else (str(call.get("op")), sig, caller if isinstance(caller, str) else None)
        )
    return out


def find_mismatches(by_rank: Mapping[int, Mapping[tuple[str, int], Passed | None]]) -> list[dict[str, Any]]:
    """Every (group, seq) that two or more ranks recorded with different op or signature, in
    (group, seq) order: {pg, seq, passed: {rank: {op, sig, caller}}, odd_rank}."""
    found: list[dict[str, Any]] = []
    for key in sorted({key for table in by_rank.values() for key in table}):
        seen = {rank: table[key] for rank, table in by_rank.items() if key in table}
        passed = {rank: p for rank, p in seen.items() if p is not None}
        if len(passed) < 2 or len(passed) < len(seen):  # one rank, or a rank that recorded it twice
            continue
        what = {rank: (op, sig) for rank, (op, sig, _) in passed.items()}
        if len(set(what.values())) < 2:
            continue
        found.append(
            {
                "pg": key[0],
                "seq": key[1],
                "passed": {
                    rank: {"op": op, "sig": sig, "caller": caller}
                    for rank, (op, sig, caller) in sorted(passed.items())
                },
                "odd_rank": lone_rank(what),
            }
        )
    return found


def attach_mismatches(state: RunState, run_dir: RunDir) -> None:
    """Read every rank's timeline and keep the silent mismatches on `state` for the diagnosis.
    Never raises: an unreadable timeline means nothing is compared."""
    try:
        tables = {rank: signatures(read_timeline(run_dir, rank)[0]) for rank in state.ranks}
        state.payload_mismatches = find_mismatches(tables)
    except (OSError, ValueError, TypeError):
        state.payload_mismatches = []


def diagnose_payload_mismatch(state: RunState) -> list[Verdict]:
    """`collective.mismatch`: the first call whose ranks passed different things, and how many."""
    found = state.payload_mismatches
    if not found:
        return []
    first = found[0]
    passed: dict[int, dict[str, Any]] = first["passed"]
    culprit = first["odd_rank"]
    op = next(iter(passed.values()))["op"]
    each = ", ".join(
        f"rank {rank} {p['sig']}{'' if p['op'] == op else ' (' + p['op'] + ')'} at {p['caller'] or 'an unknown line'}"
        for rank, p in passed.items()
    )
    more = f" ({len(found)} such calls)" if len(found) > 1 else ""
    summary = (
        f"{op} #{first['seq']} on process group {first['pg']} completed although the ranks passed "
        f"different arguments: {each}. Its result is not what the ranks meant, and nothing failed{more}"
    )
    evidence = [f"rank {rank}: {p['op']} {p['sig']} at {p['caller']}" for rank, p in passed.items()]
    evidence.append(
        "every rank must pass the same reduce op and the same dtype and number of elements to a "
        "collective; look for a rank-dependent op= or dtype (a branch on the rank, a tensor built "
        "differently on one rank)"
    )
    location = passed[culprit]["caller"] if culprit is not None else None
    details = {
        "pg": first["pg"],
        "seq": first["seq"],
        "passed": {str(rank): p for rank, p in passed.items()},
        "calls": len(found),
    }
    return [Verdict("collective.mismatch", "error", summary, culprit, location, details, evidence)]
