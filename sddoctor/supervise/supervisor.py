"""The supervision loop of `sddoctor run`: launch, watch about once a second, act on hangs, report."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from sddoctor import exitcodes
from sddoctor.codepaths import CodeRoots
from sddoctor.supervise import flightrec, host_oom, stacks
from sddoctor.supervise.diagnose import diagnose, merge_verdicts, place_stackless_culprits
from sddoctor.supervise.diagnose_base import describe_exit
from sddoctor.supervise.diagnose_hang import in_dataloader
from sddoctor.supervise.facts import settle_exits, write_facts
from sddoctor.supervise.gpulog import GpuLog
from sddoctor.supervise.http import EndpointError, StateServer, get_state
from sddoctor.supervise.lifecycle import STDERR_FILE
from sddoctor.supervise.metrics import RunMetrics
from sddoctor.supervise.payloads import attach_mismatches
from sddoctor.supervise.port_holders import port_holders
from sddoctor.supervise.procs import Job, become_subreaper, install_forwarding
from sddoctor.supervise.report import attach_preflight, build_report, rank_summary, write_report
from sddoctor.supervise.state import RankState, RunState, Verdict
from sddoctor.supervise.straggler import Episode, StragglerTracker, snapshot_hot_line
from sddoctor.supervise.watch import Watcher, parse_launcher_failures
from sddoctor.telemetry import RunDir, registry
from sddoctor.telemetry.runinfo import RunOptions, read_run_info

POLL_SECONDS = 1.0
#: With --peers and --on-hang kill: how long a node that diagnosed a hang waits for the other
#: nodes to take their own ranks' stacks before it kills its ranks (which takes theirs down too).
PEER_HANG_GRACE = 10.0
INTERRUPT_GRACE = 10.0
#: --on-hang kill: how long the job has, after SIGTERM, before SIGKILL. A rank stuck inside a
#: collective dies within a second (its watcher thread re-sends SIGTERM's default action); this is
#: for a rank whose own SIGTERM handler saves a checkpoint, which a SIGKILL would leave half written.
HANG_STOP_GRACE = 10.0


@dataclass
class Options:
    command: list[str]
    run_dir: RunDir
    env: dict[str, str]
    run_info: dict[str, Any]
    #: hang timeout, start-up allowance, straggler ratio, what to do on a hang
    run_options: RunOptions = RunOptions()
    port: int | None = 0
    bind: str = "127.0.0.1"
    native: bool = False
    quiet: bool = False
    peers: list[str] = field(default_factory=list)
    node_rank: int = 0
    out: TextIO = sys.stderr
    #: the endpoint, bound by `sddoctor run` before anything starts (a taken port is a usage error)
    server: StateServer | None = None
    #: bearer token of the endpoint, also sent to --peers (every node is given the same one)
    token: str | None = None


class Supervisor:
    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.started = time.time()
        self.oom_baseline = host_oom.Baseline.take()  # the kernel's OOM kills are counted from here
        self.job = Job(command=opts.command, env=opts.env, run_dir=opts.env["SDDOCTOR_RUN_DIR"])
        self.job_log = opts.run_dir.path / STDERR_FILE
        self.watcher = Watcher(opts.run_dir, options=opts.run_options, started=self.started)
        self.state: RunState = self.watcher.state()
        self.verdicts: list[Verdict] = []
        self.hang_verdicts: list[Verdict] = []  # frozen at the hang, survive our own kill
        self.diagnosis_failed = False  # said once (see _live_diagnosis)
        self.hang_handled_at: tuple[float | None] | None = None  # (stalled_since,) of the hang acted on
        self.stacks_problem: str | None = None
        self.earlier_dumps = 0  # stacks/stall-N/ folders holding the stacks of stalls that resolved
        self.unjoined: list[dict[str, Any]] = []
        self.stragglers = StragglerTracker()
        self._samplers: list[threading.Thread] = []
        self.flight_recorder: dict[str, Any] | None = None
        self.printed: set[tuple[str, Any]] = set()
        self.signals: list[int] = []
        self.stopped_by: str | None = None
        self.stopped_at: float | None = None
        self.killed_for_hang = False
        self.handling_hang = False  # a hang diagnosed and not resolved: peers take their stacks too
        self.server: StateServer | None = None
        self.metrics: RunMetrics | None = None
        self.remote: dict[str, dict[str, Any]] = {}
        self._published: dict[str, Any] = {}
        self._lock = threading.Lock()

    # -- output ---------------------------------------------------------------------------------

    def say(self, text: str) -> None:
        if not self.opts.quiet:
            try:
                print(f"[sddoctor] {text}", file=self.opts.out, flush=True)
            except (OSError, ValueError):
                pass  # our terminal is gone (closed SSH session): supervising goes on

    # -- main -----------------------------------------------------------------------------------

    def run(self) -> tuple[int, dict[str, Any]]:
        become_subreaper()
        if self.opts.server is None and self.opts.port is not None:
            try:
                self.opts.server = StateServer(
                    host=self.opts.bind, port=self.opts.port, token=self.opts.token
                )
            except EndpointError as exc:
                self.say(f"cannot serve state: {exc}; continuing without")
        if self.opts.server is not None:
            self.metrics = RunMetrics(self.opts.run_dir, gpu_source=_gpu_source())
            self.server = self.opts.server.start(self.api_state, self.metrics.render)
            self.opts.run_info["endpoint"] = self.server.url
            self.opts.run_dir.write_run_info(endpoint=self.server.url)
            self.say(f"state: {self.server.url}/api/state  metrics: {self.server.url}/metrics")
        self.say(f"run dir: {self.opts.run_dir.path}")
        live = registry.announce(self.opts.run_dir, self.opts.command)
        restore = install_forwarding(self.job, self.signals.append)
        peer_thread = None
        gpu_log = GpuLog(self.opts.run_dir).start()  # RUN_DIR/gpus.jsonl for report.html's GPU plots
        try:
            self.job.start()
            if self.opts.peers:
                peer_thread = threading.Thread(target=self._fetch_peers, name="sddoctor-peers", daemon=True)
                peer_thread.start()
            self._loop()
        finally:
            gpu_log.stop()
            restore()
            live.remove()  # `sddoctor tui` lists live runs only
            # Nothing of the job survives sddoctor, whatever happened.
            if not self.job.wait_gone(2.0):
                self.job.kill_tree(grace=3.0)
            else:
                self.job.finish()
        code, report = self.finish()
        if self.job.mute_console.is_set():
            self._say_how_ranks_ended()
        if self.server is not None:
            self.server.stop()
        return code, report

    def _say_how_ranks_ended(self) -> None:
        """One line per rank after sddoctor stopped the job (the launcher's own lines are in stderr.log)."""
        for rank_id in sorted(self.state.ranks):
            rank = self.state.ranks[rank_id]
            self.say(
                f"rank {rank_id}" + (f" (pid {rank.pid})" if rank.pid else "") + f": {self._how_ended(rank)}"
            )

    def _how_ended(self, rank: RankState) -> str:
        """How a rank ended once sddoctor stopped the job. One gone without an exit record was
        killed hard by this stop (sddoctor's SIGKILL after its grace, or the launcher's), not by
        the OOM killer, as such an end would mean otherwise."""
        if not rank.exit:
            return "still running" if rank.alive else "ended"
        if rank.exit.get("signal") or rank.exit.get("code") is not None:
            return describe_exit(rank.exit)
        if rank.pid in self.job.killed_hard:
            return "killed by sddoctor with SIGKILL as it stopped the job (no exit record)"
        return "ended without an exit record as the job was stopped (killed hard by the launcher)"

    def _loop(self) -> None:
        next_poll = 0.0
        while True:
            if self.signals:
                self._on_signal(self.signals.pop(0))
            exited = self.job.poll() is not None
            now = time.time()
            if now >= next_poll or exited:
                next_poll = now + POLL_SECONDS
                self.tick(now)
            if exited:
                return
            if self.stopped_by and now - (self.stopped_at or now) > INTERRUPT_GRACE:
                self.say("the job did not stop in time: killing it")
                self.job.kill_tree(grace=3.0)
                return
            time.sleep(0.05)

    def _on_signal(self, signum: int) -> None:
        if self.stopped_by is not None:
            self.say(f"{signal.Signals(signum).name} again: killing the job now")
            self.job.kill_tree(grace=1.0, first_signal=signal.SIGKILL)
            return
        self.stopped_by = "interrupt" if signum == signal.SIGINT else signal.Signals(signum).name
        self.stopped_at = time.time()
        self.say(
            f"{signal.Signals(signum).name}: stopping the job (again to kill it at once); its output from now on "
            f"goes to {self.job_log} only"
        )
        self.job.mute_console.set()
        self.job.signal_job(signum)

    # -- one watch step ---------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        self.job.refresh()
        self.watcher.poll(now)
        for peer_state in list(self.remote.values()):
            self.watcher.merge_remote(peer_state.get("ranks") or {}, now)
        self._merge_processes()
        # The facts before the straggler update: an episode it declares now is not ready (its
        # samples come from a thread), so the facts would not hold it yet either way.
        state = self.watcher.state(now, self.facts())
        declared = self.stragglers.update(state, now)
        if declared is not None:
            self._sample_straggler(declared, state)
        state.hang_declared_by = self._peer_hang(state)
        stalled_since = state.stalled_since
        if state.hung and (self.hang_handled_at is None or self.hang_handled_at[0] != stalled_since):
            self.hang_handled_at = (stalled_since,)
            self.on_hang(state)
        verdicts = self._live_diagnosis(state)
        resumed = self.hang_handled_at is not None and stalled_since != self.hang_handled_at[0]
        if resumed:
            self.handling_hang = False
        if self.hang_verdicts and resumed and self.stopped_by is None and self.job.exit_code is None:
            for v in self.hang_verdicts:
                if not v.details.get("resolved"):  # progress resumed after the stall: it was not fatal
                    v.details["resolved"] = True
                    v.severity = "warning"
                    stalled = v.details.get("stalled_seconds")
                    lasted = f" after more than {stalled:.0f} s" if isinstance(stalled, (int, float)) else ""
                    v.summary = f"stall, resolved{lasted} (progress resumed): {v.summary}"
        self.state = state
        self.verdicts = merge_verdicts(self.hang_verdicts, verdicts)
        for v in self.verdicts:
            key = (v.kind, v.culprit_rank)
            if key not in self.printed and v.kind != "crash":
                self.printed.add(key)
                self.say(f"{v.severity}: {v.summary}" + (f" [{v.location}]" if v.location else ""))
        self._publish()

    def _live_diagnosis(self, state: RunState) -> list[Verdict]:
        """`diagnose(state)` once a second while the job runs. A state caught between two ranks'
        snapshots can be one no rule foresaw: an error of the diagnosis is said once and that
        second's verdicts skipped (the final diagnosis runs again on settled files), rather than
        ending the supervisor of a job that runs on."""
        try:
            return diagnose(state)
        except Exception as exc:  # noqa: BLE001
            if not self.diagnosis_failed:
                self.diagnosis_failed = True
                self.say(
                    f"internal error in the live diagnosis ({type(exc).__name__}: {exc}); the job goes on"
                )
            return []

    def _merge_processes(self) -> None:
        """What the process watch knows of each rank (its pid, whether it lives, how it ended) into
        the watcher's ranks; a rank's own word on its pid teaches the process watch."""
        for rank in self.watcher.ranks.values():
            known = self.job.ranks.get(rank.rank)
            if (
                rank.pid is not None
                and rank.pid in self.job.descendants
                and (known is None or known.pid != rank.pid)
            ):
                self.job.add_rank(rank.rank, rank.pid)  # the rank's own word on its pid wins
        for old in self.job.earlier:  # replaced by a restart before this loop saw it end
            if old.exit is not None and old.rank in self.watcher.ranks:
                self.watcher.ranks[old.rank].note_earlier_exit(old.pid, old.exit)
        for rank_id, proc in self.job.ranks.items():
            rank = self.watcher._rank(rank_id)
            if rank.pid is not None and proc.pid != rank.pid:
                if proc.exit is not None:
                    # an earlier process of a restarted rank: the rank's own word wins
                    rank.note_earlier_exit(proc.pid, proc.exit)
                    continue
                if rank.process_ended:
                    rank.restart(proc.pid)  # the launcher started a new process for this rank
            rank.pid = proc.pid
            rank.alive = proc.exit is None
            if proc.exit is not None:
                rank.exit = {**(rank.exit or {}), **proc.exit}

    def on_hang(self, state: RunState) -> None:
        blocked = state.blocked_call
        progress = state.last_progress if state.last_progress is not None else state.started
        # the supervisor sees a call up to ~2 s after it began (snapshot, then poll): later
        # progress than that is other work
        if blocked is not None and blocked[1].since is not None and blocked[1].since < progress - 2.5:
            rank, call = blocked
            self.say(
                f"rank {rank} has waited {state.now - blocked[1].since:.0f} s in {call.op or 'a collective'} "
                f"#{call.seq} while other work went on: diagnosing a hang"
            )
        elif any(r.snapshot.started_work for r in state.ranks.values()):
            self.say(f"no progress for {state.stalled_for:.0f} s: diagnosing a hang")
        else:
            self.say(f"no rank got past its start-up in {state.now - state.started:.0f} s: diagnosing a hang")
        alive = {r.rank: r.pid for r in state.ranks.values() if not r.exited and r.pid is not None}
        alive = {r: p for r, p in alive.items() if r in self.job.ranks}  # only processes on this node
        unjoined = self._unjoined()
        if self.opts.run_options.on_hang in ("dump", "kill") and (alive or unjoined):
            backends = {r.snapshot.backend for r in state.ranks.values()}
            dump_asked_at = None
            if "nccl" in backends and flightrec.trigger(self.job.env, sorted(alive)):
                dump_asked_at = time.time()
            self.stacks_problem = stacks.ptrace_problem()
            self._set_aside_earlier_stacks()
            targets: dict[Any, int] = {**alive, **{f"pid-{u['pid']}": u["pid"] for u in unjoined}}
            roots = {r: root for r in alive if (root := CodeRoots.from_dict(state.ranks[r].code_roots))}
            results = stacks.dump_stacks(
                targets, self.opts.run_dir.stacks_dir, native=self.opts.native, roots=roots
            )
            failures = {r: res.get("error") for r, res in results.items() if not res.get("ok")}
            if failures and not self.stacks_problem:
                self.stacks_problem = f"{len(failures)} of {len(results)} stack dumps failed: " + "; ".join(
                    f"{r if isinstance(r, str) else f'rank {r}'}: {e}"
                    for r, e in sorted(failures.items(), key=str)
                )
            for rank_id in alive:
                stack = state.ranks[rank_id].stack = results.get(rank_id)
                if stack and in_dataloader(state.ranks[rank_id]):
                    stack["workers"] = stacks.dump_workers(
                        rank_id, alive[rank_id], self.opts.run_dir.stacks_dir, roots=roots.get(rank_id)
                    )
            for process in unjoined:
                process["stack"] = results.get(f"pid-{process['pid']}")
            if dump_asked_at is not None:
                self.flight_recorder = flightrec.collect(self.job.env, sorted(alive), asked_at=dump_asked_at)
            state.stacks_problem = self.stacks_problem
            state.flight_recorder = self.flight_recorder
            self.say(
                f"stacks of {sum(1 for r in results.values() if r.get('ok'))}/{len(results)} processes saved in "
                f"{self.opts.run_dir.stacks_dir}"
            )
        state.unjoined = unjoined
        self.unjoined = unjoined
        # earlier stalls that resolved stay in the report (the last few), each with its own call
        resolved = [v for v in self.hang_verdicts if v.details.get("resolved")][-4:]
        self.hang_verdicts = resolved + [v for v in diagnose(state) if v.kind.startswith("hang.")]
        for v in self.hang_verdicts[len(resolved) :]:
            self.say(f"{v.severity}: {v.summary}" + (f" [{v.location}]" if v.location else ""))
            self.printed.add((v.kind, v.culprit_rank))
        write_facts(self.opts.run_dir, self.facts())
        self._write(state, outcome="hang", exit_code=None)
        self.handling_hang = True
        self.state, self.verdicts = state, merge_verdicts(self.hang_verdicts, self.verdicts)
        self._publish()  # the peers learn of the hang now, not at the next tick
        if self.opts.run_options.on_hang == "kill":
            self._await_peer_stacks()
            self.say(f"--on-hang kill: stopping the job; its output from now on goes to {self.job_log} only")
            self.job.mute_console.set()
            self.killed_for_hang = True
            self.stopped_by = "hang"
            self.stopped_at = time.time()
            self.job.kill_tree(grace=HANG_STOP_GRACE)

    def _sample_straggler(self, episode: Episode, state: RunState) -> None:
        """Where the straggler's time goes: a few seconds of py-spy samples, off the watch loop. Its
        verdict appears (and is printed) once they are in."""
        rank = state.ranks[episode.rank]
        pid = self.job.ranks[episode.rank].pid if episode.rank in self.job.ranks else None
        roots = CodeRoots.from_dict(rank.code_roots)

        def sample() -> None:
            if pid is None:
                episode.cause_problem = "the straggler runs on another node"
            else:
                result = stacks.sample_hot_frame(pid, roots)
                if "error" in result:
                    episode.cause_problem = str(result["error"])
                else:
                    episode.cause = result
            if episode.cause is None:  # no py-spy samples: its snapshots say where it was
                episode.cause = snapshot_hot_line(rank, episode.since)
            episode.ready = True

        thread = threading.Thread(target=sample, name="sddoctor-straggler-samples", daemon=True)
        self._samplers.append(thread)
        thread.start()

    def _straggler_records(self, wait: bool = False) -> list[dict[str, Any]]:
        if wait:
            for thread in self._samplers:
                thread.join(timeout=15.0)
        return [e.to_dict() for e in self.stragglers.episodes.values() if e.ready or wait]

    def _unjoined(self) -> list[dict[str, Any]]:
        """Processes of the job that are no rank yet (an mp.spawn worker before init_process_group)."""
        notes = self.watcher.proc_notes
        spawners = {p for p in self.watcher.spawner_pids}
        out = []
        for proc in self.job.unjoined_processes(not_ranks=spawners):
            note = notes.get(proc.pid) or {}
            try:
                argv = proc.cmdline()[:8]
            except Exception:  # noqa: BLE001 - it may have gone meanwhile
                argv = []
            out.append({"pid": proc.pid, "spawn_index": note.get("spawn_index"), "argv": argv})
        return out

    def _peer_hang(self, state: RunState) -> str | None:
        """The peer that diagnosed a hang, once this node has seen no progress for half the timeout.

        Node clocks and poll phases differ, so one node reaches the timeout first; with --on-hang
        kill its ranks' end would take the other nodes' ranks down (a "connection closed by peer"
        crash) before those nodes took their stacks. The half-timeout floor keeps a peer still
        flagging a stall that has just resolved here from starting a second diagnosis.
        """
        if state.stalled_for < 0.5 * state.hang_timeout:
            return None
        for peer, snapshot in list(self.remote.items()):
            if snapshot.get("hang_handled"):
                return peer
        return None

    def _set_aside_earlier_stacks(self) -> None:
        """A stall that resolved left its stack files in stacks/; this stall's dump would write over
        them. They move to stacks/stall-N/ (N counting the dumps), named in the verdicts of that
        stall (`details.stacks_dir`), so each stall kept in the report keeps its own stacks."""
        folder = self.opts.run_dir.stacks_dir
        try:
            # only py-spy's dumps (rank-*, pid-*): NCCL's flight recorder keeps its files and pipes
            files = [p for p in folder.glob("*") if p.name.startswith(("rank-", "pid-")) and p.is_file()]
            if not files:
                return
            self.earlier_dumps += 1
            kept = folder / f"stall-{self.earlier_dumps}"
            kept.mkdir(exist_ok=True)
            for path in files:
                path.rename(kept / path.name)
        except OSError as exc:  # the new dump then writes over them, as before
            self.say(f"could not keep the earlier stall's stacks apart ({exc})")
            return
        for v in self.hang_verdicts:
            if v.details.get("resolved") and "stacks_dir" not in v.details:
                v.details["stacks_dir"] = f"{folder.name}/{kept.name}"
                v.evidence.append(f"the stacks taken during this stall are in {folder.name}/{kept.name}/")

    def _await_peer_stacks(self) -> None:
        """Before --on-hang kill with --peers: give every reached peer up to PEER_HANG_GRACE seconds
        to diagnose the hang and take its own ranks' stacks."""
        peers = [p for p in self.opts.peers if p in self.remote]
        if not peers:
            return
        self.say(f"waiting up to {PEER_HANG_GRACE:.0f} s for {len(peers)} peer(s) to take their stacks")
        deadline = time.time() + PEER_HANG_GRACE
        while time.time() < deadline and self.job.poll() is None:
            if all(self.remote.get(p, {}).get("hang_handled") for p in peers):
                return
            time.sleep(0.1)

    # -- end ------------------------------------------------------------------------------------

    def finish(self) -> tuple[int, dict[str, Any]]:
        now = time.time()
        self.tick(now)
        remove_empty_files(self.opts.run_dir.path)
        self.stragglers.final(self.watcher.state(now), now)  # before the facts, which hold its episodes
        facts = self.facts(final=True)
        state = self.watcher.state(now, facts)
        settle_exits(state)
        self.hang_verdicts = place_stackless_culprits(self.hang_verdicts, state)
        facts["hang_verdicts"] = [v.to_dict() for v in self.hang_verdicts]
        if not self.hang_verdicts:  # after a hang the ranks' call numbers need not line up
            attach_mismatches(state, self.opts.run_dir)
        self.verdicts = merge_verdicts(self.hang_verdicts, diagnose(state))
        self.state = state
        job_code = self.job.exit_code
        usage_error = _usage_error(self.opts.run_dir)
        if usage_error is not None:
            # a rank stopped the job on a bad SDDOCTOR_FAULT: what followed is not a finding
            self.hang_verdicts, self.verdicts = [], []
            code, outcome = exitcodes.USAGE, "usage_error"
        elif self.killed_for_hang:
            code, outcome = exitcodes.HANG_KILLED, "hang"
        elif self.stopped_by == "interrupt":
            code, outcome = exitcodes.INTERRUPTED, "interrupted"
        elif self.stopped_by is not None:
            code, outcome = 128 + int(getattr(signal, f"SIG{self.stopped_by[3:]}", 15)), "interrupted"
        else:
            code = _shell_code(job_code)
            outcome = "ok" if code == 0 else "failed"
            if self.hang_verdicts:
                outcome = "hang" if code != 0 else "ok"
            elif code == 0 and _rank_died(self.verdicts):
                # A launcher that does not pass its ranks' failures on (a shell script's bare
                # `wait`) ended 0 although a rank died: the run failed all the same.
                code, outcome = exitcodes.FINDINGS, "failed"
        write_facts(self.opts.run_dir, {**facts, "outcome": outcome, "exit_code": code})
        report = self._write(state, outcome=outcome, exit_code=code)
        self._publish()
        return code, report

    def facts(self, final: bool = False) -> dict[str, Any]:
        """What only this supervisor knows of the run (see `facts`); `final` once the job has ended."""
        tail = list(self.job.stderr_tail)
        out: dict[str, Any] = {
            "pid": os.getpid(),
            "world_size": self.opts.run_info.get("world_size"),
            "stacks_problem": self.stacks_problem,
            "flight_recorder": self.flight_recorder,
            "unjoined": self.unjoined,
            "stopped_by": self.stopped_by,
            "stopped_at": self.stopped_at,
            "stderr_tail": tail,
            "straggler_episodes": self._straggler_records(wait=final),
            "hang_verdicts": [v.to_dict() for v in self.hang_verdicts],
            "stacks": {str(r): rs.stack for r, rs in self.state.ranks.items() if rs.stack},
        }
        if final:
            out["exits"] = {str(r): dict(p.exit) for r, p in self.job.ranks.items() if p.exit is not None}
            out["job_exit"] = {"code": self.job.exit_code, "t": self.job.exit_time}
            out["launcher_failures"] = parse_launcher_failures(tail) + self.watcher.spawn_failures()
            out["host_oom"] = self.oom_baseline.since()
            messages = tail + [str((r.exception or {}).get("message", "")) for r in self.state.ranks.values()]
            out["port_holders"] = port_holders(messages, self.started)
        return out

    def _write(self, state: RunState, *, outcome: str, exit_code: int | None) -> dict[str, Any]:
        verdicts = merge_verdicts(self.hang_verdicts, self.verdicts if exit_code is not None else [])
        report = build_report(
            state,
            verdicts,
            run_info=read_run_info(self.opts.run_dir).record or self.opts.run_info,
            outcome=outcome,
            exit_code=exit_code,
            job_exit_code=self.job.exit_code,
        )
        report["node"] = {"host": socket.gethostname(), "node_rank": self.opts.node_rank}
        # With --peers the report covers every node's ranks (node 0's is the job-wide one).
        report["scope"] = "job" if self.opts.peers else "node"
        report["peers"] = {peer: peer in self.remote for peer in self.opts.peers}
        attach_preflight(report, self.opts.run_dir)
        write_report(self.opts.run_dir, report)
        return report

    # -- HTTP -----------------------------------------------------------------------------------

    def _publish(self) -> None:
        state = self.state
        snapshot = {
            "v": 1,
            "run": read_run_info(self.opts.run_dir).record or self.opts.run_info,
            "node": {"host": socket.gethostname(), "node_rank": self.opts.node_rank},
            "ranks": {str(r): rank_summary(state.ranks[r], state) for r in sorted(state.ranks)},
            "verdicts": [v.to_dict() for v in self.verdicts],
            "hang": {"stalled_seconds": round(state.stalled_for, 1), "timeout": state.hang_timeout},
            "hang_handled": self.handling_hang,
            "t": state.now,
        }
        with self._lock:
            self._published = snapshot
        if self.metrics is not None:
            self.metrics.update(state, self.verdicts, hang_handled=self.handling_hang)

    def api_state(self) -> dict[str, Any]:
        with self._lock:
            return self._published or {"v": 1, "run": self.opts.run_info, "ranks": {}, "verdicts": []}

    def _fetch_peers(self) -> None:
        """Poll the other nodes' supervisors; their ranks join this node's diagnosis."""
        while self.job.exit_code is None:
            for peer in self.opts.peers:
                try:
                    self.remote[peer] = get_state(peer, self.opts.token, timeout=2.0)
                except (OSError, ValueError):
                    continue
            time.sleep(POLL_SECONDS)


def _usage_error(run_dir: RunDir) -> str | None:
    try:
        return run_dir.usage_error_file.read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def remove_empty_files(run_dir: Path) -> None:
    """Empty files sddoctor made (a rank's unused fatal-signal file, an empty stderr.log) and its empty
    folders go: what is left there says something. The job's own files are never touched."""
    for name in ("ranks", "stacks", "procs"):
        folder = run_dir / name
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            try:
                if path.is_file() and not path.is_symlink() and path.stat().st_size == 0:
                    path.unlink()
            except OSError:
                pass
        try:
            folder.rmdir()  # only if empty
        except OSError:
            pass
    try:
        log = run_dir / STDERR_FILE
        if log.is_file() and log.stat().st_size == 0:
            log.unlink()
    except OSError:
        pass


def _gpu_source() -> object | None:
    """Local GPUs for /metrics (NVML opened in the background; None without the module)."""
    try:
        from sddoctor.gpu.source import NvmlSource

        return NvmlSource(pcie_interval=0, open_in_background=True)
    except Exception:  # noqa: BLE001 - GPU series are optional
        return None


#: verdicts of a rank that died or ended before its peers (not a hang, not a warning)
_DEATHS = ("crash", "exited_early", "oom")


def _rank_died(verdicts: list[Verdict]) -> bool:
    return any(v.kind in _DEATHS and v.severity == "error" for v in verdicts)


def _shell_code(code: int | None) -> int:
    if code is None:
        return 1
    return 128 - code if code < 0 else code
