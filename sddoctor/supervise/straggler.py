"""Stragglers: the rank that the others keep waiting for, measured from when each rank arrives.

Under DDP every rank has the same step time (the fast ones wait inside the collectives), so step
time alone cannot tell who is slow. When each rank enters each collective can: at collective k the
ranks that arrive before the last one wait for it, from their own arrival to the last arrival.
The union of those intervals over a window is how much of its wall time a rank spent waiting for
others (`wait_share`); the rest is its own work (`busy_share`). Enqueue times are taken on the CPU
when the call is made, so this holds on gloo and on NCCL, for blocking and asynchronous
collectives (DDP's gradient buckets) alike.

A straggler is persistent, not a blip: within the window (60 s) it must be the last to arrive at
most collectives that one rank reached clearly last, weighted by how late (`LAST_SHARE`: of the
time the others waited for a last rank, most was for it; ties decide nothing), its busy time must be `straggler_ratio` times the median other
rank's, the others must spend a real share of their time waiting for it, over enough collectives
and steps, late by a real margin at several collectives, not once or twice (`MIN_HEAVY_ROUNDS`); and
`StragglerTracker` declares it only once that has held for `CONFIRM_SECONDS` and
`CONFIRM_STEPS` more steps. The first steps, a compile, a checkpoint save on one rank or work all
ranks share do not pass: each is one late arrival, or no skew at all. The live warning and the
final verdict come from the same episodes.

Pure functions and plain state; the supervisor adds the straggler's own hot line from py-spy
samples (`stacks.sample_hot_frame`), or, where py-spy takes none (ptrace not permitted, a rank on
another node, a run that ended before it could sample), from where the rank's state snapshots saw
its main thread (`snapshot_hot_line`).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from sddoctor.supervise.diagnose_base import fault_of
from sddoctor.supervise.state import RankState, RunState, Verdict

WINDOW = 60.0
MIN_COLLECTIVES = 10
MIN_DECIDED = 5
MIN_STEPS = 5
LAST_SHARE = 0.6
MIN_OTHERS_WAIT_SHARE = 0.1
#: the least share of the straggler's samples its busiest user line must hold to be named as where
#: its time goes
MIN_CAUSE_SHARE = 0.25
#: the fewest snapshots (about one a second) that may name the straggler's line without py-spy
MIN_SNAPSHOT_SAMPLES = 5
MIN_WAIT_SECONDS = 0.05
#: the least number of collectives the straggler must be late at by a quarter of its worst
#: lateness or more: one or two long late arrivals (stalls, a save on one rank) are not a rank
#: that keeps the others waiting
MIN_HEAVY_ROUNDS = 3
CONFIRM_SECONDS = 10.0
CONFIRM_STEPS = 5


@dataclass
class Finding:
    """A rank that the others waited for in one window, with the figures of that window."""

    rank: int
    ratio: float  # its busy share / the median other rank's
    busy_share: float
    others_busy_share: float
    others_wait_share: float
    last_share: float  # of the time ranks waited for the last one to arrive, the share it was this rank
    collectives: int
    decided: int  # collectives at which one rank arrived clearly last (not a tie)
    steps: int  # steps finished in the window (0: the program reports none)
    period: float | None  # seconds per step, if steps are known
    per_collective: float  # seconds per collective (span / collectives)
    wait_site: str | None
    since: float
    until: float
    shares: dict[int, dict[str, float]] = field(default_factory=dict)
    #: collectives at which it was last by at least a quarter of its worst lateness in the window
    heavy_rounds: int = 0
    #: every rank of the slow set, `rank` (the slowest) first, as `analyse` finds it: ranks
    #: equally slow (two GPUs of four throttling) take turns being last by a hair, so they are
    #: judged as one
    ranks: list[int] = field(default_factory=list)

    @property
    def unit(self) -> str:
        return "step" if self.period else "collective"

    @property
    def seconds_per_unit(self) -> float:
        return self.busy_share * (self.period or self.per_collective)

    @property
    def others_seconds_per_unit(self) -> float:
        return self.others_busy_share * (self.period or self.per_collective)

    @property
    def others_wait_per_unit(self) -> float:
        return self.others_wait_share * (self.period or self.per_collective)

    def persistent(self, ratio: float) -> bool:
        """Whether the window shows a persistent straggler at `ratio` (see the module docstring)."""
        return (
            self.collectives >= MIN_COLLECTIVES
            and self.decided >= MIN_DECIDED
            and (self.steps == 0 or self.steps >= MIN_STEPS)
            and self.last_share >= LAST_SHARE
            and self.ratio >= ratio
            and self.others_wait_share >= MIN_OTHERS_WAIT_SHARE
            and self.others_wait_per_unit >= MIN_WAIT_SECONDS
            and self.heavy_rounds >= MIN_HEAVY_ROUNDS
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "ranks": self.ranks,
            "ratio": round(self.ratio, 2),
            "unit": self.unit,
            "seconds_per_unit": round(self.seconds_per_unit, 4),
            "others_seconds_per_unit": round(self.others_seconds_per_unit, 4),
            "others_wait_per_unit": round(self.others_wait_per_unit, 4),
            "others_wait_share": round(self.others_wait_share, 4),
            "last_share": round(self.last_share, 3),
            "heavy_rounds": self.heavy_rounds,
            "percent_slower": round(100.0 * (self.ratio - 1.0), 1),
            "period": round(self.period, 4) if self.period else None,
            "collectives": self.collectives,
            "decided": self.decided,
            "steps": self.steps,
            "wait_site": self.wait_site,
            "window": [round(self.since, 3), round(self.until, 3)],
            "shares": {str(r): {k: round(v, 4) for k, v in s.items()} for r, s in self.shares.items()},
        }


def analyse(state: RunState, window: float = WINDOW) -> Finding | None:
    """The rank the others waited for most in the last `window` seconds of arrivals, or None."""
    live = _judged_ranks(state)
    if len(live) < 2:
        return None
    latest = max((a.enqueue for r in live for s in r.arrivals.values() for a in s.values()), default=None)
    if latest is None:
        return None
    since = latest - window
    rounds = _common_collectives(live, since)
    if len(rounds) < 2:
        return None
    start = min(min(t.values()) for t in rounds)
    end = max(max(t.values()) for t in rounds)
    span = end - start
    if span <= 0:
        return None
    lasts = [x for t in rounds if (x := _last_arrival(t)) is not None]  # ties decide nothing
    margins = sum(m for _, m in lasts)
    shares: dict[int, dict[str, float]] = {}
    for rank in live:
        intervals = [(t[rank.rank], max(t.values())) for t in rounds if rank.rank in t]
        # Weighted by how late: a rank last by 1 s at each step and one last by 2 ms at the
        # other collectives of the step are not equally the one everybody waits for.
        last = sum(m for r, m in lasts if r == rank.rank)
        wait = _union_length(intervals) / span
        shares[rank.rank] = {
            "wait": wait,
            "busy": max(0.0, 1.0 - wait),
            "last": last / margins if margins else 0.0,
        }
    group = _slow_set(shares, state.straggler_ratio)
    slow = group[0]
    # the slow set arrives as one: who of it is last by a hair at each call decides nothing
    merged = [x for t in rounds if (x := _last_arrival(_as_one(t, group))) is not None]
    merged_margins = sum(m for _, m in merged)
    others = [s for r, s in shares.items() if r not in group]
    others_busy = median(s["busy"] for s in others)
    steps, period = _steps_in(live, since, latest)
    own = [m for r, m in merged if r == slow]
    return Finding(
        rank=slow,
        ratio=min(shares[r]["busy"] for r in group) / max(others_busy, 0.01),
        busy_share=shares[slow]["busy"],
        others_busy_share=others_busy,
        others_wait_share=median(s["wait"] for s in others),
        last_share=sum(own) / merged_margins if merged_margins else 0.0,
        collectives=len(rounds),
        decided=len(merged),
        steps=steps,
        period=period,
        per_collective=span / len(rounds),
        wait_site=where_others_wait(state, slow, since),
        since=start,
        until=end,
        shares=shares,
        heavy_rounds=sum(1 for m in own if m >= 0.25 * max(own)) if own else 0,
        ranks=group,
    )


def _slow_set(shares: dict[int, dict[str, float]], ratio: float) -> list[int]:
    """The ranks the others wait for, slowest first: the slowest rank, and with it the next ones
    as long as each works `ratio` times the median of the ranks after it (at most half the ranks:
    a majority that is slower is the norm, not stragglers)."""
    order = sorted(shares, key=lambda r: (shares[r]["busy"], shares[r]["last"]), reverse=True)
    group = order[:1]
    for k in range(2, len(order) // 2 + 1):
        rest = median(shares[r]["busy"] for r in order[k:])
        if shares[order[k - 1]]["busy"] >= ratio * max(rest, 0.01):
            group = order[:k]
    return group


def _as_one(times: dict[int, float], group: list[int]) -> dict[int, float]:
    """A collective's arrivals with the slow set as one rank (its first), arriving with its last."""
    if len(group) < 2:
        return times
    merged = {r: t for r, t in times.items() if r not in group}
    together = [times[r] for r in group if r in times]
    if together:
        merged[group[0]] = max(together)
    return merged


def _judged_ranks(state: RunState) -> list[RankState]:
    """The live ranks; once fewer than two live (the run ended), every rank that left arrivals."""
    live = [r for r in state.ranks.values() if not r.exited]
    return live if len(live) >= 2 else [r for r in state.ranks.values() if r.arrivals]


def _common_collectives(live: list[RankState], since: float) -> list[dict[int, float]]:
    """Per collective since `since`, each arrival (enqueue) time of the live ranks that issued it:
    a subgroup's collectives count among its members. A rank that waits for a slow peer in a
    subgroup (its data-parallel pair) then reaches the world's collectives as late as that peer;
    only the subgroup's collective shows which of the two the others waited for."""
    rounds = []
    for pg in set().union(*(r.arrivals for r in live)):
        if pg.endswith(":p2p"):
            continue  # numbered per rank over all its peers: equal numbers need not be one call
        members = [r for r in live if pg in r.arrivals]
        if len(members) < 2:
            continue
        for seq in set.intersection(*(set(r.arrivals[pg]) for r in members)):
            times = {r.rank: r.arrivals[pg][seq].enqueue for r in members}
            if min(times.values()) >= since:
                rounds.append(times)
    return rounds


def _last_arrival(times: dict[int, float], tie: float = 0.001) -> tuple[int, float] | None:
    """The rank that arrived last and by how much before the next latest, if by more than `tie`
    seconds (else nobody)."""
    order = sorted(times, key=lambda r: times[r])
    margin = times[order[-1]] - times[order[-2]] if len(order) >= 2 else 0.0
    return (order[-1], margin) if margin > tie else None


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, None
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if reach is None or a > reach:
            total += b - a
            reach = b
        elif b > reach:
            total += b - reach
            reach = b
    return total


def _steps_in(live: list[RankState], since: float, until: float) -> tuple[int, float | None]:
    """Steps finished in the window (fewest over the ranks) and the median seconds per step."""
    counts, periods = [], []
    for rank in live:
        times = [t for t, *_ in rank.steps if since <= t <= until + 1.0]
        counts.append(len(times))
        if len(times) >= 2:
            periods.append((times[-1] - times[0]) / (len(times) - 1))
    if not counts or min(counts) == 0:
        return 0, None
    return min(counts), (median(periods) if periods else None)


def where_others_wait(state: RunState, slow: int, since: float) -> str | None:
    """The straggler's call site of the collectives the others waited longest in for it.

    Sums, per call site of the straggler, how much later it entered than the others (median) over
    the collectives sighted on every live rank: a program issues several collectives per step, and
    the one right after the slow part is where the waiting happens, not the most frequent one.
    """
    live = _judged_ranks(state)
    me = state.ranks[slow]
    others = [r for r in live if r.rank != slow]
    if me not in live or not others:
        return None
    waits: dict[str, float] = {}
    for pg, sightings in me.arrivals.items():
        for seq, mine in sightings.items():
            if not mine.caller or mine.enqueue < since:
                continue
            theirs = [r.arrivals.get(pg, {}).get(seq) for r in others]
            if any(a is None for a in theirs):
                continue
            late = mine.enqueue - median(a.enqueue for a in theirs if a is not None)
            if late > 0:
                waits[mine.caller] = waits.get(mine.caller, 0.0) + late
    return max(waits, key=lambda c: waits[c]) if waits else None


def snapshot_hot_line(rank: RankState, since: float) -> dict[str, Any] | None:
    """Where the rank's time goes, from where its state snapshots saw its main thread since
    `since` (about one a second): a cause as py-spy's samples give one (`location`, `function`,
    `share`, `samples`) with `source: "snapshots"`; None when fewer than MIN_SNAPSHOT_SAMPLES."""
    seen = Counter((at, function) for t, at, function in list(rank.positions) if t >= since)
    total = sum(seen.values())
    if total < MIN_SNAPSHOT_SAMPLES:
        return None
    (at, function), count = seen.most_common(1)[0]
    return {
        "location": at,
        "function": function,
        "share": count / total,
        "samples": total,
        "source": "snapshots",
    }


# -- persistence ------------------------------------------------------------------------------------


@dataclass
class Episode:
    """A declared straggler: from when the evidence held, its latest figures and its hot line."""

    rank: int
    since: float
    declared: float
    finding: Finding
    last_seen: float
    cause: dict[str, Any] | None = None
    cause_problem: str | None = None
    ready: bool = False  # its hot line was sampled (or could not be): the verdict may be shown

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "since": self.since,
            "declared": self.declared,
            "last_seen": self.last_seen,
            "finding": self.finding.to_dict(),
            "cause": self.cause,
            "cause_problem": self.cause_problem,
        }


class StragglerTracker:
    """Declares a straggler once its window evidence has held long enough; keeps the episodes."""

    def __init__(self, confirm_seconds: float = CONFIRM_SECONDS, confirm_steps: int = CONFIRM_STEPS) -> None:
        self.confirm_seconds = confirm_seconds
        self.confirm_steps = confirm_steps
        self.episodes: dict[int, Episode] = {}
        #: the slow set, first seen, its slowest rank's step count then
        self._candidate: tuple[tuple[int, ...], float, int] | None = None

    def _episode_of(self, finding: Finding) -> Episode | None:
        """The episode of a rank of the finding's slow set: equally slow ranks trade places as the
        slowest, and the set may grow as a second rank slows down, but it is one episode."""
        ranks = set(finding.ranks)
        return next((e for e in self.episodes.values() if ranks & set(e.finding.ranks)), None)

    def update(self, state: RunState, now: float | None = None) -> Episode | None:
        """Judge the current window; returns an episode when it is declared at this call."""
        now = time.time() if now is None else now
        finding = analyse(state)
        if finding is None or not finding.persistent(state.straggler_ratio):
            self._candidate = None
            return None
        rank, ranks = finding.rank, tuple(sorted(finding.ranks))
        steps_now = state.ranks[rank].step_count
        episode = self._episode_of(finding)
        if episode is not None:
            episode.finding, episode.last_seen = finding, now
            return None
        if self._candidate is None or self._candidate[0] != ranks:
            self._candidate = (ranks, now, steps_now)
            return None
        _, first, steps_then = self._candidate
        enough_steps = finding.steps == 0 or steps_now - steps_then >= self.confirm_steps
        if now - first < self.confirm_seconds or not enough_steps:
            return None
        episode = Episode(rank=rank, since=finding.since, declared=now, finding=finding, last_seen=now)
        self.episodes[rank] = episode
        return episode

    def final(self, state: RunState, now: float | None = None) -> Episode | None:
        """At the end of the run: a straggler that held over the whole last window but had no time to
        be confirmed (a short job) is declared now, without samples (the rank is gone)."""
        now = time.time() if now is None else now
        finding = analyse(state)
        if finding is None or not finding.persistent(state.straggler_ratio) or self._episode_of(finding):
            return None
        episode = Episode(
            rank=finding.rank,
            since=finding.since,
            declared=now,
            finding=finding,
            last_seen=now,
            cause=snapshot_hot_line(state.ranks[finding.rank], finding.since),
            cause_problem="the run ended before the straggler could be sampled",
            ready=True,
        )
        self.episodes[finding.rank] = episode
        return episode


# -- verdicts ---------------------------------------------------------------------------------------


def diagnose_straggler(state: RunState) -> list[Verdict]:
    """The straggler verdicts: the tracker's episodes when a supervisor keeps them (live, and in its
    final report), else what the last window shows (a run directory read after the fact)."""
    if state.straggler_episodes is not None:
        return [episode_verdict(state, e) for e in state.straggler_episodes]
    finding = analyse(state)
    if finding is None or not finding.persistent(state.straggler_ratio):
        return []
    return [verdict_for(state, finding, cause=None)]


def episode_verdict(state: RunState, episode: dict[str, Any]) -> Verdict:
    """A verdict from an `Episode.to_dict()` record."""
    data = episode.get("finding") or {}
    verdict = _verdict(state, data, episode.get("cause"), episode.get("cause_problem"))
    verdict.details.update(
        since=episode.get("since"), declared=episode.get("declared"), last_seen=episode.get("last_seen")
    )
    return verdict


def verdict_for(state: RunState, finding: Finding, cause: dict[str, Any] | None) -> Verdict:
    return _verdict(state, finding.to_dict(), cause, None)


LOADER_ADVICE = (
    "rank {rank} waits for its DataLoader: its data comes later than the others' (a slower disk or "
    "network share on its node, costlier samples in its shard, fewer CPU cores free for its "
    "workers); more num_workers, data on local storage, or cached latents take the loading off the step"
)


def _line_text(cause: dict[str, Any]) -> str:
    """'file:line in function()' of a sampled hot line."""
    return str(cause["location"]) + (f" in {cause['function']}()" if cause.get("function") else "")


def _verdict(
    state: RunState, data: dict[str, Any], cause: dict[str, Any] | None, cause_problem: str | None
) -> Verdict:
    rank = int(data.get("rank", -1))
    ranks = [int(r) for r in data.get("ranks") or [rank]]
    unit = data.get("unit") or "step"
    mine = float(data.get("seconds_per_unit") or 0.0)
    theirs = float(data.get("others_seconds_per_unit") or 0.0)
    slower = float(data.get("percent_slower") or 0.0)
    wait_share = float(data.get("others_wait_share") or 0.0)
    ratio = float(data.get("ratio") or 0.0)
    if len(ranks) > 1:
        together = ", ".join(str(r) for r in sorted(ranks))
        summary = (
            f"stragglers: ranks {together} are each slower than the others: rank {rank}, the slowest, "
            f"works {mine:.3f} s per {unit} where the median other rank works {theirs:.3f} s (the least "
            f"slow of them {ratio:.1f}x); the others spend {100 * wait_share:.0f}% of their time waiting "
            "for them"
        )
    else:
        summary = (
            f"straggler: rank {rank} works {mine:.3f} s per {unit} where the median rank works {theirs:.3f} s "
            f"({ratio:.1f}x, {slower:.0f}% longer); the others spend {100 * wait_share:.0f}% of their time "
            "waiting for it"
        )
    location = None
    share = float((cause or {}).get("share") or 0.0)
    if cause and cause.get("location") and share < MIN_CAUSE_SHARE:
        # a line few samples share says little of where the straggler's time goes (its samples
        # came after its slow part, as the job ended): the wait site stands instead
        cause_problem = cause_problem or (
            f"the busiest line of the user's code, {cause['location']}, held only {100 * share:.0f}% of "
            f"its {cause.get('samples')} samples"
        )
        cause = None
    if cause and cause.get("location"):
        location = cause["location"]
        samples = (
            f"{cause.get('samples')} state snapshots" if cause.get("source") == "snapshots" else "samples"
        )
        whose = "its" if len(ranks) == 1 else f"rank {rank}'s"
        summary += f"; {whose} time goes at {_line_text(cause)} ({100 * share:.0f}% of its {samples})"
        if cause.get("waits_for") == "dataloader":
            summary += ", waiting for its DataLoader workers"
            worker = cause.get("worker") or {}
            worker_share = float(worker.get("share") or 0.0)
            if worker.get("location") and worker_share >= MIN_CAUSE_SHARE:
                location = worker["location"]  # the line that makes the data late
                summary += (
                    f", whose time goes at {_line_text(worker)} ({100 * worker_share:.0f}% of their samples)"
                )
    wait_site = data.get("wait_site")
    if wait_site:
        summary += f"; they wait for {'it' if len(ranks) == 1 else 'them'} at {wait_site}"
    location = location or wait_site
    evidence = [
        f"rank {r}: waits for others {100 * s.get('wait', 0):.0f}% of the time; {100 * s.get('last', 0):.0f}% "
        f"of the waiting for a last rank was for it ({data.get('decided')} of {data.get('collectives')} "
        "collectives had a clear last rank)"
        for r, s in sorted((data.get("shares") or {}).items(), key=lambda kv: int(kv[0]))
    ]
    if data.get("period"):
        evidence.append(f"{data.get('steps')} steps in the window, {float(data['period']):.3f} s per step")
    if cause and cause.get("source") == "snapshots":
        evidence.append(
            "its line is where its state snapshots (about one a second) saw its main thread"
            + (f"; py-spy took no samples: {cause_problem}" if cause_problem else "")
        )
    elif cause_problem:
        evidence.append(f"no line of the straggler's own time: {cause_problem}")
    if cause and cause.get("waits_for") == "dataloader":
        evidence.append(LOADER_ADVICE.format(rank=rank))
    fault = fault_of(state.ranks[rank], ("sleep",)) if rank in state.ranks else None
    if fault:
        evidence.append(
            f"injected fault {fault.get('fault')!r} fired on rank {rank} at {fault.get('caller')}"
        )
        location = location or fault.get("caller")
    details = {**data, "threshold": state.straggler_ratio, "cause": cause}
    if cause is None and cause_problem:
        details["cause_problem"] = cause_problem
    return Verdict("straggler", "warning", summary, rank, location, details, evidence)
