"""What the supervisor knows about a run at one instant: the input of the pure diagnosis.

`RunState` is plain data. The watcher (`sddoctor.supervise.watch`) fills it from the run
directory, the process tree and the launcher's stderr; tests build it by hand. Nothing here
does I/O, so `diagnose(RunState)` is a pure function that table-driven tests can pin down.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from sddoctor.telemetry.runinfo import HANG_TIMEOUT, STARTUP_TIMEOUT, STRAGGLER_RATIO
from sddoctor.telemetry.snapshot import DEFAULT_GROUP, Collective, RankSnapshot

#: Verdict kinds, in the order a report lists them when several apply.
VERDICT_KINDS = (
    "crash",
    "exited_early",
    "oom",
    "hang.mismatch",
    "hang.missing_rank",
    "hang.p2p_deadlock",
    "hang.dataloader",
    "hang.comm",
    "hang.unknown",
    "hang.startup",
    "replicas.differ",
    "collective.mismatch",
    "straggler",
    "thread.died",
    "sddoctor.internal_error",
    "oom.recovered",
    "restarted",
    "no_collectives",
)


@dataclass
class Verdict:
    """One finding of the diagnosis (the dict form is documented in docs/run.md)."""

    kind: str
    severity: str  # "error" | "warning" | "info"
    summary: str
    culprit_rank: int | None = None
    location: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    evidence: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Verdict:
        return cls(
            kind=str(data.get("kind", "")),
            severity=str(data.get("severity", "info")),
            summary=str(data.get("summary", "")),
            culprit_rank=data.get("culprit_rank"),
            location=data.get("location"),
            details=dict(data.get("details") or {}),
            evidence=list(data.get("evidence") or []),
        )


@dataclass
class Arrival:
    """One rank's sighting of one collective: when it entered it and, if known, how long it took."""

    enqueue: float
    op: str | None = None
    shapes: Any = None
    caller: str | None = None
    duration: float | None = None


@dataclass
class RankState:
    """Everything known about one global rank."""

    rank: int
    state: dict[str, Any] = field(default_factory=dict)  # latest state snapshot (may be empty)
    pid: int | None = None
    host: str | None = None
    #: True/False when the process is watched on this node; None when unknown (remote or untracked).
    alive: bool | None = None
    #: How the process ended: {code, signal, t, source}; `t` is when it was first seen gone.
    exit: dict[str, Any] | None = None
    exception: dict[str, Any] | None = None  # last `exception` event
    ooms: list[dict[str, Any]] = field(default_factory=list)
    fallbacks: list[dict[str, Any]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)  # injected faults that fired
    #: `warning` events (code, message) and `replicas` events (step, params_sha256), in order
    warnings: list[dict[str, Any]] = field(default_factory=list)
    replicas: list[dict[str, Any]] = field(default_factory=list)
    #: py-spy result: {"ok": bool, "top_user_frame": "file:line", "frames": [...], "error": str}
    stack: dict[str, Any] | None = None
    #: Per process group: sightings of collectives by seq (from snapshots; sparse).
    arrivals: dict[str, dict[int, Arrival]] = field(default_factory=dict)
    #: Watched by another node's supervisor (`--peers`); its snapshot arrives over HTTP.
    remote: bool = False
    #: Recent `step` events: (t, step, step_time or None, samples or None), oldest first (bounded).
    steps: list[tuple[float, int, float | None, float | None]] = field(default_factory=list)
    #: Steps seen in all (the list above keeps only the recent ones).
    step_count: int = 0
    #: `internal_error` events: sddoctor's own failures inside this rank.
    internal_errors: list[dict[str, Any]] = field(default_factory=list)
    #: Where this rank's Python keeps its libraries (from its `start` event; see sddoctor.codepaths).
    code_roots: dict[str, Any] | None = None
    #: The communication variables of its environment (NCCL_*, TORCH_DISTRIBUTED_*, ...: its `start`
    #: event's `comm_env`).
    comm_env: dict[str, str] = field(default_factory=dict)
    #: A spawned worker's `spawned_at` (its `start` event): the user's line that started the workers.
    spawned_at: str | None = None
    #: The last fatal-signal dump (`fatal_dump.FatalDump.to_dict()`): {error, frames innermost first}.
    fatal: dict[str, Any] | None = None
    #: Earlier processes of this rank (torchrun --max-restarts): {pid, exception, exit, step, faults},
    #: oldest first.
    attempts: list[dict[str, Any]] = field(default_factory=list)
    #: Where each new snapshot saw the main thread: (snapshot t, "file:line", function), oldest
    #: first (bounded): samples of its time, about one a second, where py-spy takes none.
    positions: list[tuple[float, str, str | None]] = field(default_factory=list)
    #: When (supervisor's clock) a new snapshot last showed the rank computing: its main thread used
    #: at least `watch.COMPUTING_CPU_SHARE` of a core since its previous snapshot.
    computing_seen: float | None = None

    _snapshot: RankSnapshot | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def snapshot(self) -> RankSnapshot:
        """`state`, typed (read again whenever `state` is replaced)."""
        cached = self._snapshot
        if cached is None or cached.record is not self.state:
            cached = self._snapshot = RankSnapshot.of(self.state)
        return cached

    def restart(self, pid: int) -> None:
        """A new process took this rank over (the launcher restarted the workers): what the earlier
        one did is kept in `attempts`; its exit, exception, stack and collective sightings no longer
        describe the rank (the new process numbers its collectives from 1 again)."""
        earlier_faults = sum(len(a["faults"]) for a in self.attempts)
        self.attempts.append(
            {
                "pid": self.pid,
                "exception": self.exception,
                "exit": self.exit,
                "step": self.snapshot.step,
                "faults": self.faults[earlier_faults:],  # injected faults that process fired
            }
        )
        self.pid = pid
        self.exit = None
        self.exception = None
        self.fatal = None  # a later dump of the new process replaces it (the file is appended to)
        self.alive = None
        self.stack = None
        self.arrivals = {}
        self.positions = []
        self.state = {}  # the new process is in its start-up until it writes a snapshot

    @property
    def process_ended(self) -> bool:
        """Whether the rank's current process is known to have ended (an exit or an uncaught
        exception): a new process for the rank then is a restart."""
        return self.exit is not None or self.exception is not None

    def earlier_process(self, pid: Any) -> bool:
        """Whether `pid` was one of this rank's processes before a restart."""
        return isinstance(pid, int) and any(a.get("pid") == pid for a in self.attempts)

    def note_earlier_exit(self, pid: int, exit_info: dict[str, Any]) -> None:
        """How an earlier process of the rank ended, seen after its successor wrote its `start`: a
        rank killed hard writes no exit record, and the launcher restarts within a second, so the
        process watch's sighting can come after the restart was noted."""
        for attempt in self.attempts:
            if attempt.get("pid") == pid and not attempt.get("exit"):
                attempt["exit"] = dict(exit_info)

    def activity(self, now: float, started: float, startup_timeout: float, joined: bool = False) -> str:
        """One word for what the rank does: "exited"; "training" (steps finish); "running" (no step
        reported, collectives issued, or `joined`: its peers completed a call it had to join);
        "starting"; or "stuck at start" (no step and no collective once the start-up allowance has
        passed)."""
        if self.exited:
            return "exited"
        if self.snapshot.step is not None or self.step_count:
            return "training"
        if self.snapshot.started_work or joined:
            return "running"
        return "stuck at start" if now - started >= startup_timeout else "starting"

    @property
    def exited(self) -> bool:
        return self.exit is not None or self.alive is False or self.snapshot.exited


@dataclass
class RunState:
    """The whole run as the supervisor sees it at `now`."""

    now: float
    started: float
    ranks: dict[int, RankState] = field(default_factory=dict)
    world_size: int | None = None
    #: Last time any rank made progress (a new step, a collective issued or completed).
    last_progress: float | None = None
    hang_timeout: float = HANG_TIMEOUT
    straggler_ratio: float = STRAGGLER_RATIO
    #: Allowance for start-up (imports, model loading, rendezvous): a rank that has issued no
    #: collective and finished no step is not hung before this many seconds after the start.
    startup_timeout: float = STARTUP_TIMEOUT
    #: Processes of the job that are not ranks (yet): {pid, spawn_index, argv, stack} (mp.spawn
    #: workers before init_process_group, for a start-up hang).
    unjoined: list[dict[str, Any]] = field(default_factory=list)
    #: Workers an mp.spawn parent started (a hint of the world size before any rank joins).
    spawned_nprocs: int | None = None
    #: The world size the launcher's options say (torchrun's nproc x nnodes, accelerate's
    #: num_processes; run.json), None for a launcher that does not say (python, a shell script).
    launcher_world_size: int | None = None
    #: mp.spawn workers that failed before they became ranks (`watch.Watcher.unjoined_failures`).
    unjoined_failures: list[dict[str, Any]] = field(default_factory=list)
    #: Stragglers declared by the supervisor's tracker (`straggler.Episode.to_dict()`); None when no
    #: tracker watched the run (the last window of arrivals is judged instead).
    straggler_episodes: list[dict[str, Any]] | None = None
    #: The launcher's end: {code, t} once it has exited.
    job_exit: dict[str, Any] | None = None
    #: Failures the launcher reported (torchrun's "Root Cause" block): [{rank, exitcode, pid, root_cause}].
    launcher_failures: list[dict[str, Any]] = field(default_factory=list)
    stderr_tail: list[str] = field(default_factory=list)
    #: What the kernel's OOM killer did during the run (`host_oom.Baseline.since`): {kills, source,
    #: killed: {pid: command} or None}; None before the run ended, or when the supervisor did not say.
    host_oom: dict[str, Any] | None = None
    #: The processes listening on the ports that port-in-use errors of the run name
    #: (`port_holders.port_holders`): {port: {pid, name, cmdline, started_before_run}}.
    port_holders: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Why stacks could not be taken (ptrace not permitted, py-spy missing), with the fix.
    stacks_problem: str | None = None
    flight_recorder: dict[str, Any] | None = None
    #: Set when sddoctor itself ended the job ("hang", "interrupt"): deaths after `stopped_at` are
    #: its doing, not crashes.
    stopped_by_supervisor: str | None = None
    stopped_at: float | None = None
    #: The peer supervisor (host:port) that diagnosed a hang of the job (several nodes): this node
    #: takes its own ranks' stacks then too, before the peer's --on-hang kill takes them down.
    hang_declared_by: str | None = None
    #: Completed collectives whose ranks passed different things (`payloads.find_mismatches`),
    #: compared from the timelines once the run has ended; empty before that.
    payload_mismatches: list[dict[str, Any]] = field(default_factory=list)

    @property
    def blocked_call(self) -> tuple[int, Collective] | None:
        """(rank, call) of the call that has held a live rank longest: a blocking collective, or
        one DDP waits for, not a Work the program may leave pending (`Collective.holds_the_rank`),
        nor one another rank of its group has passed (`overtaken`)."""
        marks = self._group_marks()
        oldest: tuple[int, Collective] | None = None
        for r in self.ranks.values():
            if r.exited:
                continue
            for c in r.snapshot.inflight:
                if c.since is None or not c.holds_the_rank or _passed(marks, r.rank, c):
                    continue
                if oldest is None or c.since < (oldest[1].since or c.since):
                    oldest = (r.rank, c)
        return oldest

    def overtaken(self, rank: int, call: Collective) -> bool:
        """Whether another rank issued a later call on `call`'s group, or completed this one, than
        this rank's record of being inside `call`: the call no longer waits for a peer, and the
        record (a snapshot, written about once a second) is behind the rank."""
        return _passed(self._group_marks(), rank, call)

    def _group_marks(self) -> dict[str, _Marks]:
        """Per process group, the two highest seqs issued and the two highest completed, each with
        its rank: enough to tell, for any rank, the latest call another rank issued or completed
        there, in one pass over the ranks."""
        marks: dict[str, _Marks] = {}
        for r in self.ranks.values():
            snap = r.snapshot
            done = [c for c in (snap.last_done, snap.last_done_main) if c is not None]
            named = {c.pg for c in (*snap.inflight, *done)}
            for pg in set(snap.issued) | named:
                seq = snap.issued_on(pg)
                if isinstance(seq, int):
                    _keep_top(marks.setdefault(pg, _Marks()).issued, seq, r.rank)
            for call in done:
                if isinstance(call.seq, int):
                    _keep_top(marks.setdefault(call.pg, _Marks()).done, call.seq, r.rank)
        return marks

    @property
    def stalled_since(self) -> float:
        """Since when the job has stalled: its last progress, or, if earlier, the start of the call
        that has held a rank longest. Progress elsewhere (a thread's collectives on another group,
        another rank's steps) does not hide a rank stuck in one call for the hang timeout, and the
        time stays put while the stall lasts, so one stall is one hang."""
        since = self.last_progress if self.last_progress is not None else self.started
        blocked = self.blocked_call
        if blocked is not None and blocked[1].since is not None and blocked[1].since < since:
            return blocked[1].since
        return since

    @property
    def stalled_for(self) -> float:
        return max(0.0, self.now - self.stalled_since)

    def past_startup(self, rank: int) -> bool:
        """Whether the rank got past its start-up: it exited, or it issued a collective or finished a
        step, as its snapshot says or as its peers show: another rank completed a call of the default
        group, which this rank had to issue too. A rank that froze within a second of its last
        snapshot (stopped, or in native code that holds the GIL, so that its heartbeat thread cannot
        write) leaves a snapshot that still says it is starting."""
        mine = self.ranks.get(rank)
        if mine is None:
            return False
        if mine.exited or mine.snapshot.started_work:
            return True
        return any(
            other.rank != rank and (done := other.snapshot.last_done) is not None and done.pg == DEFAULT_GROUP
            for other in self.ranks.values()
        )

    def unreachable_world(self, at_end: bool = False) -> dict[str, Any] | None:
        """The ranks wait in init_process_group for more ranks than the job can ever have, so the
        rendezvous cannot complete however long it waits (mp.spawn's nprocs=2 with world_size=4, a
        script's own world_size under torchrun): {waiting_for, processes, source, ranks, caller},
        once every live rank has waited there for the hang timeout. An mp.spawn job counts only
        when its rendezvous is on this host (a loopback MASTER_ADDR): with another address the
        missing ranks may be another node's workers, which start when that node does. `at_end`: the
        job has ended (stopped while its ranks waited there): every rank counts, however long it waited."""
        live = [r for r in self.ranks.values() if at_end or not r.exited]
        waits = [r.snapshot.waiting for r in live]
        if not live or any(not w or w.get("what") != "init_process_group" for w in waits):
            return None
        sizes = {w.get("world_size") for w in waits if w}
        since = [float(t) for w in waits if w and isinstance(t := w.get("since"), (int, float))]
        if len(sizes) != 1 or len(since) != len(waits):
            return None
        (wanted,) = sizes
        if not isinstance(wanted, int) or (not at_end and self.now - max(since) < self.hang_timeout):
            return None
        if self.spawned_nprocs is not None:
            processes, source = self.spawned_nprocs, "mp.spawn's nprocs"
            addresses = {r.comm_env.get("MASTER_ADDR") for r in self.ranks.values()}
            if not addresses or not addresses <= _LOOPBACK:
                return None
        elif self.launcher_world_size is not None:
            processes, source = self.launcher_world_size, "the launcher's options"
        else:
            return None
        if processes >= wanted:
            return None
        caller = next((w.get("caller") for w in waits if w and w.get("caller")), None)
        return {
            "waiting_for": wanted,
            "processes": processes,
            "source": source,
            "ranks": sorted(r.rank for r in live),
            "caller": caller,
        }

    @property
    def in_startup(self) -> bool:
        """Within the start-up allowance while some expected rank has not started working yet."""
        if self.now - self.started >= self.startup_timeout:
            return False
        expected = set(range(self.world_size or 0)) | set(self.ranks)
        if not expected:
            return True  # no rank has even joined yet
        return any(not self.past_startup(r) for r in expected)

    @property
    def hung(self) -> bool:
        """No progress for the hang timeout (after the start-up allowance, while a rank is still
        starting), and the job still runs."""
        if self.job_exit is not None or self.stopped_by_supervisor is not None:
            return False
        if self.ranks and not any(not r.exited for r in self.ranks.values()):
            return False
        if self.hang_declared_by is not None:
            return True
        if not any(r.state for r in self.ranks.values()) and self.spawned_nprocs is None:
            return False  # no process of the job is a rank: no progress can be measured
        if self.unreachable_world() is not None:
            return True  # no start-up allowance helps: the ranks wait for processes that do not exist
        if self.in_startup:
            return False
        if not any(r.snapshot.started_work for r in self.ranks.values()):
            return self.now - self.started >= self.startup_timeout  # nobody got past start-up
        return self.stalled_for >= self.hang_timeout


#: MASTER_ADDR values that name this host only
_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0"})


@dataclass
class _Marks:
    """One process group's highest (seq, rank) pairs: calls issued, calls completed."""

    issued: list[tuple[int, int]] = field(default_factory=list)
    done: list[tuple[int, int]] = field(default_factory=list)


def _keep_top(top: list[tuple[int, int]], seq: int, rank: int) -> None:
    top.append((seq, rank))
    top.sort(reverse=True)
    del top[2:]


def _passed(marks: dict[str, _Marks], rank: int, call: Collective) -> bool:
    """Whether a rank other than `rank` has issued a later call on `call`'s group, or completed
    this one (a collective completes only once every member has joined it): then the call no
    longer waits for a peer, and the rank's snapshot (written about once a second) is behind.
    Point-to-point calls are numbered per pair, so they are not compared."""
    if call.seq is None or call.pg.endswith(":p2p"):
        return False
    mark = marks.get(call.pg)
    if mark is None:
        return False
    return any(other != rank and seq > call.seq for seq, other in mark.issued) or any(
        other != rank and seq >= call.seq for seq, other in mark.done
    )
