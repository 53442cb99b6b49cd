"""The watcher: turns the run directory (and what the process tree says) into a `RunState`.

Called about once a second. Cheap: each rank's state file is one small JSON read and each
event log is tailed from where the last poll stopped.
"""

from __future__ import annotations

import re
import time
from typing import Any

from sddoctor.supervise.state import Arrival, RankState, RunState
from sddoctor.telemetry import EventTail, RunDir, read_json, read_state
from sddoctor.telemetry.runinfo import RunOptions
from sddoctor.telemetry.timeline import decode_calls, timeline_file

#: Event kinds the diagnosis keeps (steps and summaries are only counted).
_KEPT = {"exception", "oom", "fallback", "fault", "exit", "start", "warning", "replicas", "internal_error"}
_MAX_SIGHTINGS = 4096  # per rank and pg: the straggler window (60 s) of a busy DDP job
_MAX_STEPS = 4096  # per rank: recent step events kept for step-time statistics


class Watcher:
    """Incremental reader of one run directory."""

    def __init__(
        self,
        run_dir: RunDir,
        *,
        started: float,
        options: RunOptions = RunOptions(),
    ) -> None:
        self.run_dir = run_dir
        self.started = started
        self.options = options
        #: from RUN_DIR/procs/: mp.spawn parents (launcher-PID) and workers (pid-PID)
        self.spawned_nprocs: int | None = None
        self.spawner_pids: set[int] = set()
        self.proc_notes: dict[int, dict[str, Any]] = {}
        self._procs_seen: set[str] = set()
        self.ranks: dict[int, RankState] = {}
        self._tails: dict[int, EventTail] = {}
        self._timelines: dict[int, EventTail] = {}  # when each rank arrived at each collective
        self._progress_key: dict[int, Any] = {}
        self._last_state_t: dict[int, float] = {}
        self.last_progress: float | None = None
        self.world_size: int | None = None

    def _rank(self, rank: int) -> RankState:
        if rank not in self.ranks:
            self.ranks[rank] = RankState(rank=rank)
        return self.ranks[rank]

    def poll(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self._read_proc_notes()
        for rank_id in self.run_dir.ranks():
            rank = self._rank(rank_id)
            tail = self._tails.setdefault(rank_id, EventTail(self.run_dir.events_file(rank_id)))
            for event in tail.poll():
                self._on_event(rank, event, now)
            timeline = self._timelines.setdefault(rank_id, EventTail(timeline_file(self.run_dir, rank_id)))
            for line in timeline.poll():
                for call in decode_calls(line):
                    self._sight(rank, call, enqueue=call.get("t0"), duration=call.get("duration"))
            snapshot = read_state(self.run_dir.state_file(rank_id))
            if snapshot is not None:
                self._on_snapshot(rank, snapshot, now)

    def _read_proc_notes(self) -> None:
        """Notes of mp.spawn parents and workers (see sddoctor.instrument.spawn); each read once."""
        folder = self.run_dir.path / "procs"
        try:
            names = sorted(p.name for p in folder.iterdir() if p.suffix == ".json")
        except OSError:
            return
        for name in names:
            if name in self._procs_seen:
                continue
            self._procs_seen.add(name)
            note = read_json(folder / name)
            if not isinstance(note, dict) or not isinstance(note.get("pid"), int):
                continue
            if name.startswith("launcher-"):
                self.spawner_pids.add(note["pid"])
                if isinstance(note.get("nprocs"), int):
                    self.spawned_nprocs = (self.spawned_nprocs or 0) + note["nprocs"]
            elif name.startswith("pid-"):
                self.proc_notes[note["pid"]] = note

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
            self.last_progress = now
            self._on_step(rank, event)
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
        elif kind == "internal_error":
            rank.internal_errors.append(event)
            del rank.internal_errors[:-20]
        elif kind == "start":
            if isinstance(event.get("code_roots"), dict):
                rank.code_roots = event["code_roots"]
            if isinstance(event.get("world_size"), int):
                self.world_size = event["world_size"]
            if isinstance(event.get("pid"), int):
                rank.pid = rank.pid or event["pid"]
            rank.host = event.get("host") or rank.host

    @staticmethod
    def _on_step(rank: RankState, event: dict[str, Any]) -> None:
        t, step = event.get("t"), event.get("step")
        if not isinstance(t, (int, float)) or not isinstance(step, int):
            return
        step_time = event.get("step_time")
        samples = event.get("samples")
        rank.steps.append(
            (
                float(t),
                step,
                float(step_time) if isinstance(step_time, (int, float)) else None,
                float(samples) if isinstance(samples, (int, float)) else None,
            )
        )
        rank.step_count += 1
        if len(rank.steps) > _MAX_STEPS:
            del rank.steps[: len(rank.steps) - _MAX_STEPS]

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
        ddp = colls.get("ddp")
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
            hang_timeout=self.options.hang_timeout,
            straggler_ratio=self.options.straggler_ratio,
            startup_timeout=self.options.startup_timeout,
            spawned_nprocs=self.spawned_nprocs,
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
