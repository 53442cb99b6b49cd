"""The diagnosis: pure functions from a `RunState` to a list of `Verdict`s.

No I/O here. Each function looks at one kind of trouble:

- `diagnose_crash`: which rank died first (signal, exit code, traceback); ranks that died as a
  consequence (torchrun's SIGTERM, "connection reset by peer") are not blamed.
- `diagnose_oom`: out-of-memory events, and whether the trainer's fallback absorbed them.
- `diagnose_hang`: no progress for `hang_timeout`; classified by where each rank is.
- `diagnose_straggler` (in `straggler`): the rank that the others keep waiting for.

`diagnose` runs them all and orders the verdicts most severe first.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from typing import Any

from sddoctor.codepaths import CodeRoots, current_roots, first_user_frame, frame_path
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
    site_text,
)
from sddoctor.supervise.nested_traceback import nested_traceback
from sddoctor.supervise.state import VERDICT_KINDS, RankState, RunState, Verdict
from sddoctor.supervise.straggler import diagnose_straggler
from sddoctor.telemetry.snapshot import Collective

#: Messages a rank raises when a *peer* went away: such a rank is a victim, not the cause.
_PEER_FAILURE = re.compile(
    r"connection (reset|closed|refused)|broken pipe|peer|socket timeout|timed out|"
    r"communicator was aborted|nccl.*abort|remote process exited|heartbeat|watchdog|"
    r"check rank \d+ logs for faulty rank",
    re.IGNORECASE,
)
_OOM_TEXT = re.compile(r"out of memory|OutOfMemoryError|CUDA error: out of memory", re.IGNORECASE)
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
#: Signals a launcher (or sddoctor) sends to stop the survivors after a failure.
_STOP_SIGNALS = {int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGHUP)}
_WORKER_LOOP = re.compile(r"torch/utils/data/_utils/worker\.py")
_DATALOADER_FRAME = re.compile(r"torch/utils/data/|dataloader", re.IGNORECASE)


def diagnose(state: RunState) -> list[Verdict]:
    """Every verdict that applies to `state`, most severe first."""
    verdicts: list[Verdict] = []
    ooms = diagnose_oom(state)
    fatal_oom_ranks = {v.culprit_rank for v in ooms if v.kind == "oom"}
    verdicts += ooms
    mismatch = diagnose_crash_mismatch(state)
    if mismatch is not None:
        verdicts.append(mismatch)
    else:
        # Ranks that stopped because another rank ran out of memory (an agreed OOM error) are
        # part of the OOM verdict, not crashes of their own.
        verdicts += [
            v
            for v in diagnose_crash(state)
            if not fatal_oom_ranks
            or (
                v.culprit_rank not in fatal_oom_ranks
                and not _OOM_TEXT.search(str((v.details.get("exception") or {}).get("message", "")))
            )
        ]
    if state.hung:
        verdicts += diagnose_hang(state)
    verdicts += diagnose_replicas(state)
    verdicts += diagnose_straggler(state)
    verdicts += diagnose_internal_errors(state)
    verdicts += diagnose_restarts(state)
    if not verdicts:
        verdicts += diagnose_no_collectives(state)
    order = {kind: i for i, kind in enumerate(VERDICT_KINDS)}
    severity = {"error": 0, "warning": 1, "info": 2}
    verdicts.sort(key=lambda v: (severity.get(v.severity, 3), order.get(v.kind, 99)))
    return verdicts


def merge_verdicts(first: list[Verdict], rest: list[Verdict]) -> list[Verdict]:
    """Frozen hang verdicts first; a live verdict of the same kind and rank does not repeat them."""
    seen = {(v.kind, v.culprit_rank) for v in first}
    return list(first) + [
        v for v in rest if (v.kind, v.culprit_rank) not in seen and not (first and v.kind.startswith("hang."))
    ]


# -- helpers ----------------------------------------------------------------------------------


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def describe_exit(exit_info: dict[str, Any] | None) -> str:
    if not exit_info:
        return "ended"
    sig = exit_info.get("signal")
    if sig:
        return f"was killed by signal {sig} ({signal_name(int(sig))})"
    code = exit_info.get("code")
    if code is None and exit_info.get("unclean"):
        return "vanished without an exit record (killed hard: SIGKILL or the OOM killer?)"
    return f"exited with code {code}" if code is not None else "ended"


def roots_of(rank: RankState | None = None) -> CodeRoots:
    """Where libraries live for `rank` (as it reported them) and for this process."""
    mine = current_roots()
    return mine.merged(CodeRoots.from_dict(rank.code_roots)) if rank is not None else mine


def _exception_location(exc: dict[str, Any] | None, rank: RankState | None = None) -> str | None:
    """file:line of the innermost frame of the user's own code of an `exception` event.

    The rank picks its `caller` with its own install locations; an event without one (or whose
    caller is library code) is read from its traceback here."""
    if not exc:
        return None
    roots = roots_of(rank)
    nested = nested_traceback(str(exc.get("message", "")))
    origin = first_user_frame(nested.frames, roots) if nested else None
    if origin:  # the line that failed in a DataLoader worker, not the rank's `for batch in loader`
        return origin.split(" in ")[0].strip()
    caller = exc.get("caller")
    if isinstance(caller, str) and caller and roots.is_user(frame_path(caller)):
        return caller
    frames = [f for f in exc.get("traceback") or [] if isinstance(f, str)]
    chosen = first_user_frame(frames, roots) or (frames[-1] if frames else None)
    if chosen:
        return chosen.split(" in ")[0].strip()
    return str(caller) if caller else None


def _fault_of(rank: RankState, kinds: tuple[str, ...]) -> dict[str, Any] | None:
    for event in rank.faults[::-1]:
        spec = str(event.get("fault", ""))
        if spec.split(":", 1)[0] in kinds:
            return event
    return None


def _where(rank: RankState) -> tuple[str | None, str]:
    """Where a rank is now (file:line or None) and a phrase saying how we know."""
    if rank.stack and rank.stack.get("top_user_frame"):
        frame = rank.stack["top_user_frame"]
        func = rank.stack.get("top_user_function")
        return frame, f"its stack is at {frame}" + (f" in {func}()" if func else "")
    phase = rank.snapshot.phase
    done = rank.snapshot.last_done
    if done is not None and done.caller:
        text = f"its last completed collective was {done.op} #{done.seq} at {done.caller}"
        if phase:
            text += f", phase {phase!r}"
        return done.caller, text
    if phase:
        return None, f"it is in phase {phase!r}"
    return None, "no stack or collective record says where"


def _death_time(rank: RankState) -> float:
    """When the rank stopped: its uncaught exception or its exit, whichever came first (a rank can
    linger after its exception, in the process group's teardown), else its last snapshot."""
    known = [
        float(t)
        for t in ((rank.exit or {}).get("t"), (rank.exception or {}).get("t"))
        if isinstance(t, (int, float))
    ]
    if known:
        return min(known)
    last = rank.snapshot.t
    return last if last is not None else float("inf")


def rank_exit(rank: RankState, state: RunState) -> dict[str, Any] | None:
    """The best-known exit of a rank: its own record, else what the launcher reported."""
    exit_info = dict(rank.exit) if rank.exit else None
    for failure in state.launcher_failures:
        if failure.get("rank") == rank.rank and not rank.earlier_process(failure.get("pid")):
            code = failure.get("exitcode")
            merged = exit_info or {}
            # The launcher saw the real wait status; a rank's own exit event is written before it dies.
            if isinstance(code, int) and merged.get("source") != "wait status":
                merged.pop("signal", None)
                merged.pop("code", None)
                merged.pop("unclean", None)
                if code < 0:
                    merged["signal"] = -code
                else:
                    merged["code"] = code
                merged["source"] = "launcher"
            exit_info = merged
    return _unclean_marked(exit_info)


def _unclean_marked(exit_info: dict[str, Any] | None) -> dict[str, Any] | None:
    """`exit_info`, marked `unclean` when the process was seen gone, by no wait status (not
    sddoctor's child: an mp.spawn worker, a torchrun worker) and without an exit event of its own:
    it was killed hard (SIGKILL, the OOM killer)."""
    if (
        exit_info
        and exit_info.get("source") == "process watch"
        and exit_info.get("code") is None
        and not exit_info.get("signal")
        and exit_info.get("status") is None
    ):
        return {**exit_info, "unclean": True}
    return exit_info


def _raised(exc: dict[str, Any]) -> str:
    """'raised TYPE: the first line of its message' for an `exception` event."""
    first_line = (str(exc.get("message", "")).strip().splitlines() or [""])[0]
    return f"raised {exc.get('type', 'an exception')}: {first_line[:160]}"


def _ended_cleanly(rank: RankState, exit_info: dict[str, Any] | None) -> bool:
    """The rank's process ended by itself with status 0: no exception, signal or hard kill."""
    return rank.exception is None and not _abnormal(exit_info) and (exit_info or {}).get("code") == 0


def _abnormal(exit_info: dict[str, Any] | None) -> bool:
    if not exit_info:
        return False
    if exit_info.get("unclean"):
        return True  # gone without an exit record: killed hard (SIGKILL, the OOM killer)
    return bool(exit_info.get("signal")) or exit_info.get("code") not in (0, None)


# -- crash ------------------------------------------------------------------------------------


def diagnose_crash(state: RunState) -> list[Verdict]:
    """The rank that died first and why; the others that followed are named but not blamed."""
    candidates: list[tuple[RankState, dict[str, Any] | None]] = []
    for rank in state.ranks.values():
        exit_info = rank_exit(rank, state)
        if _abnormal(exit_info) or rank.exception is not None:
            if state.stopped_at is not None and _death_time(rank) >= state.stopped_at - 0.5:
                continue  # sddoctor stopped it (or it fell over while being stopped)
            candidates.append((rank, exit_info))
    if not candidates:
        job = state.job_exit
        if job and job.get("code") not in (0, None) and state.stopped_by_supervisor is None:
            return [_job_only_crash(state, job)]
        return []

    def blame_key(item: tuple[RankState, dict[str, Any] | None]) -> tuple[int, int, float]:
        rank, exit_info = item
        sig = (exit_info or {}).get("signal")
        message = str((rank.exception or {}).get("message", ""))
        victim = int(bool(sig and int(sig) in _STOP_SIGNALS)) + int(bool(_PEER_FAILURE.search(message)))
        root = (
            0
            if any(f.get("rank") == rank.rank and f.get("root_cause") for f in state.launcher_failures)
            else 1
        )
        return (victim, root if len(candidates) > 1 else 0, _death_time(rank))

    if (state.stopped_by_supervisor is not None or state.hang_declared_by is not None) and all(
        blame_key(c)[0] > 0 for c in candidates
    ):
        # Every death says a peer went away, and a supervisor stopped the job (this node's, or a
        # peer node's after a hang it diagnosed): consequences of that stop, not a crash.
        return []
    # Death time first: the earliest death is the cause unless it is clearly a victim.
    by_time = sorted(candidates, key=lambda item: _death_time(item[0]))
    first_time = _death_time(by_time[0][0])
    near = [c for c in candidates if _death_time(c[0]) - first_time <= 1.0]
    primary, exit_info = min(near, key=blame_key) if near else by_time[0]
    if blame_key((primary, exit_info))[0] > 0:
        # The earliest was a victim (e.g. it saw the connection drop); prefer a non-victim if any.
        non_victims = [c for c in candidates if blame_key(c)[0] == 0]
        if non_victims:
            primary, exit_info = min(non_victims, key=lambda c: _death_time(c[0]))
        else:
            early = _exited_early(state, primary)
            if early is not None:
                return [early]
    # The rank that died first may have given up waiting for another; monitored_barrier names the
    # ranks that did not arrive in the reporting rank's error even when another rank died first.
    reporters = [r for r, _ in candidates if _MONITORED_BARRIER_RANKS.search(str((r.exception or {}).get("message")))]
    for waiter in [primary, *sorted(reporters, key=_death_time)]:
        gave_up = _gave_up_waiting(state, waiter)
        if gave_up is not None:
            return [gave_up]
    others = sorted(r.rank for r, _ in candidates if r.rank != primary.rank)
    return [_crash_verdict(state, primary, exit_info, others)]


#: How long after the peer that lost it a rank's own exit record may come (it closes its connections
#: in destroy_process_group or at exit, and writes the record after).
EXIT_RECORD_LAG = 10.0


def _exited_early(state: RunState, victim: RankState) -> Verdict | None:
    """A rank that ended normally (exit code 0) before `victim` lost its peer, having issued fewer
    collectives: the victim's "connection closed by peer" is that rank leaving while it still
    expected it (uneven data per rank, a rank returning early). Under NCCL the same job hangs."""
    victim_t = _death_time(victim)
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
            and _ended_cleanly(rank, exit_info)
            # its exit event is written after it closed its connections, so it can trail the
            # victim's exception a little
            and _death_time(rank) <= victim_t + EXIT_RECORD_LAG
            and issued < seq
        ):
            gone.append((rank, issued, exit_info))
    if not gone:
        return None
    rank, issued, exit_info = min(gone, key=lambda item: _death_time(item[0]))
    done = rank.snapshot.last_done
    location = done.caller if done is not None and done.caller else None
    waiting = sorted(r.rank for r in state.ranks.values() if r.rank not in {g[0].rank for g in gone})
    summary = (
        f"rank {rank.rank} ended (exit code 0) after {issued} collective{'s' if issued != 1 else ''} "
        f"on group {pg} while rank{'s' if len(waiting) > 1 else ''} {_join(waiting)} went on to #{seq}"
        f"; {'they' if len(waiting) > 1 else 'it'} failed as a consequence (the peer closed its "
        "connection). The ranks ran different "
        "numbers of collectives: uneven data per rank (DistributedSampler(drop_last=True), or DDP's "
        "Join context for uneven inputs) or a rank that leaves its loop early"
    )
    message = str((victim.exception or {}).get("message", "")).strip()
    evidence = [
        f"rank {rank.rank} {describe_exit(exit_info)} after {issued} collectives on group {pg}"
        + (f"; its last was {done.op} #{done.seq} at {done.caller}" if done is not None else ""),
        f"rank {victim.rank} was in #{seq} and then raised: {message[:200]}",
    ]
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
            "consequences": waiting,
            "victim_exception": {"type": (victim.exception or {}).get("type"), "message": message},
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
        waited_until = _death_time(waiter)
        behind = [
            rank.rank
            for rank in state.ranks.values()
            if rank.rank != waiter.rank
            and (rank.snapshot.issued_on(pg) or 0) < seq
            and not _ended_cleanly(rank, rank_exit(rank, state))  # that is exited_early
            and _death_time(rank) >= waited_until - 1.0  # alive while the waiter waited
        ]
    else:
        behind = []
    if not behind:
        return None
    culprit = behind[0]
    rank = state.ranks.get(culprit)
    if rank is not None and not (rank.stack or {}).get("top_user_frame"):
        location, how = _where(rank)  # where it last was; its end came from the job's teardown
    else:
        location, how = _absent_rank_position(state, culprit, rank)
    snap = waiter.snapshot
    known = [c for c in (snap.failed, *snap.inflight, snap.last_done) if c is not None]
    waited = next((c for c in known if c.seq == seq and str(c.pg) == str(pg)), None)
    call = f"#{seq} on group {pg}" if seq is not None else "the collective"
    if waited is not None:
        call = f"{waited.op} #{seq} on group {pg}" + (f" (called at {waited.caller})" if waited.caller else "")
    first_line = (message.strip().splitlines() or [""])[0][:200]
    timeout = "monitored_barrier's timeout" if named else "the process group's timeout"
    summary = (
        f"hang: rank {_join(behind)} never reached {call}; {how}. Rank {waiter.rank} gave up waiting "
        f"there when {timeout} expired ({first_line}) and the job ended"
    )
    if not named:
        summary += "; a process-group timeout above --hang-timeout lets sddoctor take every rank's stack first"
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
        if not str(pg).endswith(":p2p"):
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
    after = _death_time(rank) - float(asked_at)  # inf when the death time is unknown
    return after if 0 <= after <= DUMP_CRASH_WINDOW else None


def _crash_verdict(
    state: RunState, rank: RankState, exit_info: dict[str, Any] | None, others: list[int]
) -> Verdict:
    exc = rank.exception
    fault = _fault_of(rank, ("kill", "raise"))
    exit_call = (exit_info or {}).get("caller") if not exc else None  # sys.exit(failure) in user code
    fatal_frame = _fatal_frame(rank)  # where a fatal signal (SIGSEGV, SIGABRT) struck
    location = (
        _exception_location(exc, rank) or (fault or {}).get("caller") or exit_call or fatal_frame or _where(rank)[0]
    )
    step = rank.snapshot.step
    how = describe_exit(exit_info) if exit_info else "raised an exception"
    nested = nested_traceback(str((exc or {}).get("message", "")))
    if exc and not (exit_info or {}).get("signal"):
        how = _raised(exc)
        if nested and nested.exception:
            how = f"raised {nested.exception[:160]}" + (f" in its {nested.source}" if nested.source else "")
    summary = f"rank {rank.rank} died first: it {how}" if len(state.ranks) > 1 else f"rank {rank.rank} {how}"
    if location:
        summary += f" at {location}"
    if others:
        summary += f"; rank{'s' if len(others) > 1 else ''} {_join(others)} stopped as a consequence"
    evidence = _crash_evidence(state, rank, exit_info, fault, fatal_frame)
    traceback = exc.get("traceback") if exc else None
    if not traceback and len(state.ranks) <= 1:
        traceback = last_traceback(state.stderr_tail)
    details: dict[str, Any] = {
        "rank": rank.rank,
        "exit": exit_info,
        "step": step,
        "traceback": traceback,
        "consequences": others,
        "died_at": _death_time(rank) if _death_time(rank) != float("inf") else None,
    }
    if exc:
        details["exception"] = {"type": exc.get("type"), "message": exc.get("message")}
    if rank.fatal:
        details["fatal"] = rank.fatal
    if nested:
        details["origin"] = {
            "source": nested.source,
            "exception": nested.exception,
            "traceback": list(nested.frames),
        }
    severity = "error"
    after_dump = _after_dump(state, rank, exit_info)
    if after_dump is not None:
        # The hang verdict already names the cause; this death came from looking at it.
        severity = "warning"
        details["after_flight_recorder_dump_s"] = round(after_dump, 1)
        summary += (
            f" ({after_dump:.0f} s after sddoctor asked the ranks for their NCCL flight-recorder dumps "
            "on the hang: likely a crash of the dump itself, not a cause of the hang)"
        )
        evidence.append(
            "ProcessGroupNCCL has been seen to crash a rank a few seconds after a flight-recorder dump "
            "(torch 2.11); run with --on-hang kill to stop the job right after the diagnosis"
        )
    return Verdict(
        kind="crash",
        severity=severity,
        summary=summary,
        culprit_rank=rank.rank,
        location=location,
        details=details,
        evidence=evidence,
    )


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
        evidence.append(f"rank {rank.rank} {describe_exit(exit_info)} (source: {exit_info.get('source', '?')})")
    exc = rank.exception
    if exc:
        evidence.append(f"exception event of rank {rank.rank}: {exc.get('type')}: {exc.get('message')}")
    if fault:
        evidence.append(f"injected fault {fault.get('fault')!r} fired on rank {rank.rank} at {fault.get('caller')}")
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


def _fatal_frame(rank: RankState) -> str | None:
    """file:line of the user's innermost frame in the rank's fatal-signal dump (else its innermost)."""
    frames = [f for f in (rank.fatal or {}).get("frames") or [] if isinstance(f, str)]
    chosen = first_user_frame(frames, roots_of(rank), innermost_first=True) or (frames[0] if frames else None)
    return chosen.split(" in ")[0].strip() if chosen else None


def _job_only_crash(state: RunState, job: dict[str, Any]) -> Verdict:
    code = job.get("code")
    traceback = last_traceback(state.stderr_tail)
    location = None
    frames = [f for f in traceback or [] if " in " in f]
    if frames:
        location = (first_user_frame(frames, roots_of()) or frames[-1]).split(" in ")[0]
    rank = 0 if len(state.ranks) == 1 and state.world_size in (None, 1) else None
    how = f"exited with code {code}"
    if isinstance(code, int) and code < 0:
        how = f"was killed by signal {-code} ({signal_name(-code)})"
    return Verdict(
        kind="crash",
        severity="error",
        summary=f"the job {how}" + (f" at {location}" if location else ""),
        culprit_rank=rank,
        location=location,
        details={"exit": job, "traceback": traceback},
        evidence=["no rank telemetry says more; the launcher's stderr is in the report"],
    )


_TB_LINE = re.compile(r'^\s*File "([^"]+)", line (\d+), in (.+)$')


def last_traceback(lines: list[str]) -> list[str] | None:
    """The last Python traceback in some stderr lines, as ["file:line in func", ..., "Type: message"]."""
    start = None
    for i, line in enumerate(lines):
        if (
            line.startswith("Traceback (most recent call last)")
            or "Traceback (most recent call last)" in line
        ):
            start = i
    if start is None:
        return None
    frames: list[str] = []
    for line in lines[start + 1 :]:
        m = _TB_LINE.match(line)
        if m:
            frames.append(f"{m.group(1)}:{m.group(2)} in {m.group(3)}")
        elif line and not line.startswith(" ") and frames:
            frames.append(line.strip())
            break
    return frames or None


def diagnose_crash_mismatch(state: RunState) -> Verdict | None:
    """A collective mismatch that made the backend abort (gloo does, NCCL may hang instead)."""
    text = "\n".join(state.stderr_tail)
    messages = [str((r.exception or {}).get("message", "")) for r in state.ranks.values()]
    if not (_MISMATCH_TEXT.search(text) or any(_MISMATCH_TEXT.search(m) for m in messages)):
        return None
    verdict = _mismatch_from_sightings(state)
    if verdict is None:
        verdict = Verdict(
            kind="hang.mismatch",
            severity="error",
            summary="ranks disagree on a collective (the backend reported a size mismatch and aborted)",
        )
    verdict.details["ended"] = "crash"
    verdict.evidence.append("the backend aborted: " + _first_match(_MISMATCH_TEXT, [text, *messages]))
    return verdict


def _first_match(pattern: re.Pattern[str], texts: list[str]) -> str:
    for text in texts:
        for line in text.splitlines():
            if pattern.search(line):
                return line.strip()[:300]
    return ""


# -- OOM --------------------------------------------------------------------------------------


def _gib(value: Any) -> str:
    return f"{value / 2**30:.2f} GiB" if isinstance(value, (int, float)) else "?"


def diagnose_oom(state: RunState) -> list[Verdict]:
    verdicts: list[Verdict] = []
    for rank in sorted(state.ranks.values(), key=lambda r: r.rank):
        for oom in rank.ooms:
            t = oom.get("t", 0.0)
            fallback = next(
                (
                    f
                    for r in state.ranks.values()
                    for f in r.fallbacks
                    if f.get("t", 0.0) >= t - 1.0
                    and (f.get("step") in (None, oom.get("step")) or r.rank == rank.rank)
                ),
                None,
            )
            if fallback is None and not rank.exited and state.job_exit is None and state.now - t < 10.0:
                continue  # the fallback may still be on its way: decide once it came or the rank died
            phase = oom.get("phase", "?")
            if oom.get("mem_alloc") is None and oom.get("mem_total") is None:
                mem = "no device memory figures: not on a CUDA device"
            else:
                mem = (
                    f"allocated {_gib(oom.get('mem_alloc'))}, reserved {_gib(oom.get('mem_reserved'))}"
                    f" of {_gib(oom.get('mem_total'))}"
                )
            details: dict[str, Any] = {
                k: oom.get(k) for k in ("step", "phase", "micro_batch", "grad_accum") if k in oom
            }
            details.update(
                mem_alloc=oom.get("mem_alloc"),
                mem_reserved=oom.get("mem_reserved"),
                mem_total=oom.get("mem_total"),
            )
            evidence = [f"oom event of rank {rank.rank}: {str(oom.get('message', ''))[:200]}"]
            if fallback is not None:
                details["fallback"] = {k: v for k, v in fallback.items() if k not in ("v", "kind")}
                summary = (
                    f"rank {rank.rank} ran out of memory in {phase} at step {oom.get('step')} ({mem}); "
                    f"the trainer's fallback recovered: micro-batch {fallback.get('old_micro_batch')}"
                    f" -> {fallback.get('new_micro_batch')}, grad_accum {fallback.get('old_grad_accum')}"
                    f" -> {fallback.get('new_grad_accum')}"
                )
                verdicts.append(
                    Verdict("oom.recovered", "info", summary, rank.rank, oom.get("caller"), details, evidence)
                )
            else:
                summary = f"rank {rank.rank} ran out of memory in {phase} at step {oom.get('step')} ({mem})"
                if rank.exception:
                    details["exception"] = {k: rank.exception.get(k) for k in ("type", "message")}
                    details["traceback"] = rank.exception.get("traceback")
                    summary += f"; it stopped with {rank.exception.get('type')}"
                location = oom.get("caller") or _exception_location(rank.exception, rank)
                verdicts.append(Verdict("oom", "error", summary, rank.rank, location, details, evidence))
        exc = rank.exception
        any_oom_event = any(r.ooms for r in state.ranks.values())
        if not any_oom_event and exc and _OOM_TEXT.search(f"{exc.get('type')} {exc.get('message')}"):
            verdicts.append(
                Verdict(
                    "oom",
                    "error",
                    f"rank {rank.rank} died of out-of-memory: {str(exc.get('message'))[:160]}",
                    rank.rank,
                    _exception_location(exc, rank),
                    {
                        "step": rank.snapshot.step,
                        "phase": rank.snapshot.phase,
                        "traceback": exc.get("traceback"),
                    },
                    [f"exception event of rank {rank.rank}: {exc.get('type')}"],
                )
            )
    return verdicts


# -- hang -------------------------------------------------------------------------------------


def _position(rank: RankState) -> str:
    if rank.exited:
        return f"rank {rank.rank}: {describe_exit(rank.exit)}"
    c = blocked_call(rank)
    if c is not None:
        peer = f", peer rank {c.peer}" if c.peer is not None else ""
        return f"rank {rank.rank}: inside {c.op} #{c.seq} (pg {c.pg}{peer}, shapes {c.shapes}) called at {c.caller}"
    return f"rank {rank.rank}: not in a collective; {_where(rank)[1]}"


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
    return any(_DATALOADER_FRAME.search(str(f)) for f in frames)


def diagnose_hang(state: RunState) -> list[Verdict]:
    """Classify a hang by where every rank is: who is missing, who disagrees, or all waiting.

    Ranks are compared per process group, among the group's members: a rank inside another
    group's collective is not out of step on this one. Point-to-point calls are judged by who
    waits for whom (their numbers count per pair of ranks, not across the group)."""
    stalled = round(state.stalled_for, 1)
    expected = _expected_ranks(state)
    calls = _blocked_calls(state)
    evidence = [
        _position(state.ranks[r]) if r in state.ranks else f"rank {r}: never reported" for r in expected
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
            _mismatch_verdict(state, main.pg, main.seq, main.waiters, main.out_of_step, calls, details, evidence)
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
    return [Verdict("hang.comm", "error", summary, None, main.call.caller, details, evidence)]


def _blocked_calls(state: RunState) -> dict[int, Collective]:
    """The call each live rank is blocked in (see `callhistory.blocked_call`)."""
    calls: dict[int, Collective] = {}
    for one in state.ranks.values():
        call = None if one.exited else blocked_call(one)
        if call is not None:
            calls[one.rank] = call
    return calls


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
        return f"{self.call.op} #{self.seq} on pg {self.pg} (called at {self.call.caller})"

    def details(self) -> dict[str, Any]:
        details: dict[str, Any] = {"pg": self.pg, "seq": self.seq, "op": self.call.op}
        details["waiting_ranks"] = sorted(self.waiters)
        return details

    def disagrees(self, calls: dict[int, Collective]) -> bool:
        if is_p2p(self.call):
            return False  # a send and its recv differ by nature; p2p numbers count per pair
        signatures = {f"{calls[r].op} {calls[r].shapes}" for r in self.waiters}
        return len(signatures) > 1 or bool(self.out_of_step)


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
        if any(r not in calls or is_p2p(calls[r]) for r in wait.behind):
            return wait
    for wait in waits:
        if any(_departure(state, r, calls) is not None for r in wait.behind):
            return wait
    return waits[0]


def _departure(state: RunState, r: int, calls: dict[int, Collective]) -> Departure | None:
    rank = state.ranks.get(r)
    return left_routine(rank, calls[r]) if rank is not None and r in calls else None


def _explains(state: RunState, wait: _GroupWait, calls: dict[int, Collective]) -> bool:
    """Whether a rank missing from `wait` is the cause: it is not blocked in another collective
    (it computes, loads data, waits in a p2p call or exited), or it left its routine to get there."""
    return any(
        r not in calls or is_p2p(calls[r]) or _departure(state, r, calls) is not None for r in wait.behind
    )


def _call_text(call: Collective) -> str:
    """"recv from rank 1 #4 on pg 0:p2p (called at file:line)"."""
    peer = ""
    if call.peer is not None:
        peer = f" {'to' if call.op in ('send', 'isend') else 'from'} rank {call.peer}"
    return f"{call.op}{peer} #{call.seq} on pg {call.pg} (called at {call.caller})"


def _departure_text(r: int, departure: Departure) -> str:
    text = f"rank {r} called {site_text(departure.current)} right after {site_text(departure.previous)}"
    if departure.usual is not None:
        return text + f"; every earlier time it called {site_text(departure.usual)} next: it skipped that call"
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
        location, how = _absent_rank_position(state, peer, rank)
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
        summary += f". Rank {_join(waiting)} wait{'s' if len(waiting) == 1 else ''} on them"
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
        f"rank {_join(w.waiters)} in {w.where()}, which rank {_join(w.behind)} never reached" for w in crossed
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
        location, how = _where(state.ranks[loaders[0]])
        return Verdict(
            "hang.dataloader",
            "error",
            f"no progress for {stalled:.0f} s: rank {_join(loaders)} stuck loading data; {how}",
            loaders[0],
            location,
            {**base, "ranks": loaders},
            evidence,
        )
    return Verdict(
        "hang.unknown",
        "error",
        f"no progress for {stalled:.0f} s and no rank is inside a collective; see each rank's stack",
        None,
        None,
        base,
        evidence,
    )


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
    location, how = _where(state.ranks[culprit])
    inside = culprit in calls
    if inside:
        location = location if state.ranks[culprit].stack else calls[culprit].caller
    summary = (
        f"hang: rank {_join(frozen)} stopped responding (heartbeat {max(ages.values()):.0f} s old) "
        + (f"inside {calls[culprit].op} #{calls[culprit].seq}" if inside else f"({how})")
        + f": its process is frozen (stopped, traced, or stuck in native code); "
        f"rank{'s' if len(others) > 1 else ''} {_join(others)} wait{'' if len(others) > 1 else 's'} "
        f"in {where_call}"
    )
    details.update(frozen_ranks=frozen, heartbeat_age=ages)
    kind = "hang.comm" if inside else "hang.missing_rank"
    return Verdict(kind, "error", summary, culprit, location, details, evidence)


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
    elsewhere = [r for r in culprits if r in calls and not is_p2p(calls[r])]
    skipped = [r for r in elsewhere if _departure(state, r, calls) is not None]
    free = [r for r in culprits if r not in elsewhere]
    culprit_rank = _pick_culprit(state, skipped or free or culprits, ("skip",))
    rank = state.ranks.get(culprit_rank) if culprit_rank is not None else None
    location, how = _absent_rank_position(state, culprit_rank, rank)
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
    fault = _fault_of(rank, ("skip",)) if rank else None
    if fault:
        evidence.append(
            f"injected fault {fault.get('fault')!r} fired on rank {culprit_rank} at {fault.get('caller')}"
        )
    kind = "hang.dataloader" if loaders else "hang.missing_rank"
    stuck = " is stuck in its DataLoader and" if loaders else ""
    waiters = wait.waiters
    summary = (
        f"hang: rank {culprit_rank}{stuck} never reached {wait.where()}; {how}. "
        f"Rank{'s' if len(waiters) > 1 else ''} {_join(sorted(waiters))} "
        f"wait{'' if len(waiters) > 1 else 's'} there for {stalled:.0f} s"
    )
    if wait.members != _expected_ranks(state):
        details["group_members"] = wait.members
    issued = rank.snapshot.issued_on(wait.pg) if rank else None
    details.update(missing_ranks=culprits, culprit_issued=issued)
    return Verdict(kind, "error", summary, culprit_rank, location, details, evidence)


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


def _absent_rank_position(
    state: RunState, culprit_rank: int | None, rank: RankState | None
) -> tuple[str | None, str]:
    """Where the rank that never reached the collective is (a code location) and how it got there."""
    if rank is None:
        return _never_joined(state, culprit_rank) if culprit_rank is not None else (None, "")
    if rank.exited:
        fault = _fault_of(rank, ("skip",))
        location: str | None = (
            (fault or {}).get("caller") or _exception_location(rank.exception, rank) or _where(rank)[0]
        )
        exit_info = rank_exit(rank, state)
        how = f"it {describe_exit(exit_info)}"
        if not fault and _ended_cleanly(rank, exit_info):
            how += (
                ", having run fewer collectives than the others: uneven data per rank "
                "(DistributedSampler(drop_last=True), or DDP's Join context) or a rank that leaves its loop early"
            )
        return location, how
    location, how = _where(rank)
    fault = _fault_of(rank, ("skip",))
    if fault and not (rank.stack or {}).get("top_user_frame"):
        location = fault.get("caller") or location
    return location, how


def _startup_hang(
    state: RunState, expected: list[int], base: dict[str, Any], evidence: list[str]
) -> Verdict | None:
    """No rank is in a traced collective and some rank never got past its start-up: name the ranks
    that are not waiting for their peers (in init_process_group or DDP's construction)."""
    starting = [
        r
        for r in expected
        if r not in state.ranks or not (state.ranks[r].snapshot.started_work or state.ranks[r].exited)
    ]
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
    if waiters:
        what = sorted({str(m.get("what")) for m in waiters.values()})
        caller = next((m.get("caller") for m in waiters.values() if m.get("caller")), None)
        wait_text = (
            f"rank{'s' if len(waiters) > 1 else ''} {_join(sorted(waiters))} wait{'' if len(waiters) > 1 else 's'} "
            f"in {' / '.join(what)}" + (f" (called at {caller})" if caller else "")
        )
    if stuck and not waiters and len(stuck) > 1:
        # Nobody waits for anybody: every rank is still in its own set-up (imports, loading).
        places = [
            f"rank {r}: {_where(state.ranks[r])[1] if r in state.ranks else _never_joined(state, r)[1]}"
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
            location, how = _where(rank)
        else:
            location, how = _never_joined(state, culprit) if culprit is not None else (None, "")
        summary = f"hang at start-up ({elapsed:.0f} s): rank {_join(stuck)} never got to its first collective; {how}"
        if waiters:
            summary += f". {wait_text[0].upper()}{wait_text[1:]}"
        return Verdict("hang.startup", "error", summary, culprit, location, details, evidence)
    # Every rank that has not started waits for its peers: the rendezvous itself cannot complete.
    summary = (
        f"hang at start-up ({elapsed:.0f} s): {wait_text} and no rank is elsewhere: the ranks cannot meet "
        "(check MASTER_ADDR/MASTER_PORT or the rendezvous endpoint, a firewall, the world size, a node "
        "that never started); run `sddoctor check-nccl`"
    )
    return Verdict("hang.startup", "error", summary, None, caller, details, evidence)


def _frozen_ranks(state: RunState, ranks: list[int], stale: float = 5.0) -> list[int]:
    """Ranks whose heartbeat thread stopped ticking while their peers' still tick."""
    out = []
    for r in ranks:
        if state.ranks[r].remote:
            continue  # another host's clock: a skew would look like a stale heartbeat
        beat = state.ranks[r].snapshot.heartbeat
        if beat is not None and state.now - beat > stale:
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
    never call where their calls parted, else the rank whose shapes changed at a call site."""
    involved = sorted(set(waiters) | set(out_of_step))
    groups: dict[str, list[int]] = {}
    for r in involved:
        c = calls[r]
        groups.setdefault(f"{c.op} #{c.seq} shapes {c.shapes}", []).append(r)
    minority = min(groups.values(), key=len) if len(groups) > 1 else []
    parted = parted_sites(state, pg, involved, calls)
    odd = sorted(parted.odd) if parted is not None and len(parted.odd) < len(parted.sites) else []
    if minority and len(minority) < len(involved) / 2:
        suspects = minority
    else:
        suspects = odd or [r for r in involved if _shape_changed(state, r, calls[r])]
    culprit = _pick_culprit(state, suspects or involved, ("shape", "skip"), require_evidence=not suspects)
    parts = [
        f"rank {r}: {calls[r].op} #{calls[r].seq} shapes {calls[r].shapes} at {calls[r].caller}" for r in involved
    ]
    summary = f"hang: ranks disagree on collective #{seq} (pg {pg}): " + "; ".join(parts)
    location = calls[culprit].caller if culprit is not None and culprit in calls else None
    if parted is not None:
        summary += f". {_parted_text(parted)}"
        if culprit in parted.odd:
            location = parted.sites[culprit][1] or location
        details["parted_at"] = {
            "seq": parted.seq,
            "sites": {str(r): {"op": op, "caller": caller} for r, (op, caller) in parted.sites.items()},
            "odd_ranks": sorted(parted.odd),
        }
    details.update(calls={str(r): calls[r].to_dict() for r in involved}, out_of_step_ranks=out_of_step)
    fault = _fault_of(state.ranks[culprit], ("shape", "skip")) if culprit in state.ranks else None
    if fault:
        evidence.append(
            f"injected fault {fault.get('fault')!r} fired on rank {culprit} at {fault.get('caller')}"
        )
        location = location or fault.get("caller")
    return Verdict("hang.mismatch", "error", summary, culprit, location, details, evidence)


def _parted_text(parted: PartedSites) -> str:
    """Where the ranks' calls parted, naming every rank's call site there."""
    said = []
    for r, site in sorted(parted.sites.items()):
        never = parted.odd.get(r)
        tail = f", which rank {_join(never)} never call{'s' if len(never) == 1 else ''}" if never else ""
        said.append(f"rank {r} called {site_text(site)}{tail}")
    text = f"The ranks' calls parted at #{parted.seq}: " + "; ".join(said)
    if parted.odd:
        return text + (
            ". A collective that only some ranks reach (under `if rank == 0`, `is_main_process` or "
            "`is_global_zero`, or a callback run on one rank) must be called by every rank"
        )
    return text + ": every rank calls these sites, in a different order"


def _shape_changed(state: RunState, rank_id: int, call: Collective) -> bool:
    """True when this rank called the same site before with other shapes (it is the odd one)."""
    rank = state.ranks.get(rank_id)
    if rank is None:
        return False
    for sightings in rank.arrivals.values():
        for arrival in sightings.values():
            if arrival.caller == call.caller and arrival.shapes not in (None, call.shapes):
                return True
    return False


def _mismatch_from_sightings(state: RunState) -> Verdict | None:
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
        if len(calls) < 2:
            continue
        if len({f"{c.op} {c.shapes}" for c in calls.values()}) > 1:
            return _mismatch_verdict(state, pg, seq, sorted(calls), [], calls, {"pg": pg, "seq": seq}, [])
    routine = _routine_broken(state)
    if routine is not None:
        return routine
    # No two sightings of the same seq: fall back on an injected shape fault, if one fired.
    for rank in state.ranks.values():
        fault = _fault_of(rank, ("shape",))
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


def _routine_broken(state: RunState) -> Verdict | None:
    """The one rank whose last recorded call broke its own routine (see `left_routine`), when no two
    ranks' records of the same call can be compared (the aborted rank died before writing them)."""
    broken = []
    for rank in sorted(state.ranks.values(), key=lambda r: r.rank):
        sightings = [(a.enqueue, pg, seq, a) for pg, by_seq in rank.arrivals.items() for seq, a in by_seq.items()]
        if not sightings:
            continue
        _, pg, seq, last = max(sightings, key=lambda s: s[0])
        call = Collective(pg=pg, seq=seq, op=last.op, shapes=last.shapes, caller=last.caller, since=last.enqueue)
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
    state: RunState, suspects: list[int], fault_kinds: tuple[str, ...], require_evidence: bool = False
) -> int | None:
    """One rank among suspects: the one an injected fault fired on, else the lowest (or None)."""
    for r in suspects:
        if r in state.ranks and _fault_of(state.ranks[r], fault_kinds):
            return r
    if require_evidence and len(suspects) > 1:
        return None
    return min(suspects) if suspects else None


# -- replicas ---------------------------------------------------------------------------------


def diagnose_replicas(state: RunState) -> list[Verdict]:
    """DDP replicas that no longer hold the same weights: the trainer's `replicas` digests differ
    at one step, or a rank reported `replicas_differ`. Training silently diverged."""
    by_step: dict[int, dict[int, str]] = {}
    for rank in state.ranks.values():
        for ev in rank.replicas:
            if isinstance(ev.get("step"), int) and isinstance(ev.get("params_sha256"), str):
                by_step.setdefault(ev["step"], {})[rank.rank] = ev["params_sha256"]
    warned = [
        (r.rank, w) for r in state.ranks.values() for w in r.warnings if w.get("code") == "replicas_differ"
    ]
    differing = {step: d for step, d in by_step.items() if len(set(d.values())) > 1}
    if not differing and not warned:
        return []
    culprit: int | None = None
    evidence: list[str] = []
    details: dict[str, Any] = {}
    if differing:
        step = max(differing)
        digests = differing[step]
        groups: dict[str, list[int]] = {}
        for r, digest in sorted(digests.items()):
            groups.setdefault(digest, []).append(r)
        # With three or more ranks a lone rank against an agreeing majority is the odd one out.
        sizes = sorted(len(g) for g in groups.values())
        if len(groups) == 2 and sizes == [1, max(sizes)] and max(sizes) > 1:
            culprit = min(groups.values(), key=len)[0]
        details = {"step": step, "digests": {str(r): d for r, d in sorted(digests.items())}}
        evidence += [f"ranks {_join(g)}: params_sha256 {d[:16]}..." for d, g in groups.items()]
        summary = f"the ranks' weights differ after step {step}: the DDP replicas diverged"
    else:
        rank_id, w = warned[0]
        summary = f"rank {rank_id} reports that the ranks' weights differ: the DDP replicas diverged"
        details = {"message": w.get("message")}
    evidence += [f"rank {r}: warning replicas_differ: {w.get('message')}" for r, w in warned[:2]]
    evidence.append(
        "DDP keeps replicas equal only if every rank starts from the same weights and applies the same "
        "averaged gradients: look for rank-dependent code touching parameters (init without a shared seed, "
        "a rank-conditional update, a buffer updated outside forward) or a broken interconnect "
        "(sddoctor check-nccl checks the result of its all-reduce)"
    )
    return [Verdict("replicas.differ", "error", summary, culprit, None, details, evidence)]


# -- sddoctor itself and what it could not see ----------------------------------------------------


def diagnose_restarts(state: RunState) -> list[Verdict]:
    """The launcher restarted workers (torchrun --max-restarts): the first failure that made it,
    from the ranks' earlier processes. What the current processes did is judged as usual."""
    failures = []
    for rank in state.ranks.values():
        for number, attempt in enumerate(rank.attempts, start=1):
            exc, exit_info = attempt.get("exception"), _unclean_marked(attempt.get("exit"))
            if exc is None and not _abnormal(exit_info):
                continue
            times = [t for t in ((exc or {}).get("t"), (exit_info or {}).get("t")) if isinstance(t, (int, float))]
            sig = (exit_info or {}).get("signal")
            # as for a crash: a rank that lost its peer ("connection closed", torchrun's SIGTERM) is
            # not the failure that made the launcher restart when another rank of that attempt failed
            victim = bool(sig and int(sig) in _STOP_SIGNALS) or bool(
                _PEER_FAILURE.search(str((exc or {}).get("message", "")))
            )
            failures.append((number, victim, min(times) if times else float("inf"), rank, attempt))
    if not failures:
        return []
    number, _, _, rank, attempt = min(failures, key=lambda f: (f[0], f[1], f[2], f[3].rank))
    exc = attempt.get("exception")
    how = _raised(exc) if exc else describe_exit(_unclean_marked(attempt.get("exit")))
    location = _exception_location(exc, rank)
    restarted = sorted(r.rank for r in state.ranks.values() if r.attempts)
    summary = (
        f"the launcher restarted the workers: on attempt {number} rank {rank.rank} {how}"
        + (f" at {location}" if location else "")
        + (f" (step {attempt['step']})" if attempt.get("step") is not None else "")
        + f"; rank{'s' if len(restarted) > 1 else ''} {_join(restarted)} then ran in new processes"
    )
    evidence = [
        f"rank {r.rank}: earlier process{'es' if len(r.attempts) > 1 else ''} "
        + ", ".join(f"pid {a.get('pid')} ({describe_exit(_unclean_marked(a.get('exit')))})" for a in r.attempts)
        + f"; now pid {r.pid}"
        for r in sorted(state.ranks.values(), key=lambda r: r.rank)
        if r.attempts
    ]
    details = {"attempt": number, "rank": rank.rank, "restarted_ranks": restarted, "exit": attempt.get("exit")}
    if exc:
        details["exception"] = {"type": exc.get("type"), "message": exc.get("message")}
        details["traceback"] = exc.get("traceback")
    return [Verdict("restarted", "warning", summary, rank.rank, location, details, evidence)]


def diagnose_internal_errors(state: RunState) -> list[Verdict]:
    """sddoctor's own code failed inside a rank (recorded, the job went on): never the user's fault."""
    errors = [
        (r.rank, e) for r in sorted(state.ranks.values(), key=lambda r: r.rank) for e in r.internal_errors
    ]
    if not errors:
        return []
    sites = sorted({str(e.get("where")) for _, e in errors})
    rank, first = errors[0]
    summary = (
        f"sddoctor's own instrumentation failed in {', '.join(sites)} (rank {rank}: {first.get('type')}: "
        f"{str(first.get('message', ''))[:160]}); your job was not affected, but what sddoctor saw of it may be "
        "incomplete. This is a bug in sddoctor: please report it with report.json"
    )
    evidence = [
        f"rank {r}: internal error in {e.get('where')}: {e.get('type')}: {str(e.get('message', ''))[:200]}"
        for r, e in errors[:8]
    ]
    details = {
        "errors": [
            {"rank": r, **{k: e.get(k) for k in ("where", "type", "message", "traceback")}}
            for r, e in errors[:8]
        ]
    }
    return [Verdict("sddoctor.internal_error", "warning", summary, None, None, details, evidence)]


def diagnose_no_collectives(state: RunState) -> list[Verdict]:
    """A finished job in which no process joined a process group, or no collective was ever issued:
    there was nothing to check for hangs, stragglers or mismatches, which is not the same as "ok"."""
    if state.job_exit is None or state.stopped_by_supervisor == "hang":
        return []
    if not state.ranks:
        summary = (
            "no process of the job joined a torch.distributed process group: sddoctor saw no ranks, no "
            "collectives and no steps, so hangs, stragglers and mismatches could not be checked"
        )
        return [Verdict("no_collectives", "info", summary, None, None, {"ranks": 0}, [])]
    issued = any(r.snapshot.issued or r.snapshot.ddp_buckets for r in state.ranks.values())
    if issued or any(r.step_count for r in state.ranks.values()):
        return []
    summary = (
        f"{len(state.ranks)} rank{'s' if len(state.ranks) > 1 else ''} joined a process group but issued no "
        "collective and finished no step: there was nothing to check for hangs, stragglers or mismatches"
    )
    return [Verdict("no_collectives", "info", summary, None, None, {"ranks": len(state.ranks)}, [])]


def _join(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
