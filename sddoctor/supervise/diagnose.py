"""The diagnosis: pure functions from a `RunState` to a list of `Verdict`s.

No I/O here. Each kind of trouble has its module:

- `diagnose_crash`: which rank died first (signal, exit code, traceback); ranks that died as a
  consequence (torchrun's SIGTERM, "connection reset by peer") are not blamed.
- `diagnose_oom`: out-of-memory events, and whether the trainer's fallback absorbed them.
- `diagnose_hang`: no progress for `hang_timeout`; classified by where each rank is.
- `straggler`: the rank that the others keep waiting for.
- here: replicas that diverged, torchrun restarts, threads of a rank that died while it went on,
  sddoctor's own errors inside a rank, and a run with nothing to check.

`diagnose_base` holds what they all read off a rank (how it ended, where). `diagnose` runs them
all and orders the verdicts most severe first.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sddoctor.supervise.diagnose_base import (
    INJECTED,
    PEER_FAILURE,
    STOP_SIGNALS,
    abnormal_exit,
    coded_warnings,
    describe_exit,
    ended_position,
    exception_known_error,
    exception_location,
    join_ranks,
    kill_signal,
    killed_by_fault,
    locate_spawned_culprits,
    lone_rank,
    raised_text,
    unclean_marked,
    where_is,
)
from sddoctor.supervise.diagnose_crash import diagnose_crash, diagnose_crash_mismatch
from sddoctor.supervise.diagnose_hang import diagnose_hang, unreachable_world_hang
from sddoctor.supervise.diagnose_oom import OOM_TEXT, diagnose_oom
from sddoctor.supervise.payloads import diagnose_payload_mismatch
from sddoctor.supervise.state import VERDICT_KINDS, RunState, Verdict
from sddoctor.supervise.straggler import diagnose_straggler

#: endings after which the ranks' calls need not line up by number any more
_MISALIGNING = ("crash", "exited_early")


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
                and not OOM_TEXT.search(str((v.details.get("exception") or {}).get("message", "")))
            )
        ]
    if state.hung:
        verdicts += diagnose_hang(state)
    verdicts += diagnose_replicas(state)
    # A rank that skipped, added, or never reached a call numbers the rest differently from its
    # peers: comparing calls by number is only meaningful in a run that did not end that way.
    if not any(v.kind.startswith("hang.") or v.kind in _MISALIGNING for v in verdicts):
        verdicts += diagnose_payload_mismatch(state)
    verdicts += diagnose_straggler(state)
    verdicts += diagnose_thread_deaths(state)
    verdicts += diagnose_internal_errors(state)
    verdicts += diagnose_restarts(state)
    if not verdicts:
        verdicts += diagnose_no_collectives(state)
    verdicts = without_explained_thread_deaths(verdicts)
    locate_spawned_culprits(verdicts, state)
    order = {kind: i for i, kind in enumerate(VERDICT_KINDS)}
    severity = {"error": 0, "warning": 1, "info": 2}
    verdicts.sort(key=lambda v: (severity.get(v.severity, 3), order.get(v.kind, 99)))
    return verdicts


def merge_verdicts(first: list[Verdict], rest: list[Verdict]) -> list[Verdict]:
    """Frozen hang verdicts first; a live verdict of the same kind and rank does not repeat them,
    nor does a thread's death they name."""
    seen = {(v.kind, v.culprit_rank) for v in first}
    return without_explained_thread_deaths(
        list(first)
        + [
            v
            for v in rest
            if (v.kind, v.culprit_rank) not in seen and not (first and v.kind.startswith("hang."))
        ]
    )


def place_stackless_culprits(frozen: list[Verdict], state: RunState) -> list[Verdict]:
    """The frozen hang verdicts, each culprit that had no stack when it was frozen (py-spy could not
    attach, or `--on-hang wait`) placed where the end of the job found it: where SIGTERM found its
    main thread, or the line of the exception that ended it (Ctrl-C's KeyboardInterrupt). The rest
    are returned as they are; a verdict placed once is not placed again."""
    placed = []
    for verdict in frozen:
        rank = state.ranks.get(verdict.culprit_rank) if verdict.culprit_rank is not None else None
        if (
            rank is None
            or not verdict.kind.startswith("hang.")
            or verdict.details.get("resolved")
            or "stopped_at" in verdict.details
            or (rank.stack or {}).get("top_user_frame")
        ):
            placed.append(verdict)
            continue
        ended = ended_position(rank)
        if ended is None:
            placed.append(verdict)
            continue
        location, how = ended
        placed.append(
            dataclasses.replace(
                verdict,
                summary=f"{verdict.summary.rstrip('.')}. When the job was stopped, rank {rank.rank}: {how}",
                location=location,
                details={**verdict.details, "stopped_at": location},
            )
        )
    return placed


def _ended_in_init(state: RunState, ranks: list[int]) -> Verdict:
    """The job ended (stopped, or a rank failed) while ranks still waited in init_process_group: the
    rendezvous never completed. An error when it never could (more ranks wanted than processes)."""
    unreachable = state.unreachable_world(at_end=True)
    if unreachable is not None:
        return unreachable_world_hang(unreachable, {"ended": "stopped"}, [])
    waits = [state.ranks[r].snapshot.waiting or {} for r in ranks]
    caller = next((w.get("caller") for w in waits if w.get("caller")), None)
    sizes = sorted({w["world_size"] for w in waits if isinstance(w.get("world_size"), int)})
    plural = len(ranks) > 1
    summary = (
        f"rank{'s' if plural else ''} {join_ranks(ranks)} entered init_process_group"
        + (f" at {caller}" if caller else "")
        + f" and never got past it: {'they' if plural else 'it'} still waited there"
        + (f" for {' / '.join(map(str, sizes))} ranks" if sizes else "")
        + " when the job ended, so no collective ran"
    )
    elsewhere = sorted(set(state.ranks) - set(ranks))
    if elsewhere:
        summary += (
            f"; rank{'s' if len(elsewhere) > 1 else ''} {join_ranks(elsewhere)} never called it "
            f"({'; '.join(where_is(state.ranks[r], state)[1] or '?' for r in elsewhere[:3])})"
        )
    else:
        summary += (
            ". If the job hung there, the ranks could not meet: MASTER_ADDR/MASTER_PORT, a firewall, "
            "the world size, a node that never started; `sddoctor check-nccl` checks the network"
        )
    details = {"ranks": len(state.ranks), "waiting_in_init": ranks}
    return Verdict("no_collectives", "info", summary, None, caller, details, [])


def diagnose_replicas(state: RunState) -> list[Verdict]:
    """DDP replicas that no longer hold the same weights: the trainer's `replicas` digests differ
    at one step, or a rank reported `replicas_differ`. Training silently diverged."""
    by_step: dict[int, dict[int, str]] = {}
    for rank in state.ranks.values():
        for ev in rank.replicas:
            if isinstance(ev.get("step"), int) and isinstance(ev.get("params_sha256"), str):
                by_step.setdefault(ev["step"], {})[rank.rank] = ev["params_sha256"]
    warned = coded_warnings(state, "replicas_differ")
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
        culprit = lone_rank(digests)
        details = {"step": step, "digests": {str(r): d for r, d in sorted(digests.items())}}
        evidence += [f"ranks {join_ranks(g)}: params_sha256 {d[:16]}..." for d, g in groups.items()]
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


def diagnose_restarts(state: RunState) -> list[Verdict]:
    """The launcher restarted workers (torchrun --max-restarts): the first failure that made it,
    from the ranks' earlier processes. What the current processes did is judged as usual."""
    failures = []
    for rank in state.ranks.values():
        for number, attempt in enumerate(rank.attempts, start=1):
            exc, exit_info = attempt.get("exception"), unclean_marked(attempt.get("exit"))
            if exc is None and not abnormal_exit(exit_info):
                continue
            times = [
                t for t in ((exc or {}).get("t"), (exit_info or {}).get("t")) if isinstance(t, (int, float))
            ]
            sig = (exit_info or {}).get("signal")
            # as for a crash: a rank that lost its peer ("connection closed", torchrun's SIGTERM) is
            # not the failure that made the launcher restart when another rank of that attempt failed
            victim = bool(sig and int(sig) in STOP_SIGNALS) or bool(
                PEER_FAILURE.search(str((exc or {}).get("message", "")))
            )
            failures.append((number, victim, min(times) if times else float("inf"), rank, attempt))
    if not failures:
        return []
    number, _, _, rank, attempt = min(failures, key=lambda f: (f[0], f[1], f[2], f[3].rank))
    exc = attempt.get("exception")
    how = raised_text(exc) if exc else describe_exit(unclean_marked(attempt.get("exit")))
    location = exception_location(exc, rank)
    if not exc and (kill := _injected_kill(attempt)):
        how = describe_exit({"signal": kill_signal(kill)}) + INJECTED
        location = location or kill.get("caller")
    restarted = sorted(r.rank for r in state.ranks.values() if r.attempts)
    common = exception_known_error(state, exc)
    summary = (
        f"the launcher restarted the workers: on attempt {number} rank {rank.rank} {how}"
        + (f" at {location}" if location else "")
        + (common.summary_clause() if common else "")
        + (f" (step {attempt['step']})" if attempt.get("step") is not None else "")
        + f"; rank{'s' if len(restarted) > 1 else ''} {join_ranks(restarted)} then ran in new processes"
    )
    evidence = [
        f"rank {r.rank}: earlier process{'es' if len(r.attempts) > 1 else ''} "
        + ", ".join(
            f"pid {a.get('pid')} ({describe_exit(unclean_marked(a.get('exit')))})" for a in r.attempts
        )
        + f"; now pid {r.pid}"
        for r in sorted(state.ranks.values(), key=lambda r: r.rank)
        if r.attempts
    ]
    details = {
        "attempt": number,
        "rank": rank.rank,
        "restarted_ranks": restarted,
        "exit": attempt.get("exit"),
    }
    if exc:
        details["exception"] = {"type": exc.get("type"), "message": exc.get("message")}
        details["traceback"] = exc.get("traceback")
    if common is not None:
        details["known_error"] = common.to_dict()
        evidence.append(common.advice)
    return [Verdict("restarted", "warning", summary, rank.rank, location, details, evidence)]


def _injected_kill(attempt: dict[str, Any]) -> dict[str, Any] | None:
    """The `kill` fault that ended an earlier process of a rank, if one did: it fired in that
    process, which then died of its signal or vanished without an exit record (killed hard)."""
    kills = [f for f in attempt.get("faults") or [] if str(f.get("fault", "")).startswith("kill:")]
    if not kills:
        return None
    exit_info = unclean_marked(attempt.get("exit")) or {}
    no_record = exit_info.get("code") is None and not exit_info.get("signal")
    fired: dict[str, Any] = kills[-1]
    return fired if killed_by_fault(fired, exit_info) or no_record else None


def diagnose_thread_deaths(state: RunState) -> list[Verdict]:
    """A thread of a rank that died of an uncaught exception while the rank went on (a metrics,
    prefetch or upload thread): Python prints its traceback among the job's output, the rank's
    exit code says nothing, and whatever the thread did silently stopped. One warning per thread
    and error; `without_explained_thread_deaths` then drops those other verdicts already tell."""
    verdicts = []
    seen = set()
    for rank, w in sorted(coded_warnings(state, "thread_exception"), key=lambda rw: rw[0]):
        key = (rank, w.get("thread"), w.get("type"), w.get("caller"))
        if key in seen:
            continue
        seen.add(key)
        caller = w.get("caller") if isinstance(w.get("caller"), str) else None
        error = str(w.get("error") or "")
        summary = (
            f"rank {rank}'s thread {w.get('thread')!r} died of {w.get('type')}: {error[:200]}"
            + (f" at {caller}" if caller else "")
            + "; the rank went on without it, and whatever that thread did stopped"
        )
        details = {k: w.get(k) for k in ("thread", "type", "error", "caller", "traceback", "step", "t")}
        evidence = [f"rank {rank}: {w.get('message')}"]  # the report shows details.traceback
        verdicts.append(Verdict("thread.died", "warning", summary, rank, caller, details, evidence))
    return verdicts


def without_explained_thread_deaths(verdicts: list[Verdict]) -> list[Verdict]:
    """`thread.died` verdicts less those another verdict tells: a death a hang verdict names as its
    cause (`details.thread_exception`), and a thread that only lost its peer ("connection closed by
    peer") once an error verdict explains why."""
    named = {
        (v.culprit_rank, v.details["thread_exception"].get("t"))
        for v in verdicts
        if isinstance(v.details.get("thread_exception"), dict)
    }
    explained = any(v.severity == "error" for v in verdicts)

    def told(v: Verdict) -> bool:
        if v.kind != "thread.died":
            return False
        peer_lost = explained and PEER_FAILURE.search(str(v.details.get("error") or ""))
        return (v.culprit_rank, v.details.get("t")) in named or bool(peer_lost)

    return [v for v in verdicts if not told(v)]


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
    in_init = sorted(
        r.rank for r in state.ranks.values() if (r.snapshot.waiting or {}).get("what") == "init_process_group"
    )
    if in_init:
        return [_ended_in_init(state, in_init)]
    summary = (
        f"{len(state.ranks)} rank{'s' if len(state.ranks) > 1 else ''} joined a process group but issued no "
        "collective and finished no step: there was nothing to check for hangs, stragglers or mismatches"
    )
    return [Verdict("no_collectives", "info", summary, None, None, {"ranks": len(state.ranks)}, [])]
