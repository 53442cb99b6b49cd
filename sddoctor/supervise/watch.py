"""The watcher: turns the run directory (and what the process tree says) into a `RunState`.

Called about once a second. Cheap: each rank's state file is one small JSON read and each
event log is tailed from where the last poll stopped.
"""

from __future__ import annotations

import re
import time
from typing import Any

from sddoctor.supervise.facts import apply_facts
from sddoctor.supervise.fatal_dump import read_fatal_dump
from sddoctor.supervise.state import Arrival, RankState, RunState
from sddoctor.telemetry import EventTail, RunDir, read_json, read_state
from sddoctor.telemetry.runinfo import RunOptions, read_run_info
from sddoctor.telemetry.snapshot import Collective, StepRecord
from sddoctor.telemetry.timeline import decode_calls, timeline_file

#: Event kinds the diagnosis keeps (steps and summaries are only counted).
_KEPT = {"exception", "oom", "fallback", "fault", "exit", "start", "warning", "replicas", "internal_error"}
_MAX_SIGHTINGS = 4096  # per rank and pg: the straggler window (60 s) of a busy DDP job
_MAX_STEPS = 4096  # per rank: recent step events kept for step-time statistics
_MAX_POSITIONS = 600  # per rank: where its last snapshots (about one a second) saw its main thread
#: A rank whose main thread used at least this share of a core between two snapshots is computing
#: (one blocked in a lock, a read or a sleep uses next to none; a busy one on a crowded machine
#: still gets far more than this).
COMPUTING_CPU_SHARE = 0.3
#: ... as long as that was seen this recently (seconds): a rank whose snapshots stop is not.
COMPUTING_FRESH_S = 3.0


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
        #: exit statuses an mp.spawn parent saw of its workers (exit-PID), by pid
        self.worker_exits: dict[int, dict[str, Any]] = {}
        #: pid -> the exception of an mp.spawn worker that failed before it became a rank
        self.worker_exceptions: dict[int, dict[str, Any]] = {}
        self._procs_seen: set[str] = set()
        self.ranks: dict[int, RankState] = {}
        self._tails: dict[int, EventTail] = {}
        self._timelines: dict[int, EventTail] = {}  # when each rank arrived at each collective
        self._fatal_sizes: dict[int, int] = {}  # size of each rank's fatal-signal file when last read
        self._progress_key: dict[int, Any] = {}
        self._last_state_t: dict[int, float] = {}
        self._last_cpu: dict[int, tuple[float, float]] = {}  # rank -> (snapshot t, main_cpu_s)
        self.last_progress: float | None = None
        self.world_size: int | None = None
        #: what the launcher's options say of the world size (run.json, written before the job starts)
        self.launcher_world_size: int | None = read_run_info(run_dir).world_size

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
                    sighted = Collective.of(call)
                    self._sight(rank, sighted, enqueue=float(call["t0"]), duration=sighted.duration)
            snapshot = read_state(self.run_dir.state_file(rank_id))
            if snapshot is not None:
                self._on_snapshot(rank, snapshot, now)
            self._read_fatal_dump(rank)
        self._note_computing(now)

    def _read_fatal_dump(self, rank: RankState) -> None:
        """Read the rank's fatal-signal file again whenever it grew (faulthandler appends to it)."""
        path = self.run_dir.fatal_file(rank.rank)
        try:
            size = path.stat().st_size
        except OSError:
            return
        if size == 0 or self._fatal_sizes.get(rank.rank) == size:
            return
        self._fatal_sizes[rank.rank] = size
        dump = read_fatal_dump(path)
        if dump is not None:
            rank.fatal = dump.to_dict()

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
            elif name.startswith("exit-") and isinstance(note.get("exitcode"), int):
                self.worker_exits[note["pid"]] = note
            elif name.startswith("exc-"):
                self.worker_exceptions[note["pid"]] = note

    def _pids_of_ranks(self) -> dict[int, int]:
        by_pid: dict[int, int] = {}
        for rank in self.ranks.values():
            for pid in (*(a.get("pid") for a in rank.attempts), rank.pid):
                if isinstance(pid, int):
                    by_pid[pid] = rank.rank
        return by_pid

    def unjoined_failures(self) -> list[dict[str, Any]]:
        """mp.spawn workers that failed before they became ranks (before init_process_group): their
        spawn index, exit status, whether torch blamed them first, and their exception if noted."""
        ranks = self._pids_of_ranks()
        failures = []
        for pid, note in sorted(self.worker_exits.items()):
            if note["exitcode"] == 0 or pid in ranks:
                continue
            started = self.proc_notes.get(pid) or {}
            failure = {
                "pid": pid,
                "spawn_index": note.get("spawn_index"),
                "exitcode": note["exitcode"],
                "root_cause": note.get("first") is True,
                "t": note.get("t"),
                "spawned_at": started.get("spawned_at"),
            }
            exc = self.worker_exceptions.get(pid)
            if exc:
                failure["exception"] = {
                    k: exc.get(k) for k in ("type", "message", "traceback", "caller", "t")
                }
            failures.append(failure)
        return failures

    def spawn_failures(self) -> list[dict[str, Any]]:
        """The failed workers an mp.spawn parent saw end, as torchrun's failure summary reads
        (`parse_launcher_failures`): the real exit status of a rank that sddoctor is not the parent
        of. The worker torch blamed first is the root cause."""
        by_pid = self._pids_of_ranks()
        failures = []
        for pid, note in sorted(self.worker_exits.items()):
            if note["exitcode"] == 0 or pid not in by_pid:
                continue
            failures.append(
                {
                    "rank": by_pid[pid],
                    "local_rank": note.get("spawn_index"),
                    "exitcode": note["exitcode"],
                    "pid": pid,
                    "root_cause": note.get("first") is True,
                    "source": "mp.spawn",
                }
            )
        return failures

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
        self._note_computing(now)

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
            if isinstance(event.get("caller"), str):
                info["caller"] = event["caller"]  # where sys.exit(failure) was called
            if isinstance(event.get("handled_error"), dict):  # what the program caught before a clean end
                info["handled_error"] = {
                    k: event["handled_error"].get(k) for k in ("type", "message", "caller", "t")
                }
            if isinstance(event.get("at"), str):  # where SIGTERM found the main thread
                info.update({k: event[k] for k in ("at", "at_function", "stack") if k in event})
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
            if isinstance(event.get("comm_env"), dict):
                rank.comm_env = {str(k): str(v) for k, v in event["comm_env"].items()}
            if isinstance(event.get("spawned_at"), str):
                rank.spawned_at = event["spawned_at"]
            if isinstance(event.get("world_size"), int):
                self.world_size = event["world_size"]
            pid = event.get("pid")
            if isinstance(pid, int):
                if rank.pid is not None and pid != rank.pid and _is_restart(rank, event):
                    rank.restart(pid)
                rank.pid = rank.pid or pid
            rank.host = event.get("host") or rank.host

    @staticmethod
    def _on_step(rank: RankState, event: dict[str, Any]) -> None:
        step = StepRecord.of(event)
        if step.t is None or step.step is None:
            return
        rank.steps.append((step.t, step.step, step.step_time, step.samples))
        rank.step_count += 1
        if len(rank.steps) > _MAX_STEPS:
            del rank.steps[: len(rank.steps) - _MAX_STEPS]

    def _on_snapshot(self, rank: RankState, snap: dict[str, Any], now: float) -> None:
        rank.state = snap
        s = rank.snapshot
        if s.pid is not None and rank.pid is None:
            rank.pid = s.pid
        rank.host = s.host or rank.host
        if s.world_size is not None:
            self.world_size = s.world_size
        if s.t is not None and self._last_state_t.get(rank.rank) == s.t:
            return  # the same snapshot as last time
        if s.t is not None:
            self._last_state_t[rank.rank] = s.t
            self._note_cpu(rank, s.t, s.main_cpu_s, now)
            if s.main_at is not None:
                rank.positions.append((s.t, s.main_at, s.main_function))
                del rank.positions[: len(rank.positions) - _MAX_POSITIONS]
        for c in s.inflight:
            self._sight(rank, c, enqueue=c.since, duration=None)
        done = s.last_done
        if done is not None:
            self._sight(rank, done, enqueue=done.enqueued, duration=done.duration)
        key = (
            s.step,
            tuple(sorted(s.issued.items())),
            done.seq if done else None,
            done.t if done else None,
            s.ddp_buckets,
            tuple(sorted((c.pg, c.seq or 0) for c in s.inflight)),
        )
        if self._progress_key.get(rank.rank) != key:
            if rank.rank in self._progress_key:
                self.last_progress = now
            self._progress_key[rank.rank] = key
            if self.last_progress is None:
                self.last_progress = now

    def _note_cpu(self, rank: RankState, t: float, cpu_s: float | None, now: float) -> None:
        """Mark `rank` computing when its main thread's CPU clock ran fast enough since its last snapshot."""
        previous = self._last_cpu.get(rank.rank)
        if cpu_s is None:
            return
        self._last_cpu[rank.rank] = (t, cpu_s)
        if previous is not None and t > previous[0]:
            if (cpu_s - previous[1]) / (t - previous[0]) >= COMPUTING_CPU_SHARE:
                rank.computing_seen = now

    def _note_computing(self, now: float) -> None:
        """Every rank computing is progress: a long evaluation or data pass that issues no
        collective and ends no step on any rank is work, not a hang. Computing means each live
        rank's main thread keeps a core busy (`COMPUTING_CPU_SHARE`, from its snapshots), while
        none is inside a collective or waits in a store. A main thread blocked in a lock, a pipe or
        a sleep uses no CPU (whatever its other threads do), and the job stays stalled."""
        live = [r for r in self.ranks.values() if not r.exited]
        if not live or (self.world_size is not None and len(self.ranks) < self.world_size):
            return
        for r in live:
            if r.computing_seen is None or now - r.computing_seen > COMPUTING_FRESH_S:
                return
            snap = r.snapshot
            if snap.waiting or any(c.holds_the_rank for c in snap.inflight):
                return
        self.last_progress = now

    def _sight(
        self, rank: RankState, c: Collective, *, enqueue: float | None, duration: float | None
    ) -> None:
        if c.seq is None or enqueue is None:
            return
        sightings = rank.arrivals.setdefault(c.pg, {})
        known = sightings.get(c.seq)
        if known is None:
            sightings[c.seq] = Arrival(
                enqueue=enqueue, op=c.op, shapes=c.shapes, caller=c.caller, duration=duration
            )
            if len(sightings) > _MAX_SIGHTINGS:
                for old in sorted(sightings)[: len(sightings) - _MAX_SIGHTINGS]:
                    del sightings[old]
        elif known.duration is None and duration is not None:
            known.duration = duration

    def state(self, now: float | None = None, facts: dict[str, Any] | None = None) -> RunState:
        """The run at `now` as its files (and what was merged into `ranks`) show it; with `facts`
        (a supervisor.json record, live or read back) also what only the supervisor saw. The one
        builder of RunState: `sddoctor run` and the offline diagnosis both use it."""
        now = time.time() if now is None else now
        state = RunState(
            now=now,
            started=self.started,
            ranks=self.ranks,
            world_size=self.world_size,
            last_progress=self.last_progress,
            hang_timeout=self.options.hang_timeout,
            straggler_ratio=self.options.straggler_ratio,
            startup_timeout=self.options.startup_timeout,
            spawned_nprocs=self.spawned_nprocs,
            launcher_world_size=self.launcher_world_size,
            unjoined_failures=self.unjoined_failures(),
        )
        if facts is not None:
            apply_facts(state, facts)
        return state


_FAILURE_BLOCK = re.compile(
    r"rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*(?P<local>\d+)\)\s*\n\s*exitcode\s*:\s*(?P<code>-?\d+)\s*\(pid:\s*(?P<pid>\d+)\)",
)


def _is_restart(rank: RankState, start: dict[str, Any]) -> bool:
    """Whether a `start` event of another pid is a new process of the rank (a launcher restart),
    not a second writer of the same process's start: the earlier process has ended, or the
    launcher says this is a restart (TORCHELASTIC_RESTART_COUNT, recorded as `restart`)."""
    restart = start.get("restart")
    return rank.process_ended or (isinstance(restart, int) and restart > 0)


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
