"""Where rank telemetry comes from: a run directory on this machine, or the HTTP state
endpoint of one or more `sddoctor run` supervisors (`GET http://HOST:PORT/api/state`).

A feed's `poll()` does I/O (file reads, HTTP with a short timeout): call it from a worker
thread, never from a UI thread. Feeds keep what they learned between polls (event offsets,
step history for rates), so each poll reads only what is new.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sddoctor.gpu.host import pid_running
from sddoctor.ranks.status import RankInputs, RankStatus, RateTracker, derive
from sddoctor.telemetry import EventTail, RankSnapshot, RunDir, StepRecord, read_json, read_state, registry
from sddoctor.telemetry.layout import RUN_BASES
from sddoctor.telemetry.runinfo import RunInfo, read_run_info

HTTP_TIMEOUT = 2.0


@dataclass
class RankReport:
    """One poll of one or more feeds."""

    sources: list[str] = field(default_factory=list)
    ranks: list[RankStatus] = field(default_factory=list)
    verdicts: list[dict[str, Any]] = field(default_factory=list)  # each with "source" added
    errors: list[str] = field(default_factory=list)
    run_dirs: dict[str, Path] = field(default_factory=dict)  # source -> run dir (for stack dumps)
    job_dirs: dict[str, str] = field(default_factory=dict)  # source -> the job's working directory

    def extend(self, other: RankReport) -> None:
        self.sources += other.sources
        self.ranks += other.ranks
        self.verdicts += other.verdicts
        self.errors += other.errors
        self.run_dirs.update(other.run_dirs)
        self.job_dirs.update(other.job_dirs)


class RankFeed(Protocol):
    label: str

    def poll(self) -> RankReport: ...


def _local_pid_alive(pid: int) -> bool:
    return pid_running(pid)


class RunDirFeed:
    """Ranks of a run directory: state snapshots, the events that matter, report.json verdicts."""

    def __init__(
        self,
        run_dir: RunDir | str | os.PathLike[str],
        clock: Callable[[], float] = time.time,
        hostname: str | None = None,
        pid_alive: Callable[[int], bool] | None = _local_pid_alive,
        job_dir: str | None = None,
    ) -> None:
        self.run_dir = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        self.label = self.run_dir.path.name
        self.job_dir = job_dir if job_dir is not None else guess_job_dir(self.run_dir)
        self.clock = clock
        self.hostname = hostname or socket.gethostname()
        self.pid_alive = pid_alive
        self._tails: dict[int, EventTail] = {}
        self._inputs: dict[int, RankInputs] = {}
        self._rates: dict[int, RateTracker] = {}
        self._state_files: dict[int, str] = {}
        self._verdicts: tuple[tuple[int, int] | None, list[dict[str, Any]]] = (None, [])

    def poll(self) -> RankReport:
        report = RankReport(sources=[self.label], run_dirs={self.label: self.run_dir.path})
        if self.job_dir:
            report.job_dirs[self.label] = self.job_dir
        if not self.run_dir.path.is_dir():
            report.errors.append(f"run directory {self.run_dir.path} does not exist (any more)")
            return report
        verdicts = self._read_verdicts()
        report.verdicts = [dict(v, source=self.label) for v in verdicts]
        now = self.clock()
        run = read_run_info(self.run_dir)
        for rank in self.run_dir.ranks():
            if rank not in self._tails:
                self._tails[rank] = EventTail(self.run_dir.events_file(rank))
                self._inputs[rank] = RankInputs(rank=rank, node=self.label)
                self._rates[rank] = RateTracker()
                self._state_files[rank] = str(self.run_dir.state_file(rank))
            tail, inputs, rates = self._tails[rank], self._inputs[rank], self._rates[rank]
            for ev in tail.poll():
                kind = ev.get("kind")
                if kind == "step":
                    step = StepRecord.of(ev)
                    rates.add(step.t, step.step, step.samples)
                elif kind in ("start", "exit", "exception", "fallback", "oom"):
                    setattr(inputs, kind, ev)
            inputs.state = read_state(self._state_files[rank])
            snapshot, start = RankSnapshot.of(inputs.state), inputs.start or {}
            host = snapshot.host or start.get("host")
            pid = snapshot.pid or start.get("pid")
            inputs.pid_alive = None
            if self.pid_alive is not None and host == self.hostname and isinstance(pid, int):
                inputs.pid_alive = self.pid_alive(pid)
            report.ranks.append(
                derive(inputs, rates, verdicts, now, run.options.startup_timeout, run.started)
            )
        return report

    def _read_verdicts(self) -> list[dict[str, Any]]:
        """report.json's verdicts, read again only when the file changed (it is written at a hang
        and at the end; the ranks' files change every second)."""
        try:
            st = os.stat(self.run_dir.report_json)
            stamp: tuple[int, int] | None = (st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp is None or stamp != self._verdicts[0]:
            verdicts = _verdicts_of(read_json(self.run_dir.report_json)) if stamp is not None else []
            self._verdicts = (stamp, verdicts)
        return self._verdicts[1]


class HttpFeed:
    """Ranks of one node through its `sddoctor run` endpoint (HOST:PORT)."""

    def __init__(self, endpoint: str, clock: Callable[[], float] = time.time, timeout: float = HTTP_TIMEOUT):
        self.endpoint = endpoint
        self.label = endpoint
        self.url = f"http://{endpoint}/api/state"
        self.clock = clock
        self.timeout = timeout
        self._rates: dict[int, RateTracker] = {}
        # A supervisor on this host: its registry entry tells its run directory (stack dumps) and
        # working directory (short call sites), which /api/state does not.
        live = next(
            (r for r in registry.live_runs(clean=False) if _same_endpoint(r.endpoint, endpoint)), None
        )
        self.run_dir = live.run_dir if live is not None else None
        self.job_dir = live.cwd if live is not None else None

    def poll(self) -> RankReport:
        # imported here: urllib.request pulls in http.client and email (tens of ms at start-up)
        import urllib.error
        import urllib.request

        report = RankReport(sources=[self.label])
        request = urllib.request.Request(self.url)
        token = os.environ.get("SDDOCTOR_TOKEN", "").strip()
        if token:  # an endpoint off loopback wants it (docs/run.md#state-endpoint)
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as resp:
                payload = json.loads(resp.read().decode("utf-8"))
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            report.errors.append(f"cannot read {self.url}: {reason}")
            return report
        if not isinstance(payload, dict):
            report.errors.append(f"{self.url} did not return a JSON object")
            return report
        verdicts = _verdicts_of(payload)
        report.verdicts = [dict(v, source=self.label) for v in verdicts]
        run = RunInfo.of(payload.get("run"), source=f"{self.url} run")
        run_path = run.record.get("run_dir") or run.record.get("path")
        if isinstance(run_path, str) and Path(run_path).is_dir():
            report.run_dirs[self.label] = Path(run_path)  # same machine: stack dumps are readable
        elif self.run_dir is not None:
            report.run_dirs[self.label] = self.run_dir
        if self.job_dir:
            report.job_dirs[self.label] = self.job_dir
        now = self.clock()
        ranks: dict[str, Any] = payload["ranks"] if isinstance(payload.get("ranks"), dict) else {}
        for key, state in sorted(ranks.items(), key=lambda kv: _rank_key(kv[0])):
            if not isinstance(state, dict):
                continue
            rank = _rank_key(key)
            inputs = RankInputs(rank=rank, node=self.label, state=state)
            if isinstance(state.get("exit"), dict):
                inputs.exit = state["exit"]
            for kind in ("exception", "fallback", "oom", "start"):
                if isinstance(state.get(kind), dict):
                    setattr(inputs, kind, state[kind])
            rates = self._rates.setdefault(rank, RateTracker())
            report.ranks.append(
                derive(inputs, rates, verdicts, now, run.options.startup_timeout, run.started)
            )
        return report


class MultiFeed:
    """Several feeds (e.g. one HTTP endpoint per node) seen as one."""

    def __init__(self, feeds: list[RankFeed]) -> None:
        self.feeds = feeds
        self.label = ", ".join(f.label for f in feeds)

    def poll(self) -> RankReport:
        report = RankReport()
        for feed in self.feeds:
            report.extend(feed.poll())
        report.ranks.sort(key=lambda r: (r.rank, r.node))
        return report


def guess_job_dir(run_dir: RunDir) -> str | None:
    """The working directory of the job that writes `run_dir`, where it can be told: the registry
    entry of its live supervisor, else the folder holding ./sddoctor-runs/ (or ./runs/) when the
    run directory is in one, as `sddoctor run` makes it by default."""
    live = registry.find_live_run(run_dir.path)
    if live is not None and live.cwd:
        return live.cwd
    parent = run_dir.path.resolve().parent
    if parent.name in RUN_BASES:
        return str(parent.parent)
    return None


def _same_endpoint(url: str | None, endpoint: str) -> bool:
    """Whether a registry entry's endpoint URL (http://HOST:PORT) is the HOST:PORT polled."""
    if not url:
        return False
    where = url.split("://", 1)[-1].rstrip("/")
    host, _, port = endpoint.rpartition(":")
    local = {"127.0.0.1", "localhost", "::1", "[::1]", "0.0.0.0", socket.gethostname()}
    entry_host, _, entry_port = where.rpartition(":")
    return port == entry_port and (host == entry_host or (host in local and entry_host in local))


def _rank_key(key: Any) -> int:
    try:
        return int(key)
    except (TypeError, ValueError):
        return -1


def _verdicts_of(doc: Any) -> list[dict[str, Any]]:
    if isinstance(doc, list):
        return [v for v in doc if isinstance(v, dict)]
    if isinstance(doc, dict):
        found = doc.get("verdicts")
        if found is None and isinstance(doc.get("diagnosis"), dict):
            found = doc["diagnosis"].get("verdicts")
        if isinstance(found, list):
            return [v for v in found if isinstance(v, dict)]
    return []


def latest_stack_dump(run_dir: str | os.PathLike[str] | None, rank: int, limit: int = 20_000) -> str | None:
    """The newest stack dump of `rank` under RUN_DIR/stacks/ as text, or None.

    Accepts the file names and formats a supervisor may write: rank-00003*.txt|.json, and a
    JSON document per dump holding all ranks ({"ranks": {"3": ...}}) or py-spy's --json output
    (a list of threads with frames).
    """
    if run_dir is None:
        return None
    stacks = RunDir(run_dir).stacks_dir
    if not stacks.is_dir():
        return None
    names = (
        f"rank-{rank:05d}",
        f"rank{rank}.",
        f"rank-{rank}.",
        f"rank_{rank}.",
        f"rank{rank}-",
        f"rank-{rank}-",
    )
    files = []
    for p in stacks.rglob("*"):
        if p.is_file():
            try:
                files.append((p.stat().st_mtime, p))
            except OSError:
                continue
    for _, path in sorted(files, reverse=True):
        mine = any(n in path.name for n in names)
        try:
            text = path.read_text(encoding="utf-8", errors="replace")[:limit]
        except OSError:
            continue
        if path.suffix == ".json":
            try:
                doc = json.loads(text)
            except ValueError:
                doc = None
            if not mine and isinstance(doc, dict) and isinstance(doc.get("ranks"), dict):
                doc = doc["ranks"].get(str(rank))
                if doc is None:
                    continue
                mine = True
            if mine and doc is not None:
                return f"{path.name}\n" + _format_stack_json(doc)
        if mine:
            return f"{path.name}\n{text}"
    return None


def _format_stack_json(doc: Any) -> str:
    if isinstance(doc, dict) and isinstance(doc.get("threads"), list):
        doc = doc["threads"]
    if isinstance(doc, dict) and isinstance(doc.get("text"), str):
        return doc["text"]
    if isinstance(doc, list):
        lines = []
        for thread in doc:
            if not isinstance(thread, dict):
                continue
            lines.append(
                f"Thread {thread.get('thread_name') or thread.get('thread_id', '?')}"
                f"{' (active)' if thread.get('active') else ''}"
            )
            for frame in thread.get("frames") or []:
                if isinstance(frame, dict):
                    lines.append(
                        f"    {frame.get('name', '?')} ({frame.get('filename', '?')}:{frame.get('line', '?')})"
                    )
        return "\n".join(lines)
    return json.dumps(doc, indent=2)[:20_000]
