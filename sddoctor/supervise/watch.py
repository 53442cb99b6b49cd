"""The watcher: turns the run directory (and what the process tree says) into a `RunState`.

Called about once a second. Cheap: each rank's state file is one small JSON read and each
event log is tailed from where the last poll stopped.
"""

from __future__ import annotations

import re
import time
from typing import Any

from sddoctor.supervise.state import Arrival, RankState, RunState
from sddoctor.telemetry import EventTail, RunDir, read_state

#: Event kinds the diagnosis keeps (steps and summaries are only counted).
_KEPT = {"exception", "oom", "fallback", "fault", "exit", "start", "warning", "replicas"}
_MAX_SIGHTINGS = 600  # per rank and pg: enough for a few minutes of straggler statistics


class Watcher:
    """Incremental reader of one run directory."""

    def __init__(
        self, run_dir: RunDir, *, hang_timeout: float, straggler_ratio: float, started: float
    ) -> None:
        self.run_dir = run_dir
        self.started = started
        self.hang_timeout = hang_timeout
        self.straggler_ratio = straggler_ratio
        self.ranks: dict[int, RankState] = {}
        self._tails: dict[int, EventTail] = {}
        self._progress_key: dict[int, Any] = {}
        self._last_state_t: dict[int, float] = {}
        self.last_progress: float | None = None
        self.world_size: int | None = None
        self.steps_seen = 0

    def _rank(self, rank: int) -> RankState:
        if rank not in self.ranks:
            self.ranks[rank] = RankState(rank=rank)
        return self.ranks[rank]

    def poll(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for rank_id in self.run_dir.ranks():
            rank = self._rank(rank_id)
            tail = self._tails.setdefault(rank_id, EventTail(self.run_dir.events_file(rank_id)))
            for event in tail.poll():
                self._on_event(rank, event, now)
            snapshot = read_state(self.run_dir.state_file(rank_id))
            if snapshot is not None:
                self._on_snapshot(rank, snapshot, now)

    def merge_remote(self, ranks: dict[str, Any], now: float) -> None:
        """Ranks served by another node's supervisor (`--peers`): their snapshots, exits and stacks."""
        for key, snap in ranks.items():
            try:
                rank_id = int(key)
            except ValueError:
                continue
            if not isinstance(snap, dict) or rank_id in self._tails:
                continue  # our own ranks come from our run dir
            rank = self._rank(rank_id)
            self._on_snapshot(rank, {k: v for k, v in snap.items() if k not in ("exit", "exception")}, now)
            if isinstance(snap.get("exit"), dict):
                rank.exit = snap["exit"]
            if isinstance(snap.get("exception"), dict):
                rank.exception = snap["exception"]
            if isinstance(snap.get("stack"), dict) and snap["stack"].get("ok"):
                rank.stack = snap["stack"]  # taken by that node's supervisor
            for name in ("faults",):
                if isinstance(snap.get(name), list):
                    rank.faults = snap[name]
            rank.alive = None if rank.exit is None else False
            rank.remote = True

    def _on_event(self, rank: RankState, event: dict[str, Any], now: float) -> None:
        kind = event.get("kind")
        if kind == "step":
            self.steps_seen += 1
            self.last_progress = now
        if kind not in _KEPT:
            return
        if kind == "exception":
            rank.exception = event
        elif kind == "oom":
            rank.ooms.append(event)
        elif kind == "fallback":
            rank.fallbacks.append(event)
        elif kind == "fault":
            rank.faults.append(event)
        elif kind == "warning":
            rank.warnings.append(event)
            del rank.warnings[:-50]
        elif kind == "replicas":
            rank.replicas.append(event)
            del rank.replicas[:-10]
        elif kind == "exit":
            status = event.get("status")
            code = event.get("code")
            info: dict[str, Any] = {"t": event.get("t"), "source": "exit event", "status": status}
            if isinstance(code, int):
                if status == "signal" and code > 128:
                    info["signal"] = code - 128  # written as 128 + signal number
                else:
                    info["code"] = code
            rank.exit = {**info, **(rank.exit or {})} if rank.exit else info
        elif kind == "start":
            if isinstance(event.get("world_size"), int):
                self.world_size = event["world_size"]
            if isinstance(event.get("pid"), int):
                rank.pid = rank.pid or event["pid"]
            rank.host = event.get("host") or rank.host

    def _on_snapshot(self, rank: RankState, snap: dict[str, Any], now: float) -> None:
        rank.state = snap
        if isinstance(snap.get("pid"), int) and rank.pid is None:
            rank.pid = snap["pid"]
        rank.host = snap.get("host") or rank.host
        if isinstance(snap.get("world_size"), int):
            self.world_size = snap["world_size"]
        t = snap.get("t")
        if isinstance(t, (int, float)) and self._last_state_t.get(rank.rank) == t:
            return  # the same snapshot as last time
        if isinstance(t, (int, float)):
            self._last_state_t[rank.rank] = t
        colls = rank.collectives
        for c in rank.inflight:
            self._sight(rank, c, enqueue=c.get("since"), duration=None)
        done = rank.last_done
        if done:
            dur = done.get("duration")
            end = done.get("t")
            enqueue = done.get("since")
            if enqueue is None and isinstance(end, (int, float)) and isinstance(dur, (int, float)):
                enqueue = end - dur
            self._sight(rank, done, enqueue=enqueue, duration=dur)
        for c in colls.get("recent") or []:
            if isinstance(c, dict):
                self._sight(rank, c, enqueue=c.get("since"), duration=c.get("duration"))
        ddp = colls.get("ddp")
        totals = colls.get("totals")
        if (
            isinstance(totals, dict)
            and isinstance(t, (int, float))
            and isinstance(totals.get("count"), (int, float))
        ):
            rank.totals_samples.append(
                (float(t), float(totals["count"]), float(totals.get("seconds") or 0.0))
            )
            del rank.totals_samples[:-120]
        step = snap.get("step")
        if isinstance(ddp, dict) and isinstance(t, (int, float)) and isinstance(step, (int, float)):
            rank.ddp_samples.append(
                (float(t), float(ddp.get("buckets") or 0), float(ddp.get("seconds") or 0.0), float(step))
            )
            del rank.ddp_samples[:-120]
        key = (
            snap.get("step"),
            tuple(sorted((str(k), v) for k, v in (colls.get("issued") or {}).items()))
            if isinstance(colls.get("issued"), dict)
            else None,
            (done or {}).get("seq"),
            (done or {}).get("t"),
            (ddp or {}).get("buckets") if isinstance(ddp, dict) else None,
            tuple(sorted((str(c.get("pg")), c.get("seq")) for c in rank.inflight)),
        )
        if self._progress_key.get(rank.rank) != key:
            if rank.rank in self._progress_key:
                self.last_progress = now
            self._progress_key[rank.rank] = key
            if self.last_progress is None:
                self.last_progress = now

    def _sight(self, rank: RankState, c: dict[str, Any], *, enqueue: Any, duration: Any) -> None:
        seq = c.get("seq")
        if not isinstance(seq, int) or not isinstance(enqueue, (int, float)):
            return
        pg = str(c.get("pg"))
        sightings = rank.arrivals.setdefault(pg, {})
        known = sightings.get(seq)
        if known is None:
            sightings[seq] = Arrival(
                enqueue=float(enqueue),
                op=c.get("op"),
                shapes=c.get("shapes"),
                caller=c.get("caller"),
                duration=float(duration) if isinstance(duration, (int, float)) else None,
            )
            if len(sightings) > _MAX_SIGHTINGS:
                for old in sorted(sightings)[: len(sightings) - _MAX_SIGHTINGS]:
                    del sightings[old]
        elif known.duration is None and isinstance(duration, (int, float)):
            known.duration = float(duration)

    def state(self, now: float | None = None) -> RunState:
        now = time.time() if now is None else now
        return RunState(
            now=now,
            started=self.started,
            ranks=self.ranks,
            world_size=self.world_size,
            last_progress=self.last_progress,
            hang_timeout=self.hang_timeout,
            straggler_ratio=self.straggler_ratio,
        )


_FAILURE_BLOCK = re.compile(
    r"rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*(?P<local>\d+)\)\s*\n\s*exitcode\s*:\s*(?P<code>-?\d+)\s*\(pid:\s*(?P<pid>\d+)\)",
)


def parse_launcher_failures(lines: list[str]) -> list[dict[str, Any]]:
    """torchrun's (and accelerate's) failure summary: [{rank, local_rank, exitcode, pid, root_cause}]."""
    text = "\n".join(lines)
    root_at = text.rfind("Root Cause")
    failures: dict[int, dict[str, Any]] = {}
    for m in _FAILURE_BLOCK.finditer(text):
        rank = int(m.group("rank"))
        entry = failures.setdefault(
            rank,
            {
                "rank": rank,
                "local_rank": int(m.group("local")),
                "exitcode": int(m.group("code")),
                "pid": int(m.group("pid")),
                "root_cause": False,
            },
        )
        if root_at >= 0 and m.start() > root_at:
            entry["root_cause"] = True
    return sorted(failures.values(), key=lambda f: f["rank"])
