"""Each rank's steps, collectives and events on one time axis, built from a run directory.

This is what report.html draws and `sddoctor trace` exports. Sources (docs/telemetry.md):
- `timeline/rank-N.jsonl`: every completed traced collective (enqueue time, duration, caller);
- the rank's state snapshot (or the report's copy of it): the collectives still in flight at the end;
- the rank's events: steps (`t` is the end, `step_time` the length), OOMs, fallbacks, injected
  faults, exceptions, checkpoints, the exit;
- report.json's verdicts: the hang (who never arrived where), the crash, the straggler.

Collectives are matched across ranks by (process group, sequence number), within one attempt (the
processes a torchrun restart starts number theirs from 1 again). The last rank to enter
a collective is the one the others waited for: each rank's `wait` is the time between its own
arrival and the last arrival. Point-to-point calls are not matched (only two ranks take part).
Arrival times are exact on every backend; completion of calls observed by polling (NCCL, async
ops) is known to about a second, so waits are computed from arrivals only. Ranks on several
hosts are compared on their hosts' clocks.

Pure functions over plain data, plus `load_timeline(run_dir)` at the edge. No torch.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sddoctor.telemetry import RankSnapshot, RunDir, RunView, StepRecord
from sddoctor.telemetry.timeline import read_timeline

#: event kinds drawn as instant marks on a rank's track
MARK_KINDS = ("oom", "fallback", "fault", "exception", "exit", "checkpoint", "warning")


@dataclass
class Call:
    """One traced collective of one rank."""

    rank: int
    pg: str
    seq: int
    op: str
    t0: float
    t1: float | None  # None: still in flight when the rank's record ends
    caller: str = ""
    polled: bool = False  # completion observed by polling (about a second of precision)
    peer: int | None = None
    wait: float | None = None  # time from this rank's arrival to the last rank's arrival
    last: bool = False  # this rank arrived last: the others waited for it
    late_rank: int | None = None  # the rank that arrived last, when matched
    #: which process of the rank made it (0, then 1 after a torchrun restart): a new process
    #: numbers its collectives from 1 again, so only calls of the same attempt match
    attempt: int = 0

    @property
    def p2p(self) -> bool:
        return self.pg.endswith(":p2p")

    def end(self, fallback: float) -> float:
        return self.t1 if self.t1 is not None else fallback


@dataclass
class Step:
    rank: int
    step: int
    t0: float
    t1: float
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class Mark:
    """An instant on a rank's track: an OOM, a fallback, a fault, the exit, the hang, ..."""

    rank: int
    t: float
    kind: str
    label: str
    severity: str = "info"  # "error" | "warning" | "info"


@dataclass
class Lane:
    """One rank's track."""

    rank: int
    host: str | None = None
    start: float | None = None
    end: float | None = None  # its last sign of life (exit, snapshot, heartbeat, last event)
    calls: list[Call] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    dropped: int = 0  # calls the rank could not buffer (see telemetry.timeline)
    role: str = ""  # "missing" | "crashed" | "straggler" | "" : why this lane stands out
    note: str = ""  # one line on the role ("never reached all_reduce #5", ...)

    def waited(self) -> float:
        return sum(c.wait for c in self.calls if c.wait is not None and not c.last)

    def last_arrivals(self) -> int:
        return sum(1 for c in self.calls if c.last)


@dataclass
class Timeline:
    lanes: dict[int, Lane]
    start: float | None
    end: float | None
    verdicts: list[dict[str, Any]] = field(default_factory=list)
    matched: int = 0  # collectives seen on at least two ranks

    def is_empty(self) -> bool:
        return not any(lane.calls or lane.steps or lane.marks for lane in self.lanes.values())


# -- loading ----------------------------------------------------------------------------------------


def load_timeline(
    run_dir: RunDir, report: dict[str, Any] | None = None, view: RunView | None = None
) -> Timeline:
    """Read a run directory (and its report, for verdicts and in-flight calls) into a Timeline."""
    view = view or RunView.load(run_dir)
    report = report or view.report() or {}
    report_ranks = report.get("ranks") or {}
    raw: dict[int, dict[str, Any]] = {}
    for rank in sorted(set(view.ranks) | {int(k) for k in report_ranks if str(k).isdigit()}):
        rank_view = view.ranks.get(rank)
        calls, dropped = read_timeline(run_dir, rank)
        snapshot = report_ranks.get(str(rank)) or (rank_view.state if rank_view else None) or {}
        raw[rank] = {
            "events": rank_view.events if rank_view else [],
            "snapshot": snapshot,
            "calls": calls,
            "dropped": dropped,
        }
    return build_timeline(raw, report.get("verdicts") or [])


# -- building (pure) --------------------------------------------------------------------------------


def build_timeline(raw: dict[int, dict[str, Any]], verdicts: list[dict[str, Any]]) -> Timeline:
    """`raw`: rank -> {events, snapshot, calls (timeline-file dicts), dropped}."""
    lanes = {rank: _lane(rank, data) for rank, data in raw.items()}
    matched = match_collectives(lanes)
    _apply_verdicts(lanes, verdicts)
    for lane in lanes.values():
        lane.marks.sort(key=lambda m: m.t)
    starts = [lane.start for lane in lanes.values() if lane.start is not None]
    ends = [lane.end for lane in lanes.values() if lane.end is not None]
    return Timeline(
        lanes=lanes,
        start=min(starts) if starts else None,
        end=max(ends) if ends else None,
        verdicts=list(verdicts),
        matched=matched,
    )


def _lane(rank: int, data: dict[str, Any]) -> Lane:
    events = data.get("events") or []
    record = data.get("snapshot") or {}
    snapshot = RankSnapshot.of(record)
    lane = Lane(rank=rank, host=snapshot.host, dropped=int(data.get("dropped") or 0))
    starts = sorted(
        float(e["t"]) for e in events if e.get("kind") == "start" and isinstance(e.get("t"), (int, float))
    )
    for c in data.get("calls") or []:
        lane.calls.append(_call(rank, c, float(c["t0"]), float(c["t0"]) + max(0.0, float(c["duration"]))))
    for call in lane.calls:
        call.attempt = max(0, bisect.bisect_right(starts, call.t0) - 1)
    current = max(0, len(starts) - 1)  # the snapshot is the current process's
    done = {(c.pg, c.seq) for c in lane.calls if c.attempt == current}
    for c in snapshot.inflight:
        if c.since is None:
            continue
        if (c.pg, c.seq) not in done:  # else it completed after the snapshot
            lane.calls.append(_call(rank, c.record, c.since, None))
            lane.calls[-1].attempt = current
    lane.calls.sort(key=lambda c: c.t0)
    lane.steps = _steps(rank, events)
    lane.marks = [m for e in events if (m := _event_mark(rank, e)) is not None]
    exit_info: dict[str, Any] = record["exit"] if isinstance(record.get("exit"), dict) else {}  # report's
    _bounds(lane, events, snapshot, exit_info)
    return lane


def _call(rank: int, c: Mapping[str, Any], t0: float, t1: float | None) -> Call:
    """A Call from a timeline-file row or an in-flight record of a state snapshot."""
    return Call(
        rank=rank,
        pg=str(c.get("pg")),
        seq=int(c.get("seq") or 0),
        op=str(c.get("op")),
        t0=t0,
        t1=t1,
        caller=str(c.get("caller") or ""),
        polled=bool(c.get("async")),
        peer=c.get("peer") if isinstance(c.get("peer"), int) else None,
    )


def _steps(rank: int, events: list[dict[str, Any]]) -> list[Step]:
    """Step slices: a step ends at its event's `t_end` (else `t`) and lasts `step_time` (else since the
    previous step)."""
    steps: list[Step] = []
    previous_end: float | None = None
    for e in events:
        if e.get("kind") != "step":
            continue
        # `t_end`: when the step ended on the host; `t` is when the event was written, which the
        # trainer on CUDA delays until the GPU finished the step
        record = StepRecord.of(e)
        if record.ended is None:
            continue
        t1 = record.ended
        length = record.step_time
        if length is not None and length >= 0:
            t0 = t1 - length
            if previous_end is not None and previous_end <= t1:
                # one rank's steps follow each other: a start a few microseconds before the previous
                # end is the rounding of `step_time` and of the clock (inferred DDP steps end at the
                # last bucket and start at the next forward), not an overlap
                t0 = max(t0, previous_end)
        elif previous_end is not None:
            t0 = previous_end
        else:
            previous_end = t1
            continue
        fields = {k: v for k, v in e.items() if k not in ("v", "t", "rank", "kind", "step")}
        steps.append(Step(rank=rank, step=record.step or 0, t0=t0, t1=t1, fields=fields))
        previous_end = t1
    return steps


def _event_mark(rank: int, e: dict[str, Any]) -> Mark | None:
    kind = e.get("kind")
    t = e.get("t")
    if kind not in MARK_KINDS or not isinstance(t, (int, float)):
        return None
    if kind == "oom":
        label = (
            f"out of memory in {e.get('phase')} at step {e.get('step')} (micro-batch {e.get('micro_batch')})"
        )
        return Mark(rank, t, kind, label, "error")
    if kind == "fallback":
        label = (
            f"OOM fallback at step {e.get('step')}: micro-batch {e.get('old_micro_batch')} -> "
            f"{e.get('new_micro_batch')}, grad-accum {e.get('old_grad_accum')} -> {e.get('new_grad_accum')}"
        )
        return Mark(rank, t, kind, label, "warning")
    if kind == "fault":
        return Mark(rank, t, kind, f"injected fault {e.get('fault')} at {e.get('caller')}", "warning")
    if kind == "exception":
        return Mark(
            rank, t, kind, f"exception {e.get('type')}: {e.get('message')} at {e.get('caller')}", "error"
        )
    if kind == "exit":
        status = e.get("status")
        return Mark(
            rank, t, kind, f"exit: {status} (code {e.get('code')})", "info" if status == "ok" else "error"
        )
    if kind == "checkpoint":
        what = "resumed from" if e.get("action") == "resume" else "checkpoint saved:"
        return Mark(rank, t, kind, f"{what} {e.get('path')} (step {e.get('step')})")
    return Mark(rank, t, kind, f"warning {e.get('code')}: {e.get('message')}", "warning")


def _bounds(
    lane: Lane, events: list[dict[str, Any]], snapshot: RankSnapshot, exit_info: dict[str, Any]
) -> None:
    times = [float(e["t"]) for e in events if isinstance(e.get("t"), (int, float))]
    times += [c.t0 for c in lane.calls] + [c.t1 for c in lane.calls if c.t1 is not None]
    times += [s.t0 for s in lane.steps]
    start = next(
        (float(e["t"]) for e in events if e.get("kind") == "start" and isinstance(e.get("t"), (int, float))),
        None,
    )
    lane.start = start if start is not None else (min(times) if times else None)
    for value in (snapshot.heartbeat, snapshot.t, exit_info.get("t")):
        if isinstance(value, (int, float)):
            times.append(float(value))
    lane.end = max(times) if times else None
    if exit_info.get("t") and not any(m.kind == "exit" for m in lane.marks):
        how = f"signal {exit_info['signal']}" if exit_info.get("signal") else f"code {exit_info.get('code')}"
        severity = "info" if exit_info.get("code") == 0 else "error"
        lane.marks.append(Mark(lane.rank, float(exit_info["t"]), "exit", f"process ended ({how})", severity))


def match_collectives(lanes: dict[int, Lane]) -> int:
    """Set `wait`, `last` and `late_rank` on calls that several ranks made; returns how many matched.

    A group's size is the most ranks seen in any one of its collectives; a collective seen on fewer
    ranks (a rank never reached it, or its record fell out of the buffer) gets waits only for the
    ranks still inside it at the end, measured to their end.
    """
    by_key: dict[tuple[int, str, int], list[Call]] = {}
    for lane in lanes.values():
        for call in lane.calls:
            if not call.p2p:
                by_key.setdefault((call.attempt, call.pg, call.seq), []).append(call)
    group_size: dict[str, int] = {}
    for (_, pg, _), calls in by_key.items():
        group_size[pg] = max(group_size.get(pg, 0), len({c.rank for c in calls}))
    matched = 0
    for (_, pg, _), calls in by_key.items():
        ranks = {c.rank for c in calls}
        if len(ranks) < 2 or len(ranks) < group_size[pg]:
            for c in calls:
                if c.t1 is None:  # inside it at the end, waiting for a rank that never came
                    c.wait = max(0.0, (lanes[c.rank].end or c.t0) - c.t0)
            continue
        matched += 1
        latest = max(calls, key=lambda c: c.t0)
        for c in calls:
            c.late_rank = latest.rank
            c.last = c is latest
            c.wait = 0.0 if c.last else latest.t0 - c.t0
    return matched


def _apply_verdicts(lanes: dict[int, Lane], verdicts: list[dict[str, Any]]) -> None:
    """Mark the lanes a verdict names: the missing rank, the crashed rank, the straggler."""
    for v in verdicts:
        kind = str(v.get("kind") or "")
        details = v.get("details") or {}
        culprit = v.get("culprit_rank")
        if kind.startswith("hang."):
            _hang_marks(lanes, v, details)
        elif kind in ("crash", "oom") and culprit in lanes:
            lane = lanes[culprit]
            lane.role = lane.role or "crashed"
            lane.note = lane.note or str(v.get("summary") or kind)
        elif kind == "exited_early" and culprit in lanes:
            lane = lanes[culprit]
            lane.role = lane.role or "missing"  # it left while the others still expected it
            lane.note = (
                lane.note
                or f"ended after #{details.get('issued')}; the others went on to #{details.get('waiting_in')}"
            )
        elif kind == "straggler" and culprit in lanes:
            lane = lanes[culprit]
            lane.role = lane.role or "straggler"
            lane.note = lane.note or str(v.get("summary") or kind)


def _hang_marks(lanes: dict[int, Lane], v: dict[str, Any], details: dict[str, Any]) -> None:
    pg, seq, op = details.get("pg"), details.get("seq"), details.get("op")
    entered = [
        c.t0
        for lane in lanes.values()
        for c in lane.calls
        if c.t1 is None and (pg is None or (c.pg == str(pg) and c.seq == seq))
    ]
    since = min(entered) if entered else None
    culprit = v.get("culprit_rank")
    missing = details.get("missing_ranks") or ([culprit] if v.get("kind") == "hang.missing_rank" else [])
    for rank in missing:
        lane = lanes.get(rank)
        if lane is None:
            continue
        lane.role = "missing"
        lane.note = f"never reached {op} #{seq} (pg {pg})" if seq is not None else str(v.get("summary"))
        t = since if since is not None else (lane.end or 0.0)
        lane.marks.append(Mark(rank, t, "hang", f"rank {rank} {lane.note}; the others wait for it", "error"))
    if culprit in lanes and culprit not in missing:
        lanes[culprit].role = lanes[culprit].role or "culprit"
        lanes[culprit].note = lanes[culprit].note or str(v.get("summary") or v.get("kind"))
    stalled = details.get("stalled_seconds")
    if since is not None and isinstance(stalled, (int, float)):
        latest = max((lane.end or since) for lane in lanes.values())
        declared = min(latest, since + float(stalled))
        for lane in lanes.values():
            lane.marks.append(
                Mark(
                    lane.rank,
                    declared,
                    "hang",
                    f"hang declared: {v.get('kind')} after {stalled} s without progress",
                    "error",
                )
            )


# -- summaries used by the report -------------------------------------------------------------------


def lane_stats(lane: Lane, attempt: int | None = None) -> dict[str, Any]:
    """Per rank: matched collectives, seconds waited for others, how often it arrived last; of one
    attempt of a restarted job when `attempt` is given (0 the first), else of the whole run."""
    calls = lane.calls if attempt is None else [c for c in lane.calls if c.attempt == attempt]
    matched = [c for c in calls if c.late_rank is not None]
    waits = [c.wait for c in matched if c.wait is not None]
    return {
        "collectives": len(calls),
        "matched": len(matched),
        "waited_seconds": round(sum(waits), 6),
        "median_wait": round(statistics.median(waits), 6) if waits else None,
        "arrived_last": sum(1 for c in calls if c.last),
        "dropped": lane.dropped,
    }


def window(
    timeline: Timeline, max_calls: int = 1500, max_seconds: float = 300.0
) -> tuple[float, float] | None:
    """The end of the run to show in detail: at most `max_seconds`, at most `max_calls` calls on any rank,
    and not the start-up before the first step or collective (imports, rendezvous)."""
    if timeline.start is None or timeline.end is None:
        return None
    end = timeline.end
    firsts = [t for lane in timeline.lanes.values() for t in _first_activity(lane)]
    begin = timeline.start
    if firsts:
        begin = max(begin, min(firsts) - 0.05 * (end - min(firsts)))  # a little room before it
    start = max(begin, end - max_seconds)
    for lane in timeline.lanes.values():
        if len(lane.calls) > max_calls:
            start = max(start, lane.calls[-max_calls].t0)
    return start, end


def _first_activity(lane: Lane) -> list[float]:
    """When the rank's first collective, first step and first event other than its exit began."""
    times = [lane.calls[0].t0] if lane.calls else []
    times += [lane.steps[0].t0] if lane.steps else []
    return times + [m.t for m in lane.marks if m.kind != "exit"][:1]
