"""What the diagnosis reads off a rank, whatever the trouble: how it ended (exit, signal, exception),
where (the innermost frame of the user's code), and the messages that mark a rank as a victim of
another's failure. Pure functions of `RankState` / `RunState`, as the whole diagnosis."""

from __future__ import annotations

import re
import signal
from collections.abc import Hashable, Mapping
from typing import Any

from sddoctor.codepaths import CodeRoots, current_roots, first_user_frame, frame_path
from sddoctor.instrument.faults import FaultSpecError, parse_faults
from sddoctor.supervise.comm_errors import KnownError, known_error, known_exception_type
from sddoctor.supervise.nested_traceback import nested_traceback
from sddoctor.supervise.state import RankState, RunState, Verdict
from sddoctor.telemetry.snapshot import DEFAULT_GROUP

#: Messages a rank raises when a *peer* went away: such a rank is a victim, not the cause.
PEER_FAILURE = re.compile(
    r"connection (reset|closed|refused)|broken pipe|peer|socket timeout|timed out|"
    r"communicator was aborted|nccl.*abort|remote process exited|heartbeat|watchdog|"
    r"check rank \d+ logs for faulty rank",
    re.IGNORECASE,
)


#: Signals a launcher (or sddoctor) sends to stop the survivors after a failure.
STOP_SIGNALS = {int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGHUP)}


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


def handled_error(exit_info: dict[str, Any] | None, rank: RankState) -> dict[str, Any] | None:
    """The error a rank's program caught and reported before it ended with code 0 (its `exit`
    event's `handled_error`: a printed traceback, logger.exception, sys.exit(0) inside `except`),
    when it came after the rank's last completed collective (`caught_after_last_call`)."""
    return caught_after_last_call((exit_info or {}).get("handled_error"), rank)


def caught_after_last_call(found: Any, rank: RankState) -> dict[str, Any] | None:
    """`found`, a caught error's record (an exit event's or the rank's snapshot's), when it came after
    the rank's last completed collective: one caught earlier, after which the rank went on, is not
    why it left the common path."""
    if not isinstance(found, Mapping) or not found.get("type"):
        return None
    done = rank.snapshot.last_done
    t = found.get("t")
    if done is not None and done.t is not None and isinstance(t, (int, float)) and t < done.t:
        return None
    return dict(found)


def handled_error_evidence(rank: int, found: dict[str, Any]) -> str:
    """The evidence line of a caught error: "rank 1: ValueError: bad caption at train.py:35"."""
    return f"rank {rank}: {found['type']}: {str(found.get('message'))[:300]} at {found.get('caller')}"


def handled_error_text(found: dict[str, Any]) -> str:
    """ "caught ValueError: bad caption (raised at train.py:35) and reported it" """
    message = " ".join(str(found.get("message") or "").split())[:200]
    where = f" (raised at {found['caller']})" if found.get("caller") else ""
    return f"caught {found['type']}{': ' + message if message else ''}{where} and reported it"


def roots_of(rank: RankState | None = None) -> CodeRoots:
    """Where libraries live for `rank` (as it reported them) and for this process."""
    mine = current_roots()
    return mine.merged(CodeRoots.from_dict(rank.code_roots)) if rank is not None else mine


def locate_spawned_culprits(verdicts: list[Verdict], state: RunState) -> None:
    """Point a verdict at the user's line that started its culprit when the culprit's own stack
    and traceback hold none of the user's code: a library that spawns its workers and runs the
    whole loop from its worker function (Lightning's ddp_spawn) leaves `trainer.fit(...)` in the
    parent only, and the innermost frame is a library's (or sddoctor's, where a fault fired)."""
    for verdict in verdicts:
        rank = state.ranks.get(verdict.culprit_rank) if verdict.culprit_rank is not None else None
        if rank is None or not rank.spawned_at:
            continue
        if verdict.location and roots_of(rank).is_user(frame_path(verdict.location)):
            continue
        if verdict.location:
            verdict.evidence.append(
                f"rank {rank.rank} ran none of your code there ({verdict.location}): the location is "
                "your line that started the workers"
            )
        verdict.location = rank.spawned_at


def exception_location(exc: dict[str, Any] | None, rank: RankState | None = None) -> str | None:
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
    # without a frame of the user's, the innermost library frame that is not torch's or sddoctor's
    # (where an injected fault was raised is no place to look)
    outside = [f for f in frames if not roots.is_internal(frame_path(f))]
    chosen = first_user_frame(frames, roots) or next(reversed(outside or frames), None)
    if chosen:
        return chosen.split(" in ")[0].strip()
    return str(caller) if caller else None


def fault_of(rank: RankState, kinds: tuple[str, ...]) -> dict[str, Any] | None:
    for event in rank.faults[::-1]:
        spec = str(event.get("fault", ""))
        if spec.split(":", 1)[0] in kinds:
            return event
    return None


def lone_rank(by_rank: Mapping[int, Hashable]) -> int | None:
    """The one rank whose value no other rank has, against a majority of two or more that agree
    (two values in all); None otherwise, as with two ranks, where either may be the wrong one."""
    groups: dict[Hashable, list[int]] = {}
    for rank, value in sorted(by_rank.items()):
        groups.setdefault(value, []).append(rank)
    if len(groups) != 2:
        return None
    fewer, more = sorted(groups.values(), key=len)
    return fewer[0] if len(fewer) == 1 and len(more) > 1 else None


#: what a verdict adds to how a process ended when an injected `kill` fault ended it
INJECTED = " (injected by SDDOCTOR_FAULT)"


def kill_signal(fault: dict[str, Any]) -> int:
    """The signal a `kill` fault sends (SIGKILL unless it says another)."""
    return int(fault.get("signal", signal.SIGKILL))


def killed_by_fault(fault: dict[str, Any] | None, exit_info: dict[str, Any] | None) -> bool:
    """Whether the rank died of the signal its `kill` fault sends."""
    if fault is None or not str(fault.get("fault", "")).startswith("kill:"):
        return False
    return bool((exit_info or {}).get("signal") == kill_signal(fault))


def asleep_text(fault: dict[str, Any]) -> str:
    """'asleep in the injected fault ... (fired at ...)' for a rank inside a `sleep` fault."""
    return f"asleep in the injected fault {fault.get('fault')!r} (fired at {fault.get('caller')})"


#: sddoctor's own functions that run an injected `sleep` fault (tracing: at a collective; the
#: session: before a step); a rank's innermost Python frame in one of them is asleep in the fault
_FAULT_SLEEPERS = ("instrument/tracing.py", "_apply_faults"), ("instrument/api.py", "_maybe_fire")


def sleeping_fault(rank: RankState, now: float) -> dict[str, Any] | None:
    """The injected `sleep` fault this rank is still asleep in, if it is: its stack's innermost
    frame is sddoctor's fault code, or (no stack) the first firing's sleep has not run out yet.
    A rank asleep in a fault is where the job's time goes, whatever line its stack names."""
    fault = fault_of(rank, ("sleep",))
    if fault is None:
        return None
    frames = (rank.stack or {}).get("frames") or []
    if frames:
        innermost = str(frames[0])
        path, _, function = innermost.rpartition(" in ")
        file = path.replace("\\", "/").rsplit(":", 1)[0]
        function = function.rsplit(".", 1)[-1]  # py-spy may qualify it: Tracer._apply_faults
        asleep = any(file.endswith(suffix) and function == name for suffix, name in _FAULT_SLEEPERS)
        return fault if asleep else None
    seconds = _sleep_seconds(str(fault.get("fault", "")))
    fired = fault.get("t")
    if seconds is None or not isinstance(fired, (int, float)):
        return None
    return fault if now < fired + seconds else None


def _sleep_seconds(spec: str) -> float | None:
    """The `seconds` of a fault event's spec, read by the parser the ranks used (None if unreadable)."""
    try:
        (fault,) = parse_faults(spec)
    except (FaultSpecError, ValueError):
        return None
    seconds = fault.get("seconds")
    return float(seconds) if isinstance(seconds, (int, float)) else None


def where_is(rank: RankState, state: RunState | None = None) -> tuple[str | None, str]:
    """Where a rank is now (file:line or None) and a phrase saying how we know. With the run's
    `state`, a dead rank's last snapshot is not taken for its position when the run shows that
    the rank went on after it."""
    if rank.stack and rank.stack.get("top_user_frame"):
        frame = rank.stack["top_user_frame"]
        func = rank.stack.get("top_user_function")
        text = f"its stack is at {frame}" + (f" in {func}()" if func else "")
        return frame, text + group_creation_text(rank.stack.get("frames") or [])
    ended_at = ended_position(rank)
    if ended_at is not None:
        return ended_at
    sampled = sampled_position(rank)
    if sampled is not None and not (state is not None and behind_its_snapshot(state, rank)):
        return sampled
    phase = rank.snapshot.phase
    # the rank's own last sync, not a helper thread's (a metrics thread all-reducing on its own group)
    done = rank.snapshot.last_done_main or rank.snapshot.last_done
    if done is not None and done.caller:
        text = f"its last completed collective was {done.op} #{done.seq} at {done.caller}"
        if phase:
            text += f", phase {phase!r}"
        return done.caller, text
    if phase:
        return None, f"it is in phase {phase!r}"
    return None, "no stack or collective record says where"


#: torch's calls that create process groups: collective over the parent group, so every rank of
#: it must make them in the same order (members of the new group or not)
_GROUP_CREATION = re.compile(
    r"/torch/distributed/(distributed_c10d\.py:\d+ in (new_group|new_subgroups\w*)|"
    r"device_mesh\.py:\d+ in (init_device_mesh|DeviceMesh\.__init__))$"
)


def group_creation_text(frames: list[Any]) -> str:
    """ "; it waits inside new_group(), ..." when the stack is inside torch's creation of a process
    group: a rank there waits for the ranks that never call it (called under `if rank == 0`)."""
    for frame in frames:
        found = _GROUP_CREATION.search(str(frame))
        if found:
            call = next(name for name in found.groups()[1:] if name)
            return (
                f"; it waits inside {call.removeprefix('DeviceMesh.')}(), which every rank of the parent "
                "group must call, in the same order, whether or not it is a member of the new group"
            )
    return ""


def sampled_position(rank: RankState) -> tuple[str, str] | None:
    """Where the rank's main thread was in the user's code at its last snapshot (the heartbeat reads
    it about once a second): for a live rank, where it is now though no stack could be taken; for
    one that died without a word (SIGKILL), where it was just before."""
    snap = rank.snapshot
    if snap.main_at is None:
        return None
    where = f"{snap.main_at} in {snap.main_function}()" if snap.main_function else snap.main_at
    if rank.exit is None and rank.alive is not False and not snap.exited:
        text = f"its main thread is at {where}"
    else:
        before = death_time(rank) - snap.t if snap.t is not None else None
        text = f"its main thread was at {where}" + (
            f" {before:.1f} s before it ended"
            if before is not None and 0 <= before < float("inf")
            else " at its last snapshot"
        )
    if snap.phase:
        text += f", phase {snap.phase!r}"
    return snap.main_at, text


def ended_position(rank: RankState) -> tuple[str, str] | None:
    """Where a dead rank was when it ended, and how we know: where SIGTERM found it, else the line
    of the exception that ended it (None: it left neither)."""
    return signal_position(rank) or raised_position(rank)


def signal_position(rank: RankState) -> tuple[str, str] | None:
    """Where a rank's main thread was when SIGTERM ended it (its `exit` event's `at`): the line
    it was stuck at when the launcher stopped it, though no stack was taken before."""
    exit_info = rank.exit or {}
    at = exit_info.get("at")  # written by the rank only when SIGTERM ended it
    if not isinstance(at, str) or not at:
        return None
    func = exit_info.get("at_function")
    where = f"{at} in {func}()" if isinstance(func, str) and func else at
    return at, f"it was at {where} when SIGTERM stopped it"


def raised_position(rank: RankState) -> tuple[str, str] | None:
    """Where a rank's uncaught exception ended it: for a rank that waited in a call of its own until
    a peer's end broke it ("Connection closed by peer"), the line it was held at."""
    exc = rank.exception
    location = exception_location(exc, rank)
    if exc is None or location is None:
        return None
    kind = str(exc.get("type") or "an exception")
    call = exc.get("collective")
    if isinstance(call, dict) and call.get("op"):
        return location, (
            f"it was in {call['op']} #{call.get('seq')} on group {call.get('pg')} at {location} "
            f"until that call failed with {kind}"
        )
    return location, f"it raised {kind} at {location}"


def death_time(rank: RankState) -> float:
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


#: seconds before a rank's death within which a peer's completed call may be one its death broke
_DEATH_MARGIN = 0.5


def behind_its_snapshot(state: RunState, rank: RankState) -> bool:
    """Whether the rank did more than its last snapshot says: another rank completed a call of the
    default group that the snapshot had not issued yet (which took this rank too), or a step of it
    was recorded after the snapshot. A rank killed within a second of its last snapshot leaves such
    a snapshot behind. A call that ended as the rank died (a peer's all-reduce broken by its death)
    proves nothing."""
    snap = rank.snapshot
    if snap.t is not None and rank.steps and rank.steps[-1][0] > snap.t:
        return True
    before = death_time(rank) - _DEATH_MARGIN
    issued = snap.issued_on(DEFAULT_GROUP) or 0
    return any(
        other.rank != rank.rank
        and (done := other.snapshot.last_done) is not None
        and done.pg == DEFAULT_GROUP
        and done.seq is not None
        and done.seq > issued
        and done.t is not None
        and done.t < before
        for other in state.ranks.values()
    )


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
    return unclean_marked(exit_info)


def unclean_marked(exit_info: dict[str, Any] | None) -> dict[str, Any] | None:
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


def raised_text(exc: dict[str, Any]) -> str:
    """'raised TYPE: the first line of its message' for an `exception` event."""
    first_line = (str(exc.get("message", "")).strip().splitlines() or [""])[0]
    kind = exc.get("type", "an exception")
    return f"raised {kind}: {first_line[:160]}" if first_line else f"raised {kind}"


def ended_cleanly(rank: RankState, exit_info: dict[str, Any] | None) -> bool:
    """The rank's process ended by itself with status 0: no exception, signal or hard kill."""
    return rank.exception is None and not abnormal_exit(exit_info) and (exit_info or {}).get("code") == 0


def abnormal_exit(exit_info: dict[str, Any] | None) -> bool:
    if not exit_info:
        return False
    if exit_info.get("unclean"):
        return True  # gone without an exit record: killed hard (SIGKILL, the OOM killer)
    return bool(exit_info.get("signal")) or exit_info.get("code") not in (0, None)


def coded_warnings(state: RunState, code: str) -> list[tuple[int, dict[str, Any]]]:
    """(rank, warning event) of every rank's recent `warning` events with this `code`."""
    return [(r.rank, w) for r in state.ranks.values() for w in r.warnings if w.get("code") == code]


def join_ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def exception_known_error(state: RunState, exc: dict[str, Any] | None) -> KnownError | None:
    """The usual cause of a recorded exception (`comm_errors.known_error`), with the holders of the
    ports the run's port-in-use errors named; else the cause its type names."""
    if not exc:
        return None
    message = str(exc.get("message", ""))
    return known_error(message, state.port_holders) or known_exception_type(exc.get("type"), message)
