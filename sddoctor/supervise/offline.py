"""Diagnose a run directory after the fact (no supervisor was watching, e.g. the trainer's own run)."""

from __future__ import annotations

import socket
import time
from typing import Any

import psutil

from sddoctor.supervise.diagnose import diagnose, merge_verdicts, rank_exit
from sddoctor.supervise.facts import apply_facts, hang_verdicts, read_facts
from sddoctor.supervise.report import attach_preflight, build_report
from sddoctor.supervise.watch import Watcher
from sddoctor.telemetry import RunDir


def diagnose_run_dir(run_dir: RunDir, now: float | None = None) -> dict[str, Any]:
    """A report dict built from the files alone (nothing is written)."""
    now = time.time() if now is None else now
    info = run_dir.run_info()
    options = info.get("options") or {}
    watcher = Watcher(
        run_dir,
        hang_timeout=float(options.get("hang_timeout") or 300.0),
        straggler_ratio=float(options.get("straggler_ratio") or 2.0),
        startup_timeout=float(options.get("startup_timeout") or 900.0),
        started=float(info.get("started") or info.get("created") or now),
    )
    watcher.poll(now)
    host = socket.gethostname()
    last_progress = None
    for rank in watcher.ranks.values():
        done = rank.last_done or {}
        for t in (done.get("t"), (rank.state.get("last_step") or {}).get("t")):
            if isinstance(t, (int, float)):
                last_progress = max(last_progress or 0.0, float(t))
        if rank.exit is None and rank.pid and rank.host == host:
            rank.alive = psutil.pid_exists(rank.pid)
            if not rank.alive:
                rank.exit = {
                    "t": rank.state.get("heartbeat") or rank.state.get("t"),
                    "source": "process gone without an exit event (killed?)",
                    "unclean": True,
                }
    watcher.last_progress = last_progress or watcher.last_progress
    state = watcher.state(now)
    facts = read_facts(run_dir)
    if facts is not None and "outcome" in facts:
        # A supervisor watched this run to its end: its facts give the live run's verdict again.
        apply_facts(state, facts)
        for rank in state.ranks.values():
            rank.alive = False
            rank.exit = rank_exit(rank, state)
        verdicts = merge_verdicts(hang_verdicts(facts), diagnose(state))
        report = build_report(
            state,
            verdicts,
            run_info=info,
            outcome=str(facts["outcome"]),
            exit_code=facts.get("exit_code"),
            job_exit_code=(facts.get("job_exit") or {}).get("code"),
        )
        report["diagnosed_offline"] = True
        attach_preflight(report, run_dir)
        return report
    ended = all(r.exited for r in state.ranks.values()) if state.ranks else True
    if ended:
        state.job_exit = {"code": None, "t": None}
    verdicts = diagnose(state)
    failed = any(v.severity == "error" for v in verdicts)
    outcome = ("failed" if failed else "ok") if ended else ("hang" if state.hung else "running")
    report = build_report(state, verdicts, run_info=info, outcome=outcome, exit_code=None, job_exit_code=None)
    report["diagnosed_offline"] = True
    attach_preflight(report, run_dir)
    return report
