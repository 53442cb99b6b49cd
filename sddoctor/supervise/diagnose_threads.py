"""What a hung rank's own threads say: a thread that died of an uncaught exception (it issued the
collectives its peers wait in, or the main thread waits for it through a queue), or the threads a
main thread waits for (`Queue.get`, `Event.wait`, `join`) and where they are. Adds to a hang
verdict; pure functions of `RunState`."""

from __future__ import annotations

import re
from typing import Any

from sddoctor.codepaths import frame_path
from sddoctor.supervise.diagnose_base import coded_warnings
from sddoctor.supervise.state import RankState, RunState, Verdict


def with_thread_deaths(state: RunState, verdict: Verdict) -> Verdict:
    """A rank's thread that died of an exception stops doing its work while the rank goes on. Its
    death is the cause, and its line the location, when that thread issued the culprit's calls on
    the group the verdict names (its peers' threads wait forever in the next one), or when the
    culprit's main thread waits for another thread of its own (a queue the dead thread filled)."""
    deaths = coded_warnings(state, "thread_exception")
    for rank, w in deaths:
        where = f" at {w['caller']}" if isinstance(w.get("caller"), str) else ""
        verdict.evidence.append(f"rank {rank}: {w.get('message')}{where}")
    mine = [w for r, w in deaths if r == verdict.culprit_rank]
    if verdict.culprit_rank not in state.ranks:
        return verdict
    if not mine:
        return _with_awaited_threads(state.ranks[verdict.culprit_rank], verdict)
    death, culprit = mine[-1], state.ranks[verdict.culprit_rank]
    verdict.details["thread_exception"] = {
        k: death.get(k) for k in ("thread", "type", "error", "caller", "traceback", "t")
    }
    died = f"Rank {verdict.culprit_rank}'s {death.get('message')}" + (
        f" (at {death['caller']})" if isinstance(death.get("caller"), str) else ""
    )
    waited = _thread_wait(culprit)
    if _thread_issued_calls(culprit, str(verdict.details.get("pg")), death):
        verdict.summary += f". {died}: that thread issued these calls, and they stopped with it"
    elif waited is not None:
        verdict.summary += (
            f". Its main thread waits in {waited}() for another thread of its own, and {died[0].lower()}"
            f"{died[1:]}: most likely the thread it waits for"
        )
    else:
        return verdict
    verdict.location = death.get("caller") or verdict.location
    return verdict


def _with_awaited_threads(culprit: RankState, verdict: Verdict) -> Verdict:
    """A culprit whose main thread waits for another thread of its own (a queue, an event, a
    join): the verdict says where its other threads are, since one of them holds it."""
    waited = _thread_wait(culprit)
    threads = (culprit.stack or {}).get("threads") or []
    if waited is None or not threads:
        return verdict
    where = ", ".join(
        f"thread '{t.get('name')}' is at {t.get('frame')}"
        + (f" in {t['function']}()" if t.get("function") else "")
        for t in threads
    )
    verdict.summary += f". Its main thread waits in {waited}() for another thread of its own: {where}"
    verdict.details["awaited_threads"] = threads
    return verdict


def _thread_issued_calls(rank: RankState, pg: str, death: dict[str, Any]) -> bool:
    """Whether the dead thread issued the rank's calls on `pg`: its last call there was made in a
    file of the thread's traceback (a one-file script's main loop is in it too), and, where the
    rank's record of that call says, off its main thread and not by DDP."""
    sightings = rank.arrivals.get(pg, {})
    last_caller = sightings[max(sightings)].caller if sightings else None
    thread_files = {frame_path(str(f)) for f in death.get("traceback") or []}
    if not last_caller or frame_path(last_caller) not in thread_files:
        return False
    issued = rank.snapshot.issued_on(pg) or 0
    for call in (rank.snapshot.last_done, rank.snapshot.last_done_main):
        if call is not None and call.pg == pg and (call.seq or 0) >= issued:
            return call.off_main and call.ddp is None
    return True


#: the library code a main thread waits in for another thread of its process: a queue, an event
#: or a condition, a join, a future
_THREAD_WAIT_FILE = re.compile(r"/(threading|queue)\.py:\d+|/concurrent/futures/\w+\.py:\d+")


def _thread_wait(rank: RankState) -> str | None:
    """The call ("Queue.get") the rank's main thread waits in for another thread, when the frames
    between its innermost one and its own code are a queue's, an event's, a join's or a future's."""
    stack = rank.stack or {}
    top = stack.get("top_user_frame")
    waiting = None
    for frame in (str(f) for f in stack.get("frames") or []):
        if top and frame.startswith(f"{top} "):
            return waiting
        if not _THREAD_WAIT_FILE.search(frame):
            return None
        waiting = frame.partition(" in ")[2] or None
    return None
