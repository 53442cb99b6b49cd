"""The job's processes: launch in its own session, find the rank processes, notice deaths, and
make sure nothing survives.

The launcher (torchrun, accelerate, python) starts in a new session so that a Ctrl-C in the
terminal reaches sddoctor only; sddoctor forwards it. Every descendant ever seen is remembered,
so that even a rank that escaped its process group (or whose launcher died) is killed at the end.
On Linux sddoctor also becomes a child subreaper: ranks orphaned by a dead launcher are
re-parented to it, which keeps them findable and lets it collect their exit status.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

import psutil

from sddoctor.supervise.lifecycle import StderrLog, die_with_parent

_PR_SET_CHILD_SUBREAPER = 36
#: what the command line of a process that is never a rank holds: multiprocessing's helpers
_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
_LAUNCHER_PROGRAMS = ("torchrun", "accelerate", "accelerate-launch", "deepspeed")
_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch", "accelerate.commands.launch")


def is_launcher_command(cmdline: list[str]) -> bool:
    """torchrun, `python -m torch.distributed.run`, accelerate launch (and `python .../torchrun`)."""
    if any(os.path.basename(w) in _LAUNCHER_PROGRAMS for w in cmdline[:2]):
        return True
    return any(w == "-m" and nxt in _LAUNCHER_MODULES for w, nxt in zip(cmdline, cmdline[1:], strict=False))


def become_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process (Linux only). True if it worked."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@dataclass
class RankProcess:
    rank: int
    pid: int
    process: psutil.Process
    local_rank: int | None = None
    #: Filled when the process is seen gone: {t, code, signal, source}.
    exit: dict[str, Any] | None = None


@dataclass
class Job:
    """A launched job and everything it spawned."""

    command: list[str]
    env: dict[str, str]
    run_dir: str
    popen: subprocess.Popen[bytes] | None = None
    #: pid -> process for every descendant seen (kept after death for the final sweep).
    descendants: dict[int, psutil.Process] = field(default_factory=dict)
    ranks: dict[int, RankProcess] = field(default_factory=dict)
    #: processes a rank had before the launcher restarted it (their exits still tell how they ended)
    earlier: list[RankProcess] = field(default_factory=list)
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=400))
    #: Exit status of orphans reaped by this process (as subreaper): pid -> raw wait status.
    reaped: dict[int, int] = field(default_factory=dict)
    exit_code: int | None = None
    exit_time: float | None = None
    #: pids sddoctor itself sent SIGKILL when stopping the job (they wrote no exit record)
    killed_hard: set[int] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)
    _stop_death_watch: threading.Event = field(default_factory=threading.Event)
    _not_ranks: set[int] = field(default_factory=set)
    #: Set once sddoctor itself stops the job: the launcher's traceback flood stays in
    #: RUN_DIR/stderr.log and off the console.
    mute_console: threading.Event = field(default_factory=threading.Event)

    def start(self, stderr_sink: IO[str] | None = None) -> None:
        """Start the launcher in a new session; tee its stderr into `stderr_sink` and a tail.

        Its stderr is RUN_DIR/stderr.log, followed from here (a file cannot break or fill up
        like a pipe), and it gets SIGTERM if this process dies (see `lifecycle`)."""
        log = StderrLog(self.run_dir)
        self.popen = subprocess.Popen(
            self.command,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stderr=log.fd,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        self.descendants[self.popen.pid] = psutil.Process(self.popen.pid)
        sink = sys.stderr if stderr_sink is None else stderr_sink
        tee = threading.Thread(
            target=log.follow,
            args=(sink, self.stderr_tail.append, self._stop_death_watch, self.mute_console),
            name="sddoctor-stderr",
            daemon=True,
        )
        tee.start()
        death = threading.Thread(target=self._death_watch, name="sddoctor-deaths", daemon=True)
        death.start()
        self._threads += [tee, death]

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def poll(self) -> int | None:
        """The launcher's exit code once it has ended (negative: killed by that signal)."""
        if self.popen is None:
            return None
        code = self.popen.poll()
        if code is not None and self.exit_code is None:
            self.exit_code = code
            self.exit_time = time.time()
        return code

    # -- process tree ---------------------------------------------------------------------------

    def refresh(self) -> None:
        """Record new descendants and discover rank processes by their environment."""
        self._reap_orphans()
        roots: list[psutil.Process] = []
        try:
            roots.append(psutil.Process(os.getpid()))
        except psutil.Error:
            pass
        for root in roots:
            try:
                children = root.children(recursive=True)
            except psutil.Error:
                continue
            for child in children:
                if child.pid not in self.descendants and not _is_tool(child):
                    self.descendants[child.pid] = child
        self._discover_ranks()

    def _discover_ranks(self) -> None:
        launcher_pid = self.popen.pid if self.popen else None
        candidates: dict[int, list[tuple[psutil.Process, dict[str, str]]]] = {}
        for pid, proc in list(self.descendants.items()):
            if pid in self._not_ranks or any(r.pid == pid for r in self.ranks.values()):
                continue
            try:
                if not proc.is_running():
                    continue
                environ = proc.environ()
            except psutil.Error:
                continue
            if (
                environ.get("SDDOCTOR_RUN_DIR") != self.run_dir
                or "RANK" not in environ
                or _child_of_rank(pid, environ)
            ):
                # Its environment will not change once it has exec'd (a fresh fork may not have yet).
                try:
                    if time.time() - proc.create_time() > 2.0:
                        self._not_ranks.add(pid)
                except psutil.Error:
                    pass
                continue
            try:
                rank = int(environ["RANK"])
            except ValueError:
                continue
            candidates.setdefault(rank, []).append((proc, environ))
        for rank, procs in candidates.items():
            if rank in self.ranks and self.ranks[rank].exit is None:
                continue
            # A DataLoader worker inherits RANK: the rank is the top-most process with that RANK.
            pids = {p.pid for p, _ in procs}
            top = [(p, e) for p, e in procs if _safe_ppid(p) not in pids or p.pid == launcher_pid]
            proc, environ = (top or procs)[0]
            local = environ.get("LOCAL_RANK")
            self._register(
                RankProcess(
                    rank=rank,
                    pid=proc.pid,
                    process=proc,
                    local_rank=int(local) if local and local.isdigit() else None,
                )
            )

    def _register(self, new: RankProcess) -> None:
        """`new` is the rank's process now; the one it replaces is kept in `earlier`."""
        old = self.ranks.get(new.rank)
        if old is not None and old.pid != new.pid:
            self.earlier.append(old)
            del self.earlier[:-64]
        self.ranks[new.rank] = new

    def add_rank(self, rank: int, pid: int) -> None:
        """Register a rank process by pid (e.g. the launcher itself for a plain `python script.py`)."""
        if rank in self.ranks and self.ranks[rank].pid == pid:
            return
        try:
            proc = self.descendants.get(pid) or psutil.Process(pid)
        except psutil.Error:
            return
        self._register(RankProcess(rank=rank, pid=pid, process=proc))

    def unjoined_processes(self, not_ranks: set[int] | None = None) -> list[psutil.Process]:
        """Live Python processes of the job that are not ranks and not children of ranks: workers
        that have not joined a process group (yet). Launchers, the pids in `not_ranks` (an mp.spawn
        parent) and multiprocessing's helper processes are left out."""
        rank_pids = {r.pid for r in self.ranks.values()}
        launcher = self.popen.pid if self.popen else None
        out = []
        for pid, proc in list(self.descendants.items()):
            if pid in rank_pids or pid in (not_ranks or set()) or not _alive(proc):
                continue
            try:
                cmdline = proc.cmdline()
                ancestors = {p.pid for p in proc.parents()}
            except psutil.Error:
                continue
            if ancestors & rank_pids or not cmdline or "python" not in os.path.basename(cmdline[0]):
                continue
            text = " ".join(cmdline)
            if (
                is_launcher_command(cmdline)
                or any(h in text for h in _HELPERS)
                or (pid == launcher and self.ranks)
            ):
                continue
            out.append(proc)
        return out

    def _reap_orphans(self) -> None:
        """Collect the exit status of orphans re-parented to us (we are their subreaper)."""
        launcher = self.popen.pid if self.popen else None
        for pid, proc in list(self.descendants.items()):
            if pid == launcher:
                continue
            try:
                if proc.ppid() != os.getpid():
                    continue
            except psutil.Error:
                pass
            try:
                got, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue
            if got == pid:
                self.reaped[pid] = status

    def _death_watch(self) -> None:
        """Notice rank deaths within ~50 ms, so that 'who died first' is answered by the clock."""
        while not self._stop_death_watch.wait(0.05):
            with self._lock:
                ranks = list(self.ranks.values()) + [r for r in self.earlier if r.exit is None]
            for rank in ranks:
                if rank.exit is not None:
                    continue
                if not _alive(rank.process):
                    rank.exit = {"t": time.time(), "source": "process watch", "pid": rank.pid}
                    self._fill_status(rank)

    def _fill_status(self, rank: RankProcess) -> None:
        status = self.reaped.get(rank.pid)
        if status is None and self.popen is not None and rank.pid == self.popen.pid:
            code = self.popen.poll()
            if code is None:
                try:
                    code = self.popen.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    code = None
            if code is not None:
                _set_code(rank.exit, code)
            return
        if status is None:
            try:
                if rank.process.ppid() == os.getpid():
                    got, status = os.waitpid(rank.pid, os.WNOHANG)
                    if got != rank.pid:
                        status = None
            except (ChildProcessError, psutil.Error):
                status = None
        if status is not None:
            _set_code(rank.exit, os.waitstatus_to_exitcode(status))

    def update_rank_exit_codes(self) -> None:
        for rank in self.ranks.values():
            if rank.exit is not None and "code" not in rank.exit and "signal" not in rank.exit:
                self._fill_status(rank)

    # -- signals and shutdown -----------------------------------------------------------------

    def signal_job(self, sig: int) -> bool:
        """Send `sig` to the launcher's process group (all of the job that stayed in it). False when
        the group is gone and only the launcher itself (if alive) got it."""
        if self.popen is None:
            return False
        try:
            os.killpg(self.popen.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            try:
                self.popen.send_signal(sig)
            except ProcessLookupError:
                pass
            return False

    def alive_processes(self) -> list[psutil.Process]:
        self.refresh()
        return [p for p in self.descendants.values() if _alive(p)]

    def kill_tree(self, grace: float = 5.0, first_signal: int = signal.SIGTERM) -> None:
        """Stop every process of the job: `first_signal` to all, then SIGKILL after `grace`.

        `first_signal` reaches each process once: through the launcher's process group, or directly
        for one that left the group. A rank's own SIGTERM handler (one that saves a checkpoint)
        then runs once, as under the launcher alone, and is not cut short by a second signal."""
        procs = self.alive_processes()
        group = self.popen.pid if self.signal_job(first_signal) and self.popen is not None else None
        for p in procs:
            if group is None or _process_group(p) != group:
                _send(p, first_signal)
            _send(p, signal.SIGCONT)  # a process left stopped by a failed stack dump cannot die of TERM
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_alive(p) for p in self.alive_processes()):
            self.poll()
            time.sleep(0.05)
        survivors = self.alive_processes()
        self.killed_hard.update(p.pid for p in (procs if first_signal == signal.SIGKILL else survivors))
        for p in survivors:
            _send(p, signal.SIGKILL)
        if survivors:
            psutil.wait_procs(survivors, timeout=3.0)
        self.finish()

    def wait_gone(self, timeout: float) -> bool:
        """Wait up to `timeout` s for the whole job to end by itself. True if nothing is left."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            if self.popen is not None and self.popen.poll() is not None and not self.alive_processes():
                return True
            time.sleep(0.1)
        return False

    def finish(self) -> None:
        """Reap the launcher and stop helper threads."""
        if self.popen is not None:
            try:
                self.popen.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                _send(psutil.Process(self.popen.pid), signal.SIGKILL)
                self.popen.wait(timeout=5.0)
            self.poll()
        self._reap_orphans()
        time.sleep(0.1)  # let the death watch record the last exits
        self._stop_death_watch.set()
        for thread in self._threads:
            thread.join(timeout=2.0)
        self.update_rank_exit_codes()


def _set_code(exit_info: dict[str, Any] | None, code: int) -> None:
    if exit_info is None:
        return
    if code < 0:
        exit_info["signal"] = -code
        exit_info["code"] = 128 - code
    else:
        exit_info["code"] = code
    exit_info["source"] = "wait status"


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _safe_ppid(proc: psutil.Process) -> int | None:
    try:
        return proc.ppid()
    except psutil.Error:
        return None


def _process_group(proc: psutil.Process) -> int | None:
    try:
        return os.getpgid(proc.pid)
    except OSError:
        return None


def _send(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except psutil.Error:
        pass


def _is_tool(proc: psutil.Process) -> bool:
    """sddoctor's own helpers (py-spy) are not part of the job."""
    try:
        return proc.name().startswith("py-spy")
    except psutil.Error:
        return False


def install_forwarding(job: Job, on_signal: Callable[[int], None]) -> Callable[[], None]:
    """Route SIGINT/SIGTERM/SIGHUP to `on_signal`; returns a function restoring the old handlers."""
    previous: dict[int, Any] = {}

    def handler(signum: int, _frame: Any) -> None:
        on_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            previous[sig] = signal.signal(sig, handler)
        except (ValueError, OSError):
            pass

    def restore() -> None:
        for sig, old in previous.items():
            try:
                signal.signal(sig, old)
            except (ValueError, OSError):
                pass

    del job
    return restore


def _child_of_rank(pid: int, environ: dict[str, str]) -> bool:
    """Whether the process inherited RANK from a rank that started it (a subprocess, a DataLoader
    worker): each rank puts its own pid into its environment (`boot.RANK_PID_ENV`) for its children.
    Such a process can outlive its rank, and would otherwise be taken for the rank's restart."""
    from sddoctor.instrument.boot import RANK_PID_ENV

    owner = environ.get(RANK_PID_ENV)
    return bool(owner) and owner != str(pid)
