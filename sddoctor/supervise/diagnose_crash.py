"""Crash verdicts: which rank died first (signal, exit code, traceback) and which ranks only died as
a consequence (torchrun's SIGTERM, "connection reset by peer"); a collective mismatch that made
the backend abort. Pure functions of `RunState`."""

from __future__ import annotations

import re
import signal
from typing import Any

from sddoctor.codepaths import first_user_frame
from sddoctor.supervise import debug_detail, shutdown_abort
from sddoctor.supervise.callhistory import blocked_call
from sddoctor.supervise.comm_errors import KnownError, known_error
from sddoctor.supervise.diagnose_base import (
    INJECTED,
    PEER_FAILURE,
    STOP_SIGNALS,
    abnormal_exit,
    asleep_text,
    death_time,
    describe_exit,
    ended_cleanly,
    ended_position,
    exception_known_error,
    exception_location,
    fault_of,
    handled_error,
    handled_error_evidence,
    handled_error_text,
    join_ranks,
    killed_by_fault,
    lone_rank,
    raised_text,
    rank_exit,
    roots_of,
    signal_name,
    sleeping_fault,
    where_is,
)
from sddoctor.supervise.diagnose_hang import DDP_STEP_CALLS, absent_rank_position, mismatch_from_sightings
from sddoctor.supervise.diagnose_oom import HOST_OOM_ADVICE, host_oom_finding
from sddoctor.supervise.nested_traceback import NestedTraceback, nested_traceback
from sddoctor.supervise.state import RankState, RunState, Verdict
from sddoctor.telemetry.snapshot import DEFAULT_GROUP

_MISMATCH_TEXT = re.compile(
    r"doesn't match expected size|collective mismatch|mismatch(ed)? (in )?(size|shape)|"
    r"Detected mismatch between collectives",
    re.IGNORECASE,
)


#: A rank's own process-group timeout ended its wait (gloo's recv timeout, NCCL's watchdog), or
#: monitored_barrier reported the ranks that did not arrive.
_WAIT_TIMEOUT_TEXT = re.compile(
    r"Timed out waiting \d+ ?ms|failed to pass monitoredBarrier|collective operation timeout", re.IGNORECASE
)


_MONITORED_BARRIER_RANKS = re.compile(r"Ranks? ([\d,\s]+?) failed to pass monitoredBarrier", re.IGNORECASE)


#: how much earlier than sddoctor's stop a death may seem to come and still be its doing: a
#: recorded exit is exact to the poll; a rank only known to be gone (offline) has its last
#: heartbeat as its time, which a loaded host writes seconds late
_EXACT_STOP_SLACK = 0.5
_LAST_SEEN_STOP_SLACK = 5.0


def _stop_slack(rank: RankState) -> float:
    return _LAST_SEEN_STOP_SLACK if (rank.exit or {}).get("last_seen_alive") else _EXACT_STOP_SLACK


def diagnose_crash(state: RunState) -> list[Verdict]:
    """The rank that died first and why; the others that followed are named but not blamed."""
    unjoined = _unjoined_worker_crash(state)
    if unjoined is not None:
        return [unjoined]
    candidates: list[tuple[RankState, dict[str, Any] | None]] = []
    for rank in state.ranks.values():
        exit_info = rank_exit(rank, state)
        if abnormal_exit(exit_info) or rank.exception is not None:
            if state.stopped_at is not None and death_time(rank) >= state.stopped_at - _stop_slack(rank):
                continue  # sddoctor stopped it (or it fell over while being stopped)
            candidates.append((rank, exit_info))
    if not candidates:
        job = state.job_exit
        if job and job.get("code") not in (0, None) and state.stopped_by_supervisor is None:
            return [_job_only_crash(state, job)]
        quiet = _uneven_clean_end(state)
        return [quiet] if quiet is not None else []

    def blame_key(item: tuple[RankState, dict[str, Any] | None]) -> tuple[int, int, float]:
        rank, exit_info = item
        sig = (exit_info or {}).get("signal")
        message = str((rank.exception or {}).get("message", ""))
        # stopped by the launcher after one rank failed, unless it had raised an error of its own
        stopped = bool(sig and int(sig) in STOP_SIGNALS) and _own_error(rank) is None
        victim = int(stopped) + int(bool(PEER_FAILURE.search(message)))
        root = (
            0
            if any(f.get("rank") == rank.rank and f.get("root_cause") for f in state.launcher_failures)
            else 1
        )
        return (victim, root if len(candidates) > 1 else 0, death_time(rank))

    if (state.stopped_by_supervisor is not None or state.hang_declared_by is not None) and all(
        blame_key(c)[0] > 0 for c in candidates
    ):
        # Every death says a peer went away, and a supervisor stopped the job (this node's, or a
        # peer node's after a hang it diagnosed): consequences of that stop, not a crash.
        return []
    # Death time first: the earliest death is the cause unless it is clearly a victim.
    by_time = sorted(candidates, key=lambda item: death_time(item[0]))
    first_time = death_time(by_time[0][0])
    near = [c for c in candidates if death_time(c[0]) - first_time <= 1.0]
    primary, exit_info = min(near, key=blame_key) if near else by_time[0]
    if blame_key((primary, exit_info))[0] > 0:
        # The earliest was a victim (e.g. it saw the connection drop); prefer a non-victim if any.
        non_victims = [c for c in candidates if blame_key(c)[0] == 0]
        if non_victims:
            primary, exit_info = min(non_victims, key=lambda c: death_time(c[0]))
        else:
            early = _exited_early(state, primary)
            if early is not None:
                return [early]
    # The rank that died first may have given up waiting for another; monitored_barrier names the
    # ranks that did not arrive in the reporting rank's error even when another rank died first.
    reporters = [
        r for r, _ in candidates if _MONITORED_BARRIER_RANKS.search(str((r.exception or {}).get("message")))
    ]
    for waiter in [primary, *sorted(reporters, key=death_time)]:
        gave_up = _gave_up_waiting(state, waiter)
        if gave_up is not None:
            return [gave_up]
    others = sorted(r.rank for r, _ in candidates if r.rank != primary.rank)
    return [_crash_verdict(state, primary, exit_info, others, _same_error(state, primary, others))]


def _unjoined_worker_crash(state: RunState) -> Verdict | None:
    """An mp.spawn worker that failed before init_process_group, the failure torch saw first: it is
    no rank, so no rank file holds it, and the ranks that had joined die of the parent's SIGTERM.
    Named by its spawn index (the rank it would have been, as mp.spawn programs pass it on)."""
    first = next((f for f in state.unjoined_failures if f.get("root_cause")), None)
    if first is None:
        return None
    index, pid, code = first.get("spawn_index"), first.get("pid"), first.get("exitcode")
    exc = first.get("exception") or {}
    # the exit status as mp.spawn reports it: a negative code is the signal that killed the worker
    exit_info = {"signal": -code} if isinstance(code, int) and code < 0 else {"code": code}
    how = raised_text(exc) if exc else describe_exit(exit_info)
    location = exception_location(exc) if exc else None
    died = [
        r.rank for r in state.ranks.values() if r.exception is not None or abnormal_exit(rank_exit(r, state))
    ]
    summary = f"mp.spawn worker {index} (pid {pid}) died before it joined the process group: it {how}"
    if location:
        summary += f" at {location}"
    elif first.get("spawned_at"):  # nothing says where it was: where the parent started it
        location = first["spawned_at"]
        summary += f"; it was started at {location}"
    common = exception_known_error(state, exc)
    if common is not None:
        summary += common.summary_clause()
    if died:
        summary += f"; rank{'s' if len(died) > 1 else ''} {join_ranks(sorted(died))} stopped as a consequence"
    culprit = index if isinstance(index, int) and index not in state.ranks else None
    details: dict[str, Any] = {
        "spawn_index": index,
        "pid": pid,
        "joined": False,
        "exit": exit_info,
        "consequences": sorted(died),
        "traceback": exc.get("traceback") or last_traceback(state.stderr_tail),
    }
    if exc:
        details["exception"] = {"type": exc.get("type"), "message": exc.get("message")}
    evidence = [f"mp.spawn reported worker {index} (pid {pid}) as the first to fail, exit code {code}"]
    evidence += [f"rank {r}: {describe_exit(rank_exit(state.ranks[r], state))}" for r in sorted(died)]
    if common is not None:
        evidence.append(common.advice)
        details["known_error"] = common.to_dict()
    return Verdict("crash", "error", summary, culprit, location, details, evidence)


def _own_error(rank: RankState) -> str | None:
    """The type of the exception the rank raised itself (not one saying a peer went away)."""
    exc = rank.exception or {}
    if not exc or PEER_FAILURE.search(str(exc.get("message", ""))):
        return None
    return str(exc.get("type") or "Exception")


def _same_error(state: RunState, primary: RankState, others: list[int]) -> list[int]:
    """The ranks of `others` that raised the primary's error type themselves, or died of its fatal
    signal at its line: not consequences of it, since every rank ran into it (a bug in code all
    ranks run, such as DDP's unused-parameter error, or a native crash in a call every rank makes)."""
    error = _own_error(primary)
    if error is None:
        return _same_fatal_signal(state, primary, others)
    return [r for r in others if r in state.ranks and _own_error(state.ranks[r]) == error]


#: Fatal signals a rank raises only by crashing itself. SIGABRT is not one: NCCL's watchdog aborts
#: the peers of a rank that died with it, as a consequence.
_OWN_CRASH_SIGNALS = frozenset({int(signal.SIGSEGV), int(signal.SIGBUS)})


def _same_fatal_signal(state: RunState, primary: RankState, others: list[int]) -> list[int]:
    """The ranks of `others` that died of the primary's SIGSEGV or SIGBUS at the same line of their
    fatal-signal dumps (no injected fault in either)."""
    sig = (rank_exit(primary, state) or {}).get("signal")
    where = _fatal_frame(primary)
    if sig is None or int(sig) not in _OWN_CRASH_SIGNALS or where is None or fault_of(primary, ("kill",)):
        return []
    same = []
    for r in others:
        rank = state.ranks.get(r)
        if rank is None or rank.exception or fault_of(rank, ("kill",)):
            continue
        if (rank_exit(rank, state) or {}).get("signal") == sig and _fatal_frame(rank) == where:
            same.append(r)
    return same


#: How long after the peer that lost it a rank's own exit record may come (it closes its connections
#: in destroy_process_group or at exit, and writes the record after).
EXIT_RECORD_LAG = 10.0


def _uneven_clean_end(state: RunState) -> Verdict | None:
    """Every rank ended with code 0, yet they issued different numbers of collectives on the default
    group: the calls of the ranks that issued more had no peer left to complete them, so they
    failed (or were never waited for). A program that catches that error (`except Exception:
    traceback.print_exc()` around its main) then ends 0 and hides that a rank left its loop early."""
    ranks = list(state.ranks.values())
    if len(ranks) < 2 or not all(r.exited and ended_cleanly(r, rank_exit(r, state)) for r in ranks):
        return None
    issued = {r.rank: r.snapshot.issued_on(DEFAULT_GROUP) or 0 for r in ranks}
    most = max(issued.values())
    if min(issued.values()) == most:
        return None
    ahead = [r for r in ranks if issued[r.rank] == most]
    # the one whose call is known to have failed, else the lowest
    victim = min(ahead, key=lambda r: (r.snapshot.failed is None, r.rank))
    return _exited_early(state, victim, clean_end=True)


def _exited_early(state: RunState, victim: RankState, *, clean_end: bool = False) -> Verdict | None:
    """A rank that ended normally (exit code 0) before `victim` lost its peer, having issued fewer
    collectives: the victim's "connection closed by peer" is that rank leaving while it still
    expected it (uneven data per rank, a rank returning early). Under NCCL the same job hangs.
    `clean_end`: the victim caught that error too and every rank ended 0; the counts alone tell
    who left, whatever the order in which their exits were recorded."""
    victim_t = float("inf") if clean_end else death_time(victim)
    wanted = _last_seq_wanted(victim)
    if wanted is None:
        return None
    pg, seq = wanted
    gone = []
    for rank in state.ranks.values():
        exit_info = rank_exit(rank, state)
        issued = rank.snapshot.issued_on(pg) or 0
        if (
            rank.rank != victim.rank
            and ended_cleanly(rank, exit_info)
            # its exit event is written after it closed its connections, so it can trail the
            # victim's exception a little
            and death_time(rank) <= victim_t + EXIT_RECORD_LAG
            and issued < seq
        ):
            gone.append((rank, issued, exit_info))
    if not gone:
        return None
    rank, issued, exit_info = min(gone, key=lambda item: death_time(item[0]))
    done = rank.snapshot.last_done
    location = done.caller if done is not None and done.caller else None
    # the line that ended it, when it called sys.exit(0) or os._exit(0): named beside its last
    # collective (a script's closing `sys.exit(main())` would say little on its own)
    exit_call = (exit_info or {}).get("caller")
    waiting = sorted(r.rank for r in state.ranks.values() if r.rank not in {g[0].rank for g in gone})
    they = "they" if len(waiting) > 1 else "it"
    caught = handled_error(exit_info, rank)
    summary = (
        f"rank {rank.rank} ended (exit code 0) after {issued} collective{'s' if issued != 1 else ''} "
        f"on group {pg} while rank{'s' if len(waiting) > 1 else ''} {join_ranks(waiting)} went on to #{seq}"
    )
    victim_failed = victim.exception is not None or (
        victim.snapshot.failed is not None and victim.snapshot.failed.error is not None
    )
    if not clean_end:
        summary += f"; {they} failed as a consequence (the peer closed its connection)"
    elif victim_failed:
        summary += (
            f"; {they} failed as a consequence (the peer closed its connection), and {they} caught that "
            "error: every rank ended with code 0, which hid the failure"
        )
    else:
        summary += (
            f"; with no peer left, {'their' if len(waiting) > 1 else 'its'} last calls could not complete, "
            "and every rank ended with code 0, which hid the failure"
        )
    if caught is not None:
        summary += f". Rank {rank.rank} left its loop because its program {handled_error_text(caught)}"
        location = caught.get("caller") or location
    else:
        summary += (
            ". The ranks ran different numbers of collectives: uneven data per rank "
            "(DistributedSampler(drop_last=True), or DDP's Join context for uneven inputs) or a rank "
            "that leaves its loop early"
        )
    if isinstance(exit_call, str):
        summary += f". Rank {rank.rank} ended itself at {exit_call}"
    failed = victim.snapshot.failed
    message = str(
        (victim.exception or {}).get("message", "") or (failed.error if failed else "") or ""
    ).strip()
    evidence = [
        f"rank {rank.rank} {describe_exit(exit_info)} after {issued} collectives on group {pg}"
        + (f"; its last was {done.op} #{done.seq} at {done.caller}" if done is not None else ""),
        f"rank {victim.rank} was in #{seq} and then "
        + (f"raised: {message[:200]}" if message else "ended without completing it"),
    ]
    if caught is not None:
        evidence.insert(1, handled_error_evidence(rank.rank, caught))
    return Verdict(
        kind="exited_early",
        severity="error",
        summary=summary,
        culprit_rank=rank.rank,
        location=location,
        details={
            "rank": rank.rank,
            "issued": issued,
            "pg": pg,
            "waiting_in": seq,
            "exit_call": exit_call if isinstance(exit_call, str) else None,
            "consequences": waiting,
            "victim_exception": {"type": (victim.exception or {}).get("type"), "message": message},
            "handled_error": caught,
            "all_ended_ok": clean_end,
        },
        evidence=evidence,
    )


def _gave_up_waiting(state: RunState, waiter: RankState) -> Verdict | None:
    """`waiter` died of its own wait timeout (a process-group timeout shorter than --hang-timeout,
    or monitored_barrier's report) while other ranks, alive, had not reached the collective it
    waited in: a hang that the job's own timeout ended. The culprit is a rank that did not arrive."""
    message = str((waiter.exception or {}).get("message", ""))
    if not _WAIT_TIMEOUT_TEXT.search(message):
        return None
    wanted = _last_seq_wanted(waiter)
    pg, seq = wanted if wanted is not None else ("0", None)
    named = _MONITORED_BARRIER_RANKS.search(message)
    if named:
        behind = sorted({int(n) for n in re.findall(r"\d+", named.group(1))} - {waiter.rank})
    elif seq is not None:
        waited_until = death_time(waiter)
        behind = [
            rank.rank
            for rank in state.ranks.values()
            if rank.rank != waiter.rank
            and (rank.snapshot.issued_on(pg) or 0) < seq
            and not ended_cleanly(rank, rank_exit(rank, state))  # that is exited_early
            and death_time(rank) >= waited_until - 1.0  # alive while the waiter waited
        ]
    else:
        behind = []
    if not behind:
        return None
    culprit = behind[0]
    rank = state.ranks.get(culprit)
    if rank is not None and not (rank.stack or {}).get("top_user_frame"):
        location, how = where_is(rank, state)  # where it last was; its end came from the job's teardown
    else:
        location, how = absent_rank_position(state, culprit, rank)
    # no stack was taken (the job's own timeout ended it first): a rank that was asleep in an
    # injected sleep then is there, not at its last collective
    asleep = sleeping_fault(rank, death_time(waiter)) if rank is not None and not rank.stack else None
    if asleep is not None:
        how += f"; it was {asleep_text(asleep)}"
        location = asleep.get("caller") or location
    snap = waiter.snapshot
    known = [c for c in (snap.failed, *snap.inflight, snap.last_done) if c is not None]
    waited = next((c for c in known if c.seq == seq and str(c.pg) == str(pg)), None)
    call = f"#{seq} on group {pg}" if seq is not None else "the collective"
    if waited is not None:
        call = f"{waited.op} #{seq} on group {pg}" + (
            f" (called at {waited.caller})" if waited.caller else ""
        )
    first_line = (message.strip().splitlines() or [""])[0][:200]
    timeout = "monitored_barrier's timeout" if named else "the process group's timeout"
    summary = (
        f"hang: rank {join_ranks(behind)} never reached {call}; {how}. Rank {waiter.rank} gave up waiting "
        f"there when {timeout} expired ({first_line}) and the job ended"
    )
    if not named:
        summary += (
            "; a process-group timeout above --hang-timeout lets sddoctor take every rank's stack first"
        )
    evidence = [
        f"rank {waiter.rank} raised {(waiter.exception or {}).get('type')}: {message[:300]}",
        *(
            f"rank {r}: {state.ranks[r].snapshot.issued_on(pg) or 0} collectives issued on group {pg}"
            for r in behind
            if r in state.ranks
        ),
    ]
    details = {
        "pg": pg,
        "seq": seq,
        "missing_ranks": behind,
        "waiters": [waiter.rank],
        "ended": "timeout",
        "waiter_exception": {"type": (waiter.exception or {}).get("type"), "message": message},
    }
    return Verdict("hang.missing_rank", "error", summary, culprit, location, details, evidence)


def _last_seq_wanted(rank: RankState) -> tuple[str, int] | None:
    """(group, seq) of the collective `rank` was in when it failed: the failed call, else the
    newest call in flight, else the last it issued on the default group."""
    snap = rank.snapshot
    call = snap.failed or (max(snap.inflight, key=lambda c: c.since or 0.0) if snap.inflight else None)
    if call is not None and call.pg is not None and call.seq is not None:
        return str(call.pg), int(call.seq)
    for pg, seq in snap.issued.items():
        if not str(pg).endswith((":p2p", ":ddp")):  # numbered apart from the group's collectives
            return str(pg), int(seq)
    return None


#: A rank that dies of one of these signals within this many seconds after sddoctor asked it for its
#: NCCL flight-recorder dump (on a hang) is reported as a likely consequence of the dump: with torch
#: 2.11 on an H200 a rank was seen to die of SIGSEGV inside ProcessGroupNCCL a few seconds after
#: writing its dump, in a process whose collectives sddoctor traces.
DUMP_CRASH_WINDOW = 30.0


_DUMP_CRASH_SIGNALS = frozenset({int(signal.SIGSEGV), int(signal.SIGABRT), int(signal.SIGBUS)})


def _after_dump(state: RunState, rank: RankState, exit_info: dict[str, Any] | None) -> float | None:
    """Seconds between the flight-recorder dump request and this rank's death by a crash signal."""
    asked_at = (state.flight_recorder or {}).get("asked_at")
    sig = (exit_info or {}).get("signal")
    if not isinstance(asked_at, (int, float)) or sig is None or int(sig) not in _DUMP_CRASH_SIGNALS:
        return None
    after = death_time(rank) - float(asked_at)  # inf when the death time is unknown
    return after if 0 <= after <= DUMP_CRASH_WINDOW else None


def _last_known_place(rank: RankState, state: RunState) -> tuple[str | None, str]:
    """A dead rank that left no line of its own end (a SIGKILL): its line and the summary's words
    for it. A stack or its end's record says where it died ("at X"); its last snapshot's position
    or its last completed collective only where it last was, so the summary says that rather than
    "killed at" a line it may have left."""
    location, how = where_is(rank, state)
    if location is None:
        return None, ""
    exact = bool(rank.stack and rank.stack.get("top_user_frame")) or ended_position(rank) is not None
    return location, f" at {location}" if exact else f"; {how}"


def _crash_verdict(
    state: RunState,
    rank: RankState,
    exit_info: dict[str, Any] | None,
    others: list[int],
    same_error: list[int] | None = None,
) -> Verdict:
    """The crash of `rank`; of `others`, those in `same_error` raised its error themselves, the
    rest stopped as a consequence."""
    same_error = same_error or []
    consequences = [r for r in others if r not in same_error]
    exc = rank.exception
    fault = fault_of(rank, ("kill", "raise"))
    exit_call = (exit_info or {}).get("caller") if not exc else None  # sys.exit(failure) in user code
    fatal_frame = _fatal_frame(rank)  # where a fatal signal (SIGSEGV, SIGABRT) struck
    # its last collective is not where a rank that died on its way out was: no line then
    after_end = shutdown_abort.died_after_its_end(exit_info) and fault is None
    location = exception_location(exc, rank) or (fault or {}).get("caller") or exit_call or fatal_frame
    place = f" at {location}" if location else ""
    if not location and not after_end:
        location, place = _last_known_place(rank, state)
    how = describe_exit(exit_info) if exit_info else "raised an exception"
    if killed_by_fault(fault, exit_info):
        how += INJECTED
    nested = nested_traceback(str((exc or {}).get("message", "")))
    if exc and not (exit_info or {}).get("signal"):
        how = raised_text(exc)
        if nested and nested.exception:
            how = f"raised {nested.exception[:160]}" + (f" in its {nested.source}" if nested.source else "")
    summary = f"rank {rank.rank} died first: it {how}" if len(state.ranks) > 1 else f"rank {rank.rank} {how}"
    summary += place
    if after_end:
        summary += shutdown_abort.CLAUSE
    common = exception_known_error(state, exc)
    if common is not None:  # the cause, next to the error that hides it
        summary += common.summary_clause()
    summary += _same_error_clause(rank, same_error)
    host_oom = host_oom_finding(
        state,
        rank.pid,
        killed_hard=not killed_by_fault(fault, exit_info)
        and ((exit_info or {}).get("signal") == signal.SIGKILL or bool((exit_info or {}).get("unclean"))),
        exception_message=str((exc or {}).get("message", "")),
    )
    if host_oom is not None:
        summary += host_oom[0]
    under_detail = _under_debug_detail(rank, exit_info) and not killed_by_fault(fault, exit_info)
    if under_detail:
        summary += debug_detail.CRASH_CLAUSE
    if consequences:
        summary += f"; rank{'s' if len(consequences) > 1 else ''} {join_ranks(consequences)} stopped as a consequence"
    evidence = _crash_evidence(state, rank, exit_info, fault, fatal_frame)
    if under_detail:
        evidence.append(debug_detail.CRASH_EVIDENCE)
    if host_oom is not None:
        evidence.append(HOST_OOM_ADVICE)
    if common is not None:
        evidence.append(common.advice)
    if after_end:
        evidence.extend(shutdown_abort.evidence(rank.rank, exit_info, state.stderr_tail))
    traceback = exc.get("traceback") if exc else None
    if not traceback and len(state.ranks) <= 1:
        traceback = last_traceback(state.stderr_tail)
    details = _crash_details(rank, exit_info, traceback, consequences, same_error, host_oom, common, nested)
    if under_detail:
        details["torch_distributed_debug"] = "DETAIL"
    if after_end:
        details["after_program_end"] = True
    severity = "error"
    after_dump = _after_dump(state, rank, exit_info)
    if after_dump is not None:
        # The hang verdict already names the cause; this death came from looking at it.
        severity = "warning"
        details["after_flight_recorder_dump_s"] = round(after_dump, 1)
        summary += _AFTER_DUMP_CLAUSE.format(seconds=after_dump)
        evidence.append(_AFTER_DUMP_EVIDENCE)
    return Verdict(
        kind="crash",
        severity=severity,
        summary=summary,
        culprit_rank=rank.rank,
        location=location,
        details=details,
        evidence=evidence,
    )


def _same_error_clause(rank: RankState, same_error: list[int]) -> str:
    """'; rank 1 raised the same RuntimeError itself' (or died of the same signal) for the summary."""
    if not same_error:
        return ""
    themselves = "themselves" if len(same_error) > 1 else "itself"
    error = _own_error(rank)
    what = f"raised the same {error}" if error else "died of the same signal there"
    return f"; rank{'s' if len(same_error) > 1 else ''} {join_ranks(same_error)} {what} {themselves}"


def _under_debug_detail(rank: RankState, exit_info: dict[str, Any] | None) -> bool:
    """Whether `rank` died of a fatal signal with TORCH_DISTRIBUTED_DEBUG=DETAIL in its environment."""
    sig = (exit_info or {}).get("signal")
    return sig is not None and int(sig) in _DUMP_CRASH_SIGNALS and debug_detail.set_to_detail(rank)


_AFTER_DUMP_CLAUSE = (
    " ({seconds:.0f} s after sddoctor asked the ranks for their NCCL flight-recorder dumps "
    "on the hang: likely a crash of the dump itself, not a cause of the hang)"
)
_AFTER_DUMP_EVIDENCE = (
    "ProcessGroupNCCL has been seen to crash a rank a few seconds after a flight-recorder dump "
    "(torch 2.11); run with --on-hang kill to stop the job right after the diagnosis"
)


def _crash_details(
    rank: RankState,
    exit_info: dict[str, Any] | None,
    traceback: Any,
    consequences: list[int],
    same_error: list[int],
    host_oom: tuple[str, dict[str, Any]] | None,
    common: KnownError | None,
    nested: NestedTraceback | None,
) -> dict[str, Any]:
    """The crash verdict's `details`: what report.json keeps beside the summary."""
    exc = rank.exception
    details: dict[str, Any] = {
        "rank": rank.rank,
        "exit": exit_info,
        "step": rank.snapshot.step,
        "traceback": traceback,
        "consequences": consequences,
        "died_at": death_time(rank) if death_time(rank) != float("inf") else None,
    }
    if same_error:
        details["same_error"] = same_error
    if exc:
        details["exception"] = {"type": exc.get("type"), "message": exc.get("message")}
    if rank.fatal:
        details["fatal"] = rank.fatal
    if host_oom is not None:
        details["host_oom"] = host_oom[1]
    if common is not None:
        details["known_error"] = common.to_dict()
    if nested:
        details["origin"] = {
            "source": nested.source,
            "exception": nested.exception,
            "traceback": list(nested.frames),
        }
    return details


def _crash_evidence(
    state: RunState,
    rank: RankState,
    exit_info: dict[str, Any] | None,
    fault: dict[str, Any] | None,
    fatal_frame: str | None,
) -> list[str]:
    """What the crash verdict rests on: the exit, the exception, an injected fault, the fatal-signal
    dump and the launcher's own account."""
    evidence = []
    if exit_info:
        evidence.append(
            f"rank {rank.rank} {describe_exit(exit_info)} (source: {exit_info.get('source', '?')})"
        )
    exc = rank.exception
    if exc:
        evidence.append(f"exception event of rank {rank.rank}: {exc.get('type')}: {exc.get('message')}")
    if fault:
        evidence.append(
            f"injected fault {fault.get('fault')!r} fired on rank {rank.rank} at {fault.get('caller')}"
        )
    if rank.fatal:
        evidence.append(
            f"rank {rank.rank}'s fatal-signal dump ({rank.fatal.get('error')}): its thread was at "
            f"{fatal_frame or (rank.fatal.get('frames') or ['no Python frame'])[0]}"
        )
    for failure in state.launcher_failures:
        if failure.get("root_cause"):
            evidence.append(
                f"launcher's first observed failure: rank {failure.get('rank')} exitcode {failure.get('exitcode')}"
            )
    return evidence


def _fatal_frame(rank: RankState, *, user_only: bool = False) -> str | None:
    """file:line of the user's innermost frame in the rank's fatal-signal dump (else, unless
    `user_only`, its innermost)."""
    frames = [f for f in (rank.fatal or {}).get("frames") or [] if isinstance(f, str)]
    chosen = first_user_frame(frames, roots_of(rank), innermost_first=True)
    if chosen is None and not user_only:
        chosen = frames[0] if frames else None
    return chosen.split(" in ")[0].strip() if chosen else None


def _job_only_crash(state: RunState, job: dict[str, Any]) -> Verdict:
    """The job failed and no rank said anything: what its last traceback says (often the launcher's
    own, torchrun failing at its rendezvous before it started a rank)."""
    code = job.get("code")
    frames, error = _last_traceback_parts(state.stderr_tail)
    # no user frame (torchrun failing at its rendezvous): no location, the frames stay in details
    user_frame = first_user_frame(frames, roots_of()) if frames else None
    location = user_frame.split(" in ")[0] if user_frame else None
    rank = 0 if len(state.ranks) == 1 and state.world_size in (None, 1) else None
    how = f"exited with code {code}"
    if isinstance(code, int) and code < 0:
        how = f"was killed by signal {-code} ({signal_name(-code)})"
    summary = (
        f"the job {how}" + (f": {error[:300]}" if error else "") + (f" at {location}" if location else "")
    )
    evidence = ["no rank telemetry says more; the launcher's stderr is in the report"]
    details: dict[str, Any] = {"exit": job, "traceback": frames + [error] if error else frames or None}
    # the launcher's outer error ("The connection to the C10d store has failed") often wraps the
    # one with the cause, printed above it: the innermost known one says most (the port, the host)
    causes = (known_error(m, state.port_holders) for m in [*_chained_errors(state.stderr_tail), error])
    common = next((c for c in causes if c is not None), None)
    if common is not None:
        summary += common.summary_clause()
        evidence.append(common.advice)
        details["known_error"] = common.to_dict()
    return Verdict("crash", "error", summary, rank, location, details, evidence)


_CHAINED = ("The above exception was the direct cause", "During handling of the above exception")


def _chained_errors(lines: list[str]) -> list[str]:
    """The "Type: message" lines of the exceptions a later one was raised from or while handling,
    innermost first: each is the last unindented line before Python's words that chain them."""
    found = []
    for i, line in enumerate(lines):
        if line.startswith(_CHAINED):
            before = next((x for x in reversed(lines[:i]) if x.strip() and not x.startswith(" ")), None)
            if before is not None:
                found.append(before.strip())
    return found


_TB_LINE = re.compile(r'^\s*File "([^"]+)", line (\d+), in (.+)$')


def last_traceback(lines: list[str]) -> list[str] | None:
    """The last Python traceback in some stderr lines, as ["file:line in func", ..., "Type: message"]."""
    frames, error = _last_traceback_parts(lines)
    return frames + [error] if error else frames or None


def _last_traceback_parts(lines: list[str]) -> tuple[list[str], str | None]:
    """The frames ("file:line in func", outermost first) and the "Type: message" line of the last
    Python traceback in some stderr lines (a message may hold " in ": it is no frame)."""
    start = None
    for i, line in enumerate(lines):
        if (
            line.startswith("Traceback (most recent call last)")
            or "Traceback (most recent call last)" in line
        ):
            start = i
    if start is None:
        return [], None
    frames: list[str] = []
    for line in lines[start + 1 :]:
        m = _TB_LINE.match(line)
        if m:
            frames.append(f"{m.group(1)}:{m.group(2)} in {m.group(3)}")
        elif line and not line.startswith(" ") and frames:
            return frames, line.strip()
    return frames, None


def diagnose_crash_mismatch(state: RunState) -> Verdict | None:
    """A collective mismatch that made the backend abort (gloo does, NCCL may hang instead)."""
    text = "\n".join(state.stderr_tail)
    messages = [str((r.exception or {}).get("message", "")) for r in state.ranks.values()]
    if not (_MISMATCH_TEXT.search(text) or any(_MISMATCH_TEXT.search(m) for m in messages)):
        return None
    verdict = mismatch_from_sightings(state) or _fingerprint_mismatch(state)
    if verdict is None:
        summary = "ranks disagree on a collective (the backend reported a size mismatch and aborted)"
        positions = _last_positions(state)
        if positions:
            summary += ". Where the ranks were: " + "; ".join(positions)
        verdict = Verdict(
            kind="hang.mismatch", severity="error", summary=summary, location=_aborted_line(state)
        )
    verdict.details["ended"] = "crash"
    verdict.evidence.append("the backend aborted: " + _first_match(_MISMATCH_TEXT, [text, *messages]))
    return verdict


def _aborted_line(state: RunState) -> str | None:
    """The user's line of the call the ranks disagreed on, when it is one: the ranks the abort killed
    died inside that call, so their fatal-signal dumps name its line; it stands when they all name
    the same one and no other rank was last seen at another line (a rank in another call there
    makes the two lines the two sides of the disagreement: neither is named alone)."""
    aborted = [r for r in state.ranks.values() if r.fatal]
    lines = {_fatal_frame(r, user_only=True) for r in aborted}
    if len(lines) != 1 or None in lines:
        return None
    (line,) = lines
    for rank in state.ranks.values():
        if rank.fatal:
            continue
        call = rank.snapshot.failed or blocked_call(rank) or rank.snapshot.last_done
        if call is not None and call.caller not in (None, line):
            return None
    return line


def _fingerprint_mismatch(state: RunState) -> Verdict | None:
    """The calls the ranks disagreed on, from TORCH_DISTRIBUTED_DEBUG=DETAIL's errors: each rank's op
    and shapes from the wrapper's fingerprints, its line from its own exception. The culprit is the
    one rank whose call no other rank made (none with two ranks: either may be the wrong one)."""
    ranks = sorted(state.ranks.values(), key=lambda r: r.rank)
    calls = debug_detail.fingerprinted_calls(ranks)
    if len({c.describe() for c in calls.values()}) < 2:
        return None
    locations = {r.rank: exception_location(r.exception, r) for r in ranks if r.rank in calls}
    culprit = lone_rank({r: c.describe() for r, c in calls.items()})
    said = [
        f"rank {r}: {c.describe()}" + (f" at {locations[r]}" if locations.get(r) else "")
        for r, c in sorted(calls.items())
    ]
    summary = (
        "ranks disagree on a collective (TORCH_DISTRIBUTED_DEBUG=DETAIL's check raised it before "
        f"the call ran): {'; '.join(said)}"
    )
    if culprit is not None:
        summary += f". Rank {culprit} alone made its call"
    return Verdict(
        kind="hang.mismatch",
        severity="error",
        summary=summary,
        culprit_rank=culprit,
        location=locations.get(culprit) if culprit is not None else None,
        details={"detail_fingerprints": debug_detail.mismatch_details(calls, locations)},
    )


def _last_positions(state: RunState) -> list[str]:
    """Where each rank was last seen when no record says which call they disagreed on: a rank the
    abort killed at once wrote no record of that call, but its fatal-signal dump names the user's
    line it was at; another rank's last recorded call stands for its own position."""
    said = []
    for rank in sorted(state.ranks.values(), key=lambda r: r.rank):
        frame = _fatal_frame(rank) if rank.fatal else None
        call = blocked_call(rank) or rank.snapshot.last_done
        failed = rank.snapshot.failed
        if frame is not None:
            said.append(f"rank {rank.rank} aborted at {frame} (its fatal-signal dump)")
        elif failed is not None and (call is None or (failed.seq or 0) >= (call.seq or 0)):
            # the call it was in when its peer aborted, which raised (connection reset): what it
            # passed there is what the peer's call disagreed with
            passed = zip(failed.dtypes or [], failed.shapes or [], strict=False)
            tensors = ", ".join(f"{dtype}{list(shape)}" for dtype, shape in passed)
            said.append(
                f"rank {rank.rank} was in {failed.op} #{failed.seq}"
                + (f" ({tensors})" if tensors else "")
                + f" at {failed.caller}, which raised"
            )
        elif call is not None:
            what = f" ({DDP_STEP_CALLS[call.ddp]})" if call.ddp in DDP_STEP_CALLS else ""
            said.append(
                f"rank {rank.rank}'s last recorded call was {call.op} #{call.seq}{what} at {call.caller}"
            )
    return said


def _first_match(pattern: re.Pattern[str], texts: list[str]) -> str:
    for text in texts:
        for line in text.splitlines():
            if pattern.search(line):
                return line.strip()[:300]
    return ""
