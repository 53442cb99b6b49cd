"""Hang verdicts: no progress for `hang_timeout`, classified by where each rank is (missing from a
collective, a mismatch, a point-to-point deadlock, stuck outside collectives, in a DataLoader,
never started). Pure functions of `RunState`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from sddoctor.codepaths import frame_path
from sddoctor.supervise.callhistory import (
    Departure,
    PartedSites,
    PeerWait,
    blocked_call,
    group_members,
    is_p2p,
    left_routine,
    parted_sites,
    peer_waits,
    site_of,
    site_text,
)
from sddoctor.supervise.comm_errors import KnownError, known_error
from sddoctor.supervise.diagnose_base import (
    asleep_text,
    caught_after_last_call,
    describe_exit,
    ended_cleanly,
    exception_location,
    fault_of,
    handled_error,
    handled_error_evidence,
    handled_error_text,
    join_ranks,
    rank_exit,
    roots_of,
    sleeping_fault,
    where_is,
)
from sddoctor.supervise.diagnose_threads import with_thread_deaths
from sddoctor.supervise.state import RankState, RunState, Verdict
from sddoctor.telemetry.snapshot import Collective

_WORKER_LOOP = re.compile(r"torch/utils/data/_utils/worker\.py")
#: torch.distributed code a rank blocks in while inside a collective sddoctor does not trace
#: (functional collectives, which DTensor's redistribution uses, and c10d calls outside its list)
_UNTRACED_WAIT = re.compile(r"/torch/distributed/(_functional_collectives(_impl)?|distributed_c10d)\.py:")
#: how far below the innermost frame such a wait may be (torch's op dispatch sits above it)
_UNTRACED_WAIT_DEPTH = 4


_DATALOADER_FRAME = re.compile(r"torch/utils/data/|dataloader", re.IGNORECASE)


def _position(rank: RankState, state: RunState) -> str:
    if rank.exited:
        return f"rank {rank.rank}: {describe_exit(rank.exit)}"
    c = blocked_call(rank)
    if c is not None:
        peer = f", peer rank {c.peer}" if c.peer is not None else ""
        text = f"rank {rank.rank}: inside {c.op} #{c.seq} (pg {c.pg}{peer}, shapes {c.shapes}) called at {c.caller}"
        if c.off_main and c.ddp is None:
            text += " from a thread other than its main thread"
        if state.overtaken(rank.rank, c):
            text += " by its last snapshot, which is behind it: another rank has completed that call or issued a later one"
        return text
    return f"rank {rank.rank}: not in a collective; {where_is(rank)[1]}"


def _expected_ranks(state: RunState) -> list[int]:
    ranks = set(state.ranks)
    world = state.world_size or state.spawned_nprocs
    if world:
        ranks |= set(range(world))
    return sorted(ranks)


def _unjoined_process(state: RunState, rank: int) -> dict[str, Any] | None:
    """The process that is probably `rank` but has not joined the process group: the mp.spawn
    worker of that index, else the only process of the job that has not joined."""
    for process in state.unjoined:
        if process.get("spawn_index") == rank:
            return process
    unnamed = [p for p in state.unjoined if p.get("spawn_index") is None]
    missing = [r for r in _expected_ranks(state) if r not in state.ranks]
    return unnamed[0] if len(unnamed) == 1 and len(missing) == 1 else None


def _process_text(process: dict[str, Any]) -> str:
    index = process.get("spawn_index")
    what = f"mp.spawn worker {index}" if index is not None else "a process of the job"
    stack = process.get("stack") or {}
    where = f"; its stack is at {stack['top_user_frame']}" if stack.get("top_user_frame") else ""
    return f"{what} (pid {process.get('pid')}) has not joined the process group{where}"


def _never_joined(state: RunState, rank: int) -> tuple[str | None, str]:
    """Where a rank that never wrote telemetry is, if a process of the job looks like it."""
    process = _unjoined_process(state, rank)
    if process is None:
        return None, "it never joined the process group (no telemetry from it)"
    return (process.get("stack") or {}).get("top_user_frame"), _process_text(process)


def in_dataloader(rank: RankState) -> bool:
    """Whether the rank waits in its DataLoader (phase `data`, or torch's DataLoader in its stack)."""
    if rank.snapshot.phase == "data":
        return True
    frames = (rank.stack or {}).get("frames") or []
    # by the frame's file, not its function: Lightning's evaluation loop has a
    # `_store_dataloader_outputs` that reduces the logged metrics in a collective
    return any(_DATALOADER_FRAME.search(frame_path(str(f))) for f in frames)


def diagnose_hang(state: RunState) -> list[Verdict]:
    """The hang's verdicts (`classify_hang`), with the threads of the ranks that died of an
    uncaught exception before it (`thread_exception` warnings) as evidence."""
    return [with_caught_error(state, with_thread_deaths(state, v)) for v in classify_hang(state)]


def with_caught_error(state: RunState, verdict: Verdict) -> Verdict:
    """A culprit that caught an error and reported it after its last completed collective left the
    common path because of it (`except Exception: traceback.print_exc()` around the loop, then the
    cleanup's barrier): the verdict names that error and is placed at the line that raised it, the
    line to fix; where the rank waits stays in the summary. Only for a culprit that waits in a
    collective of its own (a rank stuck elsewhere, reading a file, may have caught an unrelated
    error on the way there). A rank that ended is read by its exit."""
    rank = state.ranks.get(verdict.culprit_rank) if verdict.culprit_rank is not None else None
    if rank is None or rank.exited or "handled_error" in verdict.details or blocked_call(rank) is None:
        return verdict
    found = caught_after_last_call(rank.snapshot.handled_error, rank)
    if found is None:
        return verdict
    verdict.summary = (
        f"{verdict.summary.rstrip('.')}. Rank {rank.rank} left the common path after its program "
        f"{handled_error_text(found)}"
    )
    verdict.details["handled_error"] = found
    verdict.evidence.append(handled_error_evidence(rank.rank, found))
    if found.get("caller"):
        verdict.location = str(found["caller"])
    return verdict


def classify_hang(state: RunState) -> list[Verdict]:
    """Classify a hang by where every rank is: who is missing, who disagrees, or all waiting.

    Ranks are compared per process group, among the group's members: a rank inside another
    group's collective is not out of step on this one. Point-to-point calls are judged by who
    waits for whom (their numbers count per pair of ranks, not across the group)."""
    stalled = round(state.stalled_for, 1)
    expected = _expected_ranks(state)
    calls = _blocked_calls(state)
    evidence = [
        _position(state.ranks[r], state) if r in state.ranks else f"rank {r}: never reported"
        for r in expected
    ]
    if state.stacks_problem:
        evidence.append(f"stacks: {state.stacks_problem}")
    base: dict[str, Any] = {"stalled_seconds": stalled, "hang_timeout": state.hang_timeout}
    if state.hang_declared_by is not None:
        base["declared_by_peer"] = state.hang_declared_by

    if not calls:
        return [_hang_outside_collectives(state, expected, stalled, base, evidence)]
    waits = _group_waits(state, calls, expected)
    main = _main_wait(state, waits, calls)

    # A rank whose heartbeat stopped is frozen (SIGSTOP, a debugger, native code holding the GIL,
    # D state): its snapshot is stale, so its seq cannot be compared; it is the culprit either way.
    live = [r for r in expected if r in state.ranks and not state.ranks[r].exited]
    frozen = _frozen_ranks(state, live)
    if frozen and len(frozen) < len(live):
        details = {**base, **main.details()}
        return [_frozen_hang(state, frozen, main.waiters, calls, main.where(), details, evidence)]

    # A p2p deadlock first; a rank waiting for a peer stuck in a collective its ranks disagree on
    # is a consequence of that mismatch (gloo may complete a mismatched call on one side).
    p2p = _p2p_hang(state, calls, stalled, base, evidence)
    if p2p is not None and p2p.kind == "hang.p2p_deadlock":
        return [p2p]
    if main.disagrees(calls):
        details = {**base, **main.details()}
        return [
            _mismatch_verdict(
                state, main.pg, main.seq, main.waiters, main.out_of_step, calls, details, evidence
            )
        ]
    if p2p is not None:
        return [p2p]
    crossed = [w for w in waits if w.behind]
    if main.behind and (len(crossed) < 2 or _explains(state, main, calls)):
        return [_missing_rank_hang(state, main, calls, stalled, {**base, **main.details()}, evidence)]
    if crossed:
        return [_crossed_groups_hang(state, crossed, calls, stalled, base, evidence)]

    # Everyone is inside the same call with the same signature: the communication is stuck.
    details = {**base, **main.details()}
    if state.flight_recorder:
        details["flight_recorder"] = state.flight_recorder
    summary = (
        f"hang: all {len(main.waiters)} ranks wait inside {main.where()} for {stalled:.0f} s with matching "
        "op and shapes: the communication itself is stuck; run `sddoctor check-nccl`"
    )
    if any(r.snapshot.backend == "nccl" for r in state.ranks.values()):
        evidence.append(NCCL_STUCK_ADVICE)
    return [Verdict("hang.comm", "error", summary, None, main.call.caller, details, evidence)]


#: what usually holds an NCCL collective that every rank entered with the same call (check-nccl
#: checks each of these on the machine: docs/check-nccl.md)
NCCL_STUCK_ADVICE = (
    "an NCCL collective that every rank entered and none leaves is most often peer-to-peer traffic "
    "between GPUs over PCIe: ACS enabled on the PCIe bridges, an IOMMU translating DMA, or GeForce "
    "RTX 4090/5090 cards. `sddoctor check-nccl` checks each; rerunning with NCCL_P2P_DISABLE=1 tells: "
    "if the job then runs, P2P was the cause. Across nodes: the wrong network interface "
    "(NCCL_SOCKET_IFNAME) or a broken InfiniBand path (NCCL_IB_DISABLE=1 to tell)"
)


def _blocked_calls(state: RunState) -> dict[int, Collective]:
    """The call each live rank is blocked in (see `callhistory.blocked_call`), where it counts
    (`_counts_as_held`)."""
    calls: dict[int, Collective] = {}
    for one in state.ranks.values():
        call = None if one.exited else blocked_call(one)
        if call is not None and _counts_as_held(state, call):
            calls[one.rank] = call
    return calls


def _counts_as_held(state: RunState, call: Collective) -> bool:
    """Whether a rank's call in flight says where the rank is: one that holds it (its main
    thread's, or DDP's), or a helper thread's call stalled for the hang timeout (its main thread
    may wait for that thread). A helper's younger call is a thread at work, seen in flight by a
    snapshot written at another instant than its peers': a meter all-reducing every fraction of a
    second is in its call #69 by one rank's snapshot while the other's, a moment older, issued
    #68. Paired across ranks, such a call would make a crossing of groups that never happened."""
    if call.holds_the_rank or call.since is None:
        return True
    return state.now - call.since >= state.hang_timeout


@dataclass
class _GroupWait:
    """Ranks waiting inside one collective (pg, seq), and the members of its group that are not:
    `behind` never issued it; `out_of_step` are in another call of the same group, or issued
    past it (they paired it with a different call of theirs)."""

    pg: str
    seq: int
    call: Collective
    waiters: list[int]
    members: list[int]
    behind: list[int] = field(default_factory=list)
    out_of_step: list[int] = field(default_factory=list)

    def where(self) -> str:
        # DDP's bucket rebuild is numbered apart from the group's calls: say what it is
        what = f"{DDP_STEP_CALLS['rebuild']}, " if self.call.ddp == "rebuild" else ""
        return f"{self.call.op} #{self.seq} on pg {self.pg} ({what}called at {self.call.caller})"

    def details(self) -> dict[str, Any]:
        details: dict[str, Any] = {"pg": self.pg, "seq": self.seq, "op": self.call.op}
        details["waiting_ranks"] = sorted(self.waiters)
        return details

    def disagrees(self, calls: dict[int, Collective]) -> bool:
        if is_p2p(self.call):
            return False  # a send and its recv differ by nature; p2p numbers count per pair
        signatures = {f"{calls[r].op} {_passed_text(calls[r])}" for r in self.waiters}
        return len(signatures) > 1 or bool(self.out_of_step)


def _passed_text(call: Collective) -> str:
    """What every rank must pass alike to a collective it waits in, besides the op: "shapes [[8]]",
    and a rooted call's root ("shapes [[8]] root 1")."""
    return f"shapes {call.shapes}" + (f" root {call.root}" if call.root is not None else "")


def _group_waits(state: RunState, calls: dict[int, Collective], expected: list[int]) -> list[_GroupWait]:
    """Every (pg, seq) some rank is blocked in, most waiters first; p2p calls only when no rank is
    in a collective (their numbers are per pair of ranks, so only the pair is compared)."""
    collective = {r: c for r, c in calls.items() if not is_p2p(c)} or calls
    by_call: dict[tuple[str, int], list[int]] = {}
    for r, c in collective.items():
        by_call.setdefault((c.pg, c.seq or 0), []).append(r)
    waits = []
    for (pg, seq), waiters in by_call.items():
        members = group_members(state, pg, expected)
        wait = _GroupWait(pg, seq, calls[waiters[0]], sorted(waiters), members)
        for r in members:
            if r in waiters or is_p2p(wait.call):
                continue
            mine = calls.get(r)
            rank = state.ranks.get(r)
            passed = rank is not None and not rank.exited and (rank.snapshot.issued_on(pg) or 0) >= seq
            if (mine is not None and mine.pg == pg) or passed:
                wait.out_of_step.append(r)
            else:
                wait.behind.append(r)
        waits.append(wait)
    return sorted(waits, key=lambda w: (len(w.waiters), w.seq), reverse=True)


def _main_wait(state: RunState, waits: list[_GroupWait], calls: dict[int, Collective]) -> _GroupWait:
    """The collective to explain: one whose ranks disagree, else one a rank is missing from that is
    not itself blocked in a collective, else one a rank skipped (it left its routine to go where it
    is), else the one most ranks wait in."""
    for wait in waits:
        if wait.disagrees(calls):
            return wait
    for wait in waits:
        if any(not _held_in_collective(r, calls) for r in wait.behind):
            return wait
    for wait in waits:
        if any(_departure(state, r, calls) is not None for r in wait.behind):
            return wait
    return waits[0]


def _departure(state: RunState, r: int, calls: dict[int, Collective]) -> Departure | None:
    rank = state.ranks.get(r)
    return left_routine(rank, calls[r]) if rank is not None and r in calls else None


def _held_in_collective(r: int, calls: dict[int, Collective]) -> bool:
    """Whether rank `r` is held in a collective: not free (computing, loading data, exited), and
    not in a p2p call."""
    return r in calls and not is_p2p(calls[r])


def _explains(state: RunState, wait: _GroupWait, calls: dict[int, Collective]) -> bool:
    """Whether a rank missing from `wait` is the cause: it is not held in another collective
    (it computes, loads data, waits in a p2p call or exited), or it left its routine to get there."""
    return any(
        not _held_in_collective(r, calls) or _departure(state, r, calls) is not None for r in wait.behind
    )


def _call_text(call: Collective) -> str:
    """ "recv from rank 1 #4 on pg 0:p2p (called at file:line)"."""
    peer = ""
    if call.peer is not None:
        peer = f" {'to' if call.op in ('send', 'isend') else 'from'} rank {call.peer}"
    return f"{call.op}{peer} #{call.seq} on pg {call.pg} (called at {call.caller})"


def _departure_text(r: int, departure: Departure) -> str:
    text = f"rank {r} called {site_text(departure.current)} right after {site_text(departure.previous)}"
    if departure.usual is not None:
        return (
            text + f"; every earlier time it called {site_text(departure.usual)} next: it skipped that call"
        )
    return text + ", which it never did before"


def _p2p_hang(
    state: RunState, calls: dict[int, Collective], stalled: float, base: dict[str, Any], evidence: list[str]
) -> Verdict | None:
    """Ranks blocked in send/recv: a cycle of ranks each waiting for the next is a deadlock; a rank
    waiting for a peer that is elsewhere (in a collective, computing, exited) names that peer."""
    waits = peer_waits(calls)
    cycle = next((w for w in waits if w.cycle), None)
    if cycle is not None:
        return _p2p_deadlock(state, cycle.cycle, waits, calls, stalled, base, evidence)
    blocked = next((w for w in waits if w.blocker is not None), None)
    if blocked is None or blocked.blocker is None:
        return None
    waiter, peer = blocked.chain[-1], blocked.blocker
    rank = state.ranks.get(peer)
    if peer in calls:
        location, how = calls[peer].caller, f"it is inside {_call_text(calls[peer])}"
    else:
        location, how = absent_rank_position(state, peer, rank)
    summary = (
        f"hang: rank {waiter} waits in {_call_text(calls[waiter])} for rank {peer}, which never makes the matching "
        f"call; {how}. No progress for {stalled:.0f} s"
    )
    details = {**base, "pg": calls[waiter].pg, "op": calls[waiter].op, "waiting_ranks": blocked.chain}
    details.update(missing_ranks=[peer], calls={str(r): calls[r].to_dict() for r in blocked.chain})
    return Verdict("hang.missing_rank", "error", summary, peer, location, details, evidence)


def _p2p_deadlock(
    state: RunState,
    cycle: list[int],
    waits: list[PeerWait],
    calls: dict[int, Collective],
    stalled: float,
    base: dict[str, Any],
    evidence: list[str],
) -> Verdict:
    """Each rank of `cycle` waits in a send or recv for the next one, which waits too: a deadlock of
    the program's own point-to-point order. A lone rank of the cycle that left its routine (a
    skipped send) is the culprit."""
    departures = {r: d for r in cycle if (d := _departure(state, r, calls)) is not None}
    culprit = next(iter(departures)) if len(departures) == 1 else None
    ring = "; ".join(f"rank {r} waits in {_call_text(calls[r])}" for r in cycle)
    summary = (
        f"hang: point-to-point deadlock for {stalled:.0f} s: {ring}. Each waits for the next, so none "
        "of their calls can complete: the ranks' send/recv order does not match"
    )
    if culprit is not None:
        summary += f". R{_departure_text(culprit, departures[culprit])[1:]}"
    waiting = sorted({r for w in waits for r in w.chain if r not in cycle})
    if waiting:
        summary += f". Rank {join_ranks(waiting)} wait{'s' if len(waiting) == 1 else ''} on them"
    summary += (
        "; pair every send with a recv in the same order on both ranks (or post both sides with "
        "isend/irecv or batch_isend_irecv)"
    )
    location = calls[culprit if culprit is not None else cycle[0]].caller
    details = {**base, "deadlock_ranks": cycle, "waiting_ranks": waiting}
    details["calls"] = {str(r): calls[r].to_dict() for r in sorted(set(cycle) | set(waiting))}
    return Verdict("hang.p2p_deadlock", "error", summary, culprit, location, details, evidence)


def _crossed_groups_hang(
    state: RunState,
    crossed: list[_GroupWait],
    calls: dict[int, Collective],
    stalled: float,
    base: dict[str, Any],
    evidence: list[str],
) -> Verdict:
    """Ranks blocked in collectives of different groups, each waiting for a member that is inside
    another group's collective, and no rank's own record says which one left its routine."""
    parts = [
        f"rank {join_ranks(w.waiters)} in {w.where()}, which rank {join_ranks(w.behind)} never reached"
        for w in crossed
    ]
    summary = (
        f"hang for {stalled:.0f} s: ranks wait in collectives of different process groups for each "
        f"other: {'; '.join(parts)}. The groups' collectives are called in a different order on "
        "different ranks"
    )
    details = {**base, "groups": [{**w.details(), "missing_ranks": w.behind} for w in crossed]}
    return Verdict("hang.mismatch", "error", summary, None, None, details, evidence)


def _hang_outside_collectives(
    state: RunState, expected: list[int], stalled: float, base: dict[str, Any], evidence: list[str]
) -> Verdict:
    """No rank is inside a collective: stuck in start-up, in a DataLoader, or somewhere unknown."""
    startup = _startup_hang(state, expected, base, evidence)
    if startup is not None:
        return startup
    loaders = [r.rank for r in state.ranks.values() if not r.exited and in_dataloader(r)]
    if loaders:
        location, how = where_is(state.ranks[loaders[0]], state)
        return Verdict(
            "hang.dataloader",
            "error",
            f"no progress for {stalled:.0f} s: rank {join_ranks(loaders)} stuck loading data; {how}",
            loaders[0],
            location,
            {**base, "ranks": loaders},
            evidence,
        )
    untraced = _untraced_wait_hang(state, expected, stalled, base, evidence)
    if untraced is not None:
        return untraced
    return Verdict(
        "hang.unknown",
        "error",
        f"no progress for {stalled:.0f} s and no rank is inside a collective; see each rank's stack",
        None,
        None,
        base,
        evidence,
    )


def _untraced_wait(rank: RankState) -> str | None:
    """The frame ('file:line in function') of torch.distributed code that the rank's stack shows it
    blocked in, when that is a collective sddoctor does not trace; else None."""
    for frame in ((rank.stack or {}).get("frames") or [])[:_UNTRACED_WAIT_DEPTH]:
        text = str(frame).replace("\\", "/")
        if _UNTRACED_WAIT.search(text):
            return text
    return None


def _untraced_wait_hang(
    state: RunState, expected: list[int], stalled: float, base: dict[str, Any], evidence: list[str]
) -> Verdict | None:
    """Some ranks' stacks show them blocked in a collective sddoctor does not trace (a functional
    collective, as DTensor issues) and the others are elsewhere: the others never reached it."""
    live = [r for r in expected if r in state.ranks and not state.ranks[r].exited]
    waits = {r: w for r in live if (w := _untraced_wait(state.ranks[r])) is not None}
    absent = [r for r in live if r not in waits and state.ranks[r].stack]
    if not waits or not absent:
        return None
    sleepers = [r for r in absent if sleeping_fault(state.ranks[r], state.now)]
    culprit = (sleepers or absent)[0]
    rank = state.ranks[culprit]
    location, how = where_is(rank, state)
    asleep = sleeping_fault(rank, state.now)
    if asleep:
        how += f"; it is {asleep_text(asleep)}"
        location = location or asleep.get("caller")
        evidence.append(
            f"injected fault {asleep.get('fault')!r} fired on rank {culprit} at {asleep.get('caller')}"
        )
    waiting = sorted(waits)
    frame = waits[waiting[0]]
    function = frame.partition(" in ")[2] or frame
    summary = (
        f"hang: rank {culprit} never reached the collective that rank{'s' if len(waiting) > 1 else ''} "
        f"{join_ranks(waiting)} wait{'' if len(waiting) > 1 else 's'} in for {stalled:.0f} s; {how}. "
        f"Rank{'s' if len(waiting) > 1 else ''} {join_ranks(waiting)} {'are' if len(waiting) > 1 else 'is'} in "
        f"torch.distributed's {function}: a functional collective (as DTensor issues), which sddoctor "
        "sees in the stacks only, so no sequence number or call site"
    )
    details = {
        **base,
        "missing_ranks": absent,
        "waiting_ranks": waiting,
        "untraced_waits": {str(r): w for r, w in sorted(waits.items())},
    }
    return Verdict("hang.missing_rank", "error", summary, culprit, location, details, evidence)


def _frozen_hang(
    state: RunState,
    frozen: list[int],
    waiters: list[int],
    calls: dict[int, Collective],
    where_call: str,
    details: dict[str, Any],
    evidence: list[str],
) -> Verdict:
    """The first frozen rank is the culprit: inside a collective (hang.comm) or short of it."""
    culprit = frozen[0]
    others = sorted(r for r in waiters if r not in frozen)
    ages = {r: round(state.now - (state.ranks[r].snapshot.heartbeat or 0.0), 1) for r in frozen}
    location, how = where_is(state.ranks[culprit], state)
    # a frozen rank's last snapshot can be a second behind it: a call its peers have since passed
    # is not where it froze (its stack, or its last snapshot's position, says where)
    inside = culprit in calls and not state.overtaken(culprit, calls[culprit])
    if inside:
        location = location if state.ranks[culprit].stack else calls[culprit].caller
    cause, cause_text, advice = _frozen_cause(state.ranks[culprit])
    if others:
        waiting = (
            f"rank{'s' if len(others) > 1 else ''} {join_ranks(others)} wait{'' if len(others) > 1 else 's'} "
            f"in {where_call}"
        )
    else:  # the others are still computing: they will block at their next call with it
        waiting = "no other rank is in a collective yet; each will wait at its next one with it"
    summary = (
        f"hang: rank {join_ranks(frozen)} stopped responding (heartbeat {max(ages.values()):.0f} s old) "
        + (f"inside {calls[culprit].op} #{calls[culprit].seq}" if inside else f"({how})")
        + f": {cause_text}; {waiting}"
    )
    details.update(frozen_ranks=frozen, heartbeat_age=ages, frozen_cause=cause)
    if advice:
        evidence = [*evidence, advice]
    kind = "hang.comm" if inside else "hang.missing_rank"
    return Verdict(kind, "error", summary, culprit, location, details, evidence)


def _frozen_cause(rank: RankState) -> tuple[str, str, str | None]:
    """Why a rank's heartbeat thread stopped, from its stack dump: (cause, phrase, advice)."""
    stack = rank.stack or {}
    pid = rank.pid if rank.pid is not None else "PID"
    if stack.get("stopped"):
        return (
            "stopped",
            "its process is stopped (state T: SIGSTOP, Ctrl-Z in its terminal, or a debugger holding it)",
            f"a stopped process runs again with `kill -CONT {pid}` (or `fg` in the shell that suspended "
            "it); a debugger holds it until it detaches",
        )
    if stack.get("traced"):
        return (
            "traced",
            "its process is held by a tracer (state t: a debugger such as gdb, or strace, stopped it)",
            "the rank runs on once the debugger lets it go (gdb: `continue` or `detach`)",
        )
    if stack.get("main_holds_gil"):
        return (
            "holds_gil",
            "its main thread holds the GIL in native code that does not release it, so none of its Python "
            "threads can run, sddoctor's heartbeat included",
            "a call into a C extension (or through `ctypes.PyDLL`) that runs or waits without releasing the "
            "GIL: a deadlock or a very long computation inside that library; py-spy's native frames "
            "(`py-spy dump --native --pid PID`) name the function",
        )
    return "unknown", "its process is frozen (stopped, traced, or stuck in native code)", None


def _missing_rank_hang(
    state: RunState,
    wait: _GroupWait,
    calls: dict[int, Collective],
    stalled: float,
    details: dict[str, Any],
    evidence: list[str],
) -> Verdict:
    """Some members of a group never reached the collective the others wait in: name one of them
    and where it is (inside another group's call, it is named with the call it skipped)."""
    culprits = wait.behind
    loaders = [r for r in culprits if r in state.ranks and in_dataloader(state.ranks[r])]
    elsewhere = [r for r in culprits if _held_in_collective(r, calls)]
    skipped = [r for r in elsewhere if _departure(state, r, calls) is not None]
    free = [r for r in culprits if r not in elsewhere]
    suspects = skipped or free or culprits
    # a rank a skip fault fired on first, then one still asleep in a sleep fault
    sleepers = [r for r in suspects if r in state.ranks and sleeping_fault(state.ranks[r], state.now)]
    culprit_rank = _pick_culprit(state, suspects, ("skip",), otherwise=sleepers)
    rank = state.ranks.get(culprit_rank) if culprit_rank is not None else None
    location, how = absent_rank_position(state, culprit_rank, rank)
    if culprit_rank in elsewhere:
        how += f"; it is inside {_call_text(calls[culprit_rank])} instead"
        departure = _departure(state, culprit_rank, calls)
        if departure is not None:
            how += f" ({_departure_text(culprit_rank, departure)})"
    worker = _worker_frame(rank) if loaders and rank is not None else None
    if worker is not None:
        location = worker["top_user_frame"]
        function = worker.get("top_user_function")
        how += f"; its DataLoader worker (pid {worker.get('pid')}) is at {location}" + (
            f" in {function}()" if function else ""
        )
    fault = fault_of(rank, ("skip",)) if rank else None
    asleep = sleeping_fault(rank, state.now) if rank else None
    if asleep and not loaders:
        how += f"; it is {asleep_text(asleep)}"
        location = location or asleep.get("caller")
        fault = fault or asleep
    if fault:
        evidence.append(
            f"injected fault {fault.get('fault')!r} fired on rank {culprit_rank} at {fault.get('caller')}"
        )
    kind = "hang.dataloader" if loaders else "hang.missing_rank"
    stuck = " is stuck in its DataLoader and" if loaders else ""
    waiters = wait.waiters
    summary = (
        f"hang: rank {culprit_rank}{stuck} never reached {wait.where()}; {how}"
        f"{_other_missing_text(state, [r for r in culprits if r != culprit_rank])}. "
        f"Rank{'s' if len(waiters) > 1 else ''} {join_ranks(sorted(waiters))} "
        f"wait{'' if len(waiters) > 1 else 's'} there for {stalled:.0f} s"
    )
    issued = rank.snapshot.issued_on(wait.pg) if rank else None
    first = _first_missed(state, wait, issued)
    if first is not None:
        holder, call = first
        summary += f"; the first call it never issued is {_call_text(call)}, asynchronous and in flight on rank {holder}"
        details["first_missed"] = {"seq": call.seq, "op": call.op, "caller": call.caller}
    if wait.members != _expected_ranks(state):
        details["group_members"] = wait.members
    details.update(missing_ranks=culprits, culprit_issued=issued)
    return Verdict(kind, "error", summary, culprit_rank, location, details, evidence)


#: most ranks besides the culprit whose positions a missing-rank summary gives
_MAX_OTHERS_PLACED = 3


def _other_missing_text(state: RunState, others: list[int]) -> str:
    """ ". Rank 3 never reached it either (rank 3: its stack is at ...)" for the other missing ranks."""
    if not others:
        return ""
    placed = [
        f"rank {r}: {absent_rank_position(state, r, state.ranks.get(r))[1]}"
        for r in others[:_MAX_OTHERS_PLACED]
    ]
    more = len(others) - len(placed)
    tail = f"; and {more} more" if more > 0 else ""
    which = f"Rank{'s' if len(others) > 1 else ''} {join_ranks(others)}"
    return f". {which} never reached it either ({'; '.join(placed)}{tail})"


def _first_missed(state: RunState, wait: _GroupWait, issued: int | None) -> tuple[int, Collective] | None:
    """The waiters' asynchronous call (`async_op=True`, waited later) that the missing rank never
    issued, when it comes before the call they block in: that one, not the later blocking call, is
    where the ranks parted."""
    if issued is None or issued + 1 >= wait.seq:
        return None
    for r in wait.waiters:
        rank = state.ranks.get(r)
        for call in rank.snapshot.inflight if rank is not None else ():
            if call.pg == wait.pg and call.seq == issued + 1:
                return r, call
    return None


def _worker_frame(rank: RankState) -> dict[str, Any] | None:
    """Where a DataLoader worker of the rank is inside the user's own code (its Dataset): the
    innermost user frame above torch's worker loop. A worker waiting for work has none (its
    frames below the loop are the rank's, copied by fork)."""
    roots = roots_of(rank)
    for worker in (rank.stack or {}).get("workers") or []:
        for frame in (worker.get("frames") or []) if isinstance(worker, dict) else []:
            text = str(frame)
            if _WORKER_LOOP.search(text):
                break
            if roots.is_user(frame_path(text)):
                location, _, function = text.partition(" in ")
                return {"pid": worker.get("pid"), "top_user_frame": location, "top_user_function": function}
    return None


def absent_rank_position(
    state: RunState, culprit_rank: int | None, rank: RankState | None
) -> tuple[str | None, str]:
    """Where the rank that never reached the collective is (a code location) and how it got there."""
    if rank is None:
        return _never_joined(state, culprit_rank) if culprit_rank is not None else (None, "")
    if rank.exited:
        fault = fault_of(rank, ("skip",))
        location: str | None = (
            (fault or {}).get("caller")
            or exception_location(rank.exception, rank)
            or where_is(rank, state)[0]
        )
        exit_info = rank_exit(rank, state)
        how = f"it {describe_exit(exit_info)}"
        caught = handled_error(exit_info, rank)
        if not fault and ended_cleanly(rank, exit_info):
            if caught is not None:
                how += f" after its program {handled_error_text(caught)}, having run fewer collectives than the others"
                location = caught.get("caller") or location
            else:
                how += (
                    ", having run fewer collectives than the others: uneven data per rank "
                    "(DistributedSampler(drop_last=True), or DDP's Join context) or a rank that leaves its loop early"
                )
        return location, how
    location, how = where_is(rank, state)
    fault = fault_of(rank, ("skip",))
    if fault and not (rank.stack or {}).get("top_user_frame"):
        location = fault.get("caller") or location
    return location, how


def _startup_hang(
    state: RunState, expected: list[int], base: dict[str, Any], evidence: list[str]
) -> Verdict | None:
    """No rank is in a traced collective and some rank never got past its start-up: name the ranks
    that are not waiting for their peers (in init_process_group or DDP's construction)."""
    starting = [r for r in expected if not state.past_startup(r)]
    if not starting:
        return None
    waiters = {r: m for r in starting if r in state.ranks and (m := state.ranks[r].snapshot.waiting)}
    stuck = [r for r in starting if r not in waiters]
    wait_text, caller = "", None
    elapsed = state.now - state.started
    details = {**base, "startup_seconds": round(elapsed, 1), "startup_timeout": state.startup_timeout}
    details.update(waiting_ranks=sorted(waiters), stuck_ranks=stuck)
    evidence = evidence + [
        _process_text(p) for p in state.unjoined if p.get("spawn_index") not in state.ranks
    ]
    unreachable = state.unreachable_world()
    if unreachable is not None:
        return unreachable_world_hang(unreachable, details, evidence)
    if waiters:
        what = sorted({str(m.get("what")) for m in waiters.values()})
        caller = next((m.get("caller") for m in waiters.values() if m.get("caller")), None)
        wait_text = (
            f"rank{'s' if len(waiters) > 1 else ''} {join_ranks(sorted(waiters))} wait{'' if len(waiters) > 1 else 's'} "
            f"in {' / '.join(what)}" + (f" (called at {caller})" if caller else "")
        )
    if stuck and not waiters and len(stuck) > 1:
        # Nobody waits for anybody: every rank is still in its own set-up (imports, loading).
        places = [
            f"rank {r}: {where_is(state.ranks[r], state)[1] if r in state.ranks else _never_joined(state, r)[1]}"
            for r in stuck
        ]
        summary = f"hang at start-up ({elapsed:.0f} s): no rank got to its first collective; " + "; ".join(
            places
        )
        return Verdict("hang.startup", "error", summary, None, None, details, evidence)
    if stuck:
        culprit = _pick_culprit(state, stuck, ("skip",))
        rank = state.ranks.get(culprit) if culprit is not None else None
        if rank is not None:
            location, how = where_is(rank, state)
        else:
            location, how = _never_joined(state, culprit) if culprit is not None else (None, "")
        summary = f"hang at start-up ({elapsed:.0f} s): rank {join_ranks(stuck)} never got to its first collective; {how}"
        if waiters:
            summary += f". {wait_text[0].upper()}{wait_text[1:]}"
        return Verdict("hang.startup", "error", summary, culprit, location, details, evidence)
    # Every rank that has not started waits for its peers: the rendezvous itself cannot complete.
    summary = (
        f"hang at start-up ({elapsed:.0f} s): {wait_text} and no rank is elsewhere: the ranks cannot meet "
        "(check MASTER_ADDR/MASTER_PORT or the rendezvous endpoint, a firewall, the world size, a node "
        "that never started); run `sddoctor check-nccl`"
    )
    said = _rendezvous_trouble(state.stderr_tail)
    if said is not None:  # torch logs each failed try of a store client: the address it cannot reach
        line, found = said
        details["known_error"] = found.to_dict()
        evidence = [*evidence, f"the job's output says: {line[:300]}", found.advice]
    return Verdict("hang.startup", "error", summary, None, caller, details, evidence)


def unreachable_world_hang(found: dict[str, Any], details: dict[str, Any], evidence: list[str]) -> Verdict:
    """Every rank waits in init_process_group for a world larger than the job's processes."""
    wanted, processes, ranks = found["waiting_for"], found["processes"], found["ranks"]
    caller = found.get("caller")
    summary = (
        f"hang at start-up: rank{'s' if len(ranks) > 1 else ''} {join_ranks(ranks)} wait"
        f"{'' if len(ranks) > 1 else 's'} in init_process_group for {wanted} ranks"
        + (f" (called at {caller})" if caller else "")
        + f", but the job has only {processes} process{'es' if processes != 1 else ''} ({found['source']}): "
        "the rendezvous can never "
        f"complete. The world size given to init_process_group must equal the number of processes: pass "
        f"world_size={processes}, or start {wanted} processes"
    )
    evidence = [
        *evidence,
        "a common cause: world_size taken from torch.cuda.device_count() or a constant while another "
        "number of processes is started (mp.spawn's nprocs, --nproc-per-node, CUDA_VISIBLE_DEVICES)",
    ]
    details = {**details, "unreachable_world": found}
    return Verdict("hang.startup", "error", summary, None, caller, details, evidence)


def _rendezvous_trouble(lines: list[str]) -> tuple[str, KnownError] | None:
    """The last line of the job's output that says why a rendezvous cannot complete (a store
    client's failed connection try, a taken port), with its cause and fix."""
    for line in reversed(lines):
        found = known_error(line)
        if found is not None and found.code in ("store_unreachable", "port_in_use", "rendezvous_timeout"):
            return line.strip(), found
    return None


#: how old a heartbeat (about 1 Hz, read about once a second) must be for its rank to count as
#: frozen: by default, and when the rank's stack shows its main thread holding the GIL (the
#: heartbeat thread cannot tick; a rank that merely computes in Python still ticks)
FROZEN_AFTER = 5.0
FROZEN_HOLDING_GIL_AFTER = 3.0


def _frozen_ranks(state: RunState, ranks: list[int]) -> list[int]:
    """Ranks whose heartbeat thread stopped ticking while their peers' still tick: for
    `FROZEN_AFTER` seconds, `FROZEN_HOLDING_GIL_AFTER` when the rank's stack shows its main thread
    holding the GIL, and at once when its process is stopped (state T)."""
    out = []
    for r in ranks:
        rank = state.ranks[r]
        if rank.remote:
            continue  # another host's clock: a skew would look like a stale heartbeat
        beat = rank.snapshot.heartbeat
        if beat is None:
            continue
        stack = rank.stack or {}
        if stack.get("stopped"):
            limit = 0.0
        else:
            limit = FROZEN_HOLDING_GIL_AFTER if stack.get("main_holds_gil") else FROZEN_AFTER
        if state.now - beat > limit:
            out.append(r)
    return sorted(out)


def _mismatch_verdict(
    state: RunState,
    pg: str,
    seq: int,
    waiters: list[int],
    out_of_step: list[int],
    calls: dict[int, Collective],
    details: dict[str, Any],
    evidence: list[str],
) -> Verdict:
    """Ranks disagree on a collective: the minority, else the rank(s) that called a site the others
    never call where their calls parted, else the rank whose shapes changed at a call site, else
    the one rank whose call broke its own routine (it skipped a call the others made)."""
    involved = sorted(r for r in set(waiters) | set(out_of_step) if r in calls)
    groups: dict[str, list[int]] = {}
    for r in involved:
        c = calls[r]
        groups.setdefault(f"{c.op} #{c.seq} {_passed_text(c)}", []).append(r)
    minority = min(groups.values(), key=len) if len(groups) > 1 else []
    parted = parted_sites(state, pg, involved, calls)
    odd = sorted(parted.odd) if parted is not None and len(parted.odd) < len(parted.sites) else []
    if minority and len(minority) < len(involved) / 2:
        suspects = minority
    else:
        suspects = odd or [r for r in involved if _shape_changed(state, calls[r])]
    departed = {} if suspects else _lone_departure(state, involved, calls)
    suspects = suspects or list(departed)
    culprit = _pick_culprit(state, suspects or involved, ("shape", "skip"), require_evidence=not suspects)
    parts = [
        f"rank {r}: {calls[r].op} #{calls[r].seq} {_passed_text(calls[r])} at {calls[r].caller}"
        for r in involved
    ]
    summary = f"hang: ranks disagree on collective #{seq} (pg {pg}): " + "; ".join(parts)
    location = calls[culprit].caller if culprit is not None and culprit in calls else None
    uneven = _uneven_inputs_text(state, calls, involved)
    if parted is not None:
        summary += f". {_parted_text(parted, uneven is not None)}"
        if culprit in parted.odd:
            location = parted.sites[culprit][1] or location
        details["parted_at"] = {
            "seq": parted.seq,
            "sites": {str(r): {"op": op, "caller": caller} for r, (op, caller) in parted.sites.items()},
            "odd_ranks": sorted(parted.odd),
        }
    for r, departure in departed.items():
        summary += f". {_skipped_text(r, departure, calls)}"
        details["left_routine"] = {"rank": r, **departure.to_dict()}
    if uneven:
        summary += f". {uneven}"
    roots = {calls[r].root for r in involved if calls[r].op == calls[involved[0]].op}
    if len(roots) > 1 and None not in roots:
        summary += (
            ". The ranks passed different roots: every rank must pass the same src/dst to "
            f"{calls[involved[0]].op} (a root computed from the rank differs on each)"
        )
    sites = {calls[r].caller for r in involved}
    if location is None and len(sites) == 1:
        location = sites.pop()  # every rank at one line: the fix is there, whoever is blamed
    details.update(calls={str(r): calls[r].to_dict() for r in involved}, out_of_step_ranks=out_of_step)
    fault = fault_of(state.ranks[culprit], ("shape", "skip")) if culprit in state.ranks else None
    if fault:
        evidence.append(
            f"injected fault {fault.get('fault')!r} fired on rank {culprit} at {fault.get('caller')}"
        )
        location = location or fault.get("caller")
    return Verdict("hang.mismatch", "error", summary, culprit, location, details, evidence)


def _lone_departure(
    state: RunState, involved: list[int], calls: dict[int, Collective]
) -> dict[int, Departure]:
    """The one rank of `involved` whose call broke its own routine (see `left_routine`), if only one
    did. Ranks that call the same sites in a different order do not say by their sites who is off
    the common path; a rank that skipped a call (a forward whose backward it never ran, so its next
    forward's buffer broadcast meets the others' gradient all-reduce) does, by its own record."""
    departed = {r: d for r in involved if (d := _departure(state, r, calls)) is not None}
    return departed if len(departed) == 1 else {}


def _skipped_text(r: int, departure: Departure, calls: dict[int, Collective]) -> str:
    """What the rank that broke its routine did; when the call it skipped is the one the others wait
    in as DDP's gradient all-reduce, that it ran a training forward without its backward."""
    text = f"R{_departure_text(r, departure)[1:]}"
    skipped = [c for c in calls.values() if c.ddp == "bucket" and site_of(c) == departure.usual]
    if not skipped:
        return text
    return text + (
        f" ({DDP_STEP_CALLS['bucket']}): rank {r} ran a training forward without its backward (a batch "
        "dropped between `model(x)` and `loss.backward()`: a `continue` on a non-finite loss or in an "
        "`except`), so its DDP collectives no longer pair with the other ranks'. Under DDP every rank "
        "runs the backward of every training forward: decide to skip a batch on all ranks together "
        "(all-reduce a flag first)"
    )


def _steps_text(state: RunState, in_step: list[int], elsewhere: list[int]) -> str:
    """ "rank 1 is in its step 16, rank 0 finished 15": the ranks' step counts, where known."""

    def finished(r: int) -> int | None:
        rank = state.ranks.get(r)
        return rank.snapshot.step if rank is not None else None

    parts = [f"rank {r} is in its step {n + 1}" for r in in_step if (n := finished(r)) is not None]
    parts += [f"rank {r} finished {n}" for r in elsewhere if (n := finished(r)) is not None]
    return f" ({', '.join(parts)})" if len(parts) == len(in_step) + len(elsewhere) else ""


def _uneven_inputs_text(state: RunState, calls: dict[int, Collective], involved: list[int]) -> str | None:
    """Some ranks wait in a collective DDP issues inside a training step while the others called
    something else: the classic end of uneven inputs, where a rank whose data ran out left the loop
    (for a barrier, an evaluation, the next epoch) and its peers are still training. The step counts
    show it; a collective only some ranks call from inside the loop looks the same at its first call."""
    in_step = [r for r in involved if calls[r].ddp in DDP_STEP_CALLS]
    elsewhere = [r for r in involved if calls[r].ddp not in DDP_STEP_CALLS]
    if not in_step or not elsewhere:
        return None
    what = " / ".join(sorted({DDP_STEP_CALLS[str(calls[r].ddp)] for r in in_step}))
    one, them = len(elsewhere) == 1, join_ranks(elsewhere)
    return (
        f"Rank {join_ranks(in_step)} {'is' if len(in_step) == 1 else 'are'} in a training step ({what}) "
        f"and rank {them} {'is' if one else 'are'} not{_steps_text(state, in_step, elsewhere)}: if rank "
        f"{them} left {'its' if one else 'their'} training loop, the ranks ran different numbers of "
        "iterations (uneven inputs: one rank's data gave fewer batches); give every rank the same number "
        "of batches (DistributedSampler, drop_last=True) or train under DDP's join() context. Else rank "
        f"{them}'s call is one only some ranks reach (under `if rank == 0`, `is_main_process` or "
        "`is_global_zero`, or a callback run on one rank): every rank must call it"
    )


#: the `ddp` mark of a traced call -> what it is, in a verdict's words
DDP_STEP_CALLS = {
    "bucket": "DDP's gradient all-reduce in the backward",
    "buffers": "DDP's buffer broadcast before the forward",
    "rebuild": "DDP's bucket rebuild before the forward",
}


def _parted_text(parted: PartedSites, uneven: bool = False) -> str:
    """Where the ranks' calls parted, naming every rank's call site there, and what that means: a
    call only some ranks reach; every rank at a site of its own (the ranks took different branches);
    or, with `uneven` (the uneven-inputs text follows and weighs both), nothing more."""
    said = []
    for r, site in sorted(parted.sites.items()):
        never = parted.odd.get(r)
        tail = f", which rank {join_ranks(never)} never call{'s' if len(never) == 1 else ''}" if never else ""
        said.append(f"rank {r} called {site_text(site)}{tail}")
    text = f"The ranks' calls parted at #{parted.seq}: " + "; ".join(said)
    if parted.odd and len(parted.odd) == len(parted.sites):
        return text + (
            ". Every rank is at a call site the others never call: the ranks took different branches "
            "(collectives under `if rank == ...`); every rank must issue the same collectives in the "
            "same order"
        )
    if parted.odd and uneven:
        return text
    if parted.odd:
        return text + (
            ". A collective that only some ranks reach (under `if rank == 0`, `is_main_process` or "
            "`is_global_zero`, or a callback run on one rank) must be called by every rank"
        )
    return text + ": every rank calls these sites, in a different order"


def _shape_changed(state: RunState, call: Collective) -> bool:
    """True when no rank was seen calling this site (op and line) with these shapes before, while
    it was seen there with others: the rank whose call this is changed its shapes (it is the odd
    one). The op counts, since one line of a library (Fabric's all_reduce: a barrier, then the
    all-reduce) issues several calls; and a site that carries several shapes (FSDP's per-layer
    reduce-scatters, one line for all) has each usual one known, so a usual one is no change."""
    seen: set[str] = set()
    for rank in state.ranks.values():
        for pg, sightings in rank.arrivals.items():
            for seq, arrival in sightings.items():
                if (pg, seq) == (call.pg, call.seq) or arrival.shapes is None:
                    continue  # the call in question, as each rank made it
                if (arrival.caller, arrival.op) == (call.caller, call.op):
                    seen.add(repr(arrival.shapes))
    return bool(seen) and repr(call.shapes) not in seen


def mismatch_from_sightings(state: RunState) -> Verdict | None:
    """Find the seq at which ranks' recorded ops/shapes differ (from sightings and in-flight calls)."""
    table: dict[tuple[str, int], dict[int, Collective]] = {}
    for rank in state.ranks.values():
        for pg, sightings in rank.arrivals.items():
            for seq, a in sightings.items():
                sighted = {"pg": pg, "seq": seq, "op": a.op, "shapes": a.shapes, "caller": a.caller}
                table.setdefault((pg, seq), {})[rank.rank] = Collective.of(sighted)
        for c in rank.snapshot.inflight:
            table.setdefault((c.pg, c.seq or 0), {})[rank.rank] = c
    for (pg, seq), calls in sorted(table.items(), key=lambda kv: kv[0][1]):
        if len(calls) >= 2 and _records_differ(calls):
            return _mismatch_verdict(state, pg, seq, sorted(calls), [], calls, {"pg": pg, "seq": seq}, [])
    routine = _routine_broken(state)
    if routine is not None:
        return routine
    # No two sightings of the same seq: fall back on an injected shape fault, if one fired.
    for rank in state.ranks.values():
        fault = fault_of(rank, ("shape",))
        if fault:
            return Verdict(
                "hang.mismatch",
                "error",
                f"ranks disagree on collective #{fault.get('seq')}: rank {rank.rank} changed its shapes",
                rank.rank,
                fault.get("caller"),
                {"seq": fault.get("seq"), "shapes": fault.get("shapes")},
                [f"injected fault {fault.get('fault')!r} fired on rank {rank.rank} at {fault.get('caller')}"],
            )
    return None


def _records_differ(calls: dict[int, Collective]) -> bool:
    """Whether ranks' records of one call differ: by op, or by shapes where both are known. A
    timeline row carries no shapes, so a call seen only there has none: that is no difference."""
    shapes = {repr(c.shapes) for c in calls.values() if c.shapes is not None}
    return len({c.op for c in calls.values()}) > 1 or len(shapes) > 1


def _routine_broken(state: RunState) -> Verdict | None:
    """The one rank whose last recorded call broke its own routine (see `left_routine`), when no two
    ranks' records of the same call can be compared (the aborted rank died before writing them)."""
    broken = []
    for rank in sorted(state.ranks.values(), key=lambda r: r.rank):
        sightings = [
            (a.enqueue, pg, seq, a) for pg, by_seq in rank.arrivals.items() for seq, a in by_seq.items()
        ]
        if not sightings:
            continue
        _, pg, seq, last = max(sightings, key=lambda s: s[0])
        call = Collective(
            pg=pg, seq=seq, op=last.op, shapes=last.shapes, caller=last.caller, since=last.enqueue
        )
        departure = left_routine(rank, call)
        if departure is not None:
            broken.append((rank.rank, call, departure))
    if len(broken) != 1:
        return None
    culprit, call, departure = broken[0]
    summary = (
        f"ranks disagree on collective #{call.seq} (pg {call.pg}): {_departure_text(culprit, departure)}, so its "
        f"#{call.seq} met a different call of the other ranks"
    )
    location = departure.usual[1] if departure.usual is not None else call.caller
    sighted = {"pg": call.pg, "seq": call.seq, "op": call.op, "shapes": call.shapes, "caller": call.caller}
    details = {"pg": call.pg, "seq": call.seq, "calls": {str(culprit): sighted}}
    return Verdict("hang.mismatch", "error", summary, culprit, location, details, [])


def _pick_culprit(
    state: RunState,
    suspects: list[int],
    fault_kinds: tuple[str, ...],
    require_evidence: bool = False,
    otherwise: list[int] | None = None,
) -> int | None:
    """One rank among suspects: the one an injected fault fired on, else the lowest of `otherwise`
    (ranks with weaker evidence), else the lowest (or None)."""
    for r in suspects:
        if r in state.ranks and fault_of(state.ranks[r], fault_kinds):
            return r
    if otherwise:
        return min(otherwise)
    if require_evidence and len(suspects) > 1:
        return None
    return min(suspects) if suspects else None
