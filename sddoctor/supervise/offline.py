"""Diagnose a run directory after the fact (no supervisor was watching, e.g. the trainer's own run)."""

from __future__ import annotations

import socket
import time
from typing import Any

from sddoctor.gpu.host import pid_running
from sddoctor.supervise.diagnose import diagnose, merge_verdicts, place_stackless_culprits
from sddoctor.supervise.facts import hang_verdicts, read_facts, settle_exits
from sddoctor.supervise.lifecycle import lease_status
from sddoctor.supervise.payloads import attach_mismatches
from sddoctor.supervise.report import attach_preflight, build_report
from sddoctor.supervise.watch import Watcher
from sddoctor.telemetry import RunDir, read_json
from sddoctor.telemetry.runinfo import read_run_info


def diagnose_run_dir(run_dir: RunDir, now: float | None = None) -> dict[str, Any]:
    """A report dict built from the files alone (nothing is written)."""
    now = time.time() if now is None else now
    run = read_run_info(run_dir)
    info = run.record
    watcher = Watcher(run_dir, options=run.options, started=run.start if run.start else now)
    watcher.poll(now)
    host = socket.gethostname()
    last_progress = None
    for rank in watcher.ranks.values():
        snapshot = rank.snapshot
        for t in (snapshot.last_done.t if snapshot.last_done else None, snapshot.last_step.t):
            if t is not None:
                last_progress = max(last_progress or 0.0, t)
        if rank.exit is None and rank.pid and rank.host == host:
            rank.alive = pid_running(rank.pid)
            if not rank.alive:
                rank.exit = {
                    "t": snapshot.alive_at,
                    "source": "process gone without an exit event (killed?)",
                    "unclean": True,
                    # it died at some time after this: its last heartbeat, not its death
                    "last_seen_alive": True,
                }
    watcher.last_progress = last_progress or watcher.last_progress
    facts = read_facts(run_dir)
    if facts is not None and "outcome" in facts:
        # A supervisor watched this run to its end: its facts give the live run's verdict again.
        state = watcher.state(now, facts)
        for rank in state.ranks.values():
            rank.alive = False
        settle_exits(state)
        frozen = place_stackless_culprits(hang_verdicts(facts), state)
        if not frozen:  # after a hang the ranks' call numbers need not line up
            attach_mismatches(state, run_dir)
        verdicts = merge_verdicts(frozen, diagnose(state))
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
    state = watcher.state(now)
    supervisor = lease_status(run_dir.path, now)
    if supervisor is not None and supervisor.get("state") == "died":
        # Its processes stopped themselves once it was gone: those deaths are not crashes.
        state.stopped_by_supervisor = "supervisor died"
        state.stopped_at = supervisor.get("died_at")
    ended = all(r.exited for r in state.ranks.values()) if state.ranks else True
    if ended:
        state.job_exit = {"code": None, "t": None}
        attach_mismatches(state, run_dir)
    verdicts = diagnose(state)
    failed = any(v.severity == "error" for v in verdicts)
    outcome = ("failed" if failed else "ok") if ended else ("hang" if state.hung else "running")
    report = build_report(state, verdicts, run_info=info, outcome=outcome, exit_code=None, job_exit_code=None)
    report["diagnosed_offline"] = True
    if supervisor is not None:
        report["supervisor"] = supervisor
        if supervisor.get("state") == "died" and ended:
            report["outcome"] = "supervisor_died"
    attach_preflight(report, run_dir)
    return report


#: report.json markers this sddoctor reads: the old style ("sddoctor.report" + "version") and
#: "sddoctor.report/<version>"
KNOWN_REPORT_VERSION = 1
_VERDICT_FIELDS = {
    "kind": "str",
    "severity": "str",
    "summary": "str",
    "culprit_rank": "int?",
    "location": "str?",
    "details": "dict",
    "evidence": "list",
}
_RANK_EXTRA = {"exit": "dict", "exception": "dict", "stack": "dict", "faults": "list", "alive": "bool?"}
_REPORT_FIELDS = {
    "outcome": "str",
    "exit_code": "int?",
    "job_exit_code": "int?",
    "duration_seconds": "num",
    "world_size": "int?",
    "verdicts": "list",
    "ranks": "dict",
    "run": "dict",
    "stacks": "dict",
    "launcher": "dict",
    "preflight": "dict?",
    "flight_recorder": "dict?",
}


def report_version(doc: dict[str, Any]) -> int | None:
    """The schema version of a report.json, or None when it is not a sddoctor report."""
    schema = doc.get("schema")
    if schema == "sddoctor.report":
        version = doc.get("version", 1)
        return version if isinstance(version, int) else None
    if isinstance(schema, str) and schema.startswith("sddoctor.report/"):
        tail = schema.rsplit("/", 1)[1]
        return int(tail) if tail.isdigit() else None
    return None


def clean_report(doc: dict[str, Any]) -> dict[str, Any]:
    """A report.json fit for rendering: wrong-typed parts dropped, each dropped part noted."""
    from sddoctor.telemetry.validate import PROBLEMS, clean, clean_run_info, clean_state

    src = "report.json"
    version = report_version(doc)
    if version is not None and version > KNOWN_REPORT_VERSION:
        PROBLEMS.note(
            src, f"written by a newer sddoctor (report v{version}; this one reads v{KNOWN_REPORT_VERSION})"
        )
    out = clean(doc, _REPORT_FIELDS, src) or {}
    out["run"] = clean_run_info(out.get("run") or {}, src)
    verdicts = []
    for v in out.get("verdicts") or []:
        v = clean(v, _VERDICT_FIELDS, src)
        if v is not None and "kind" in v:
            v["evidence"] = [str(e) for e in v.get("evidence") or []]
            details = v.get("details") or {}
            if "traceback" in details and not isinstance(details["traceback"], list):
                details = {k: x for k, x in details.items() if k != "traceback"}
            v["details"] = details
            verdicts.append(v)
    out["verdicts"] = verdicts
    ranks = {}
    for key, rank in (out.get("ranks") or {}).items():
        rank = clean_state(rank, src)
        rank = clean(rank, _RANK_EXTRA, src) if rank is not None else None
        if rank is not None:
            ranks[str(key)] = rank
    out["ranks"] = ranks
    launcher = out.get("launcher") or {}
    tail = launcher.get("stderr_tail")
    out["launcher"] = dict(launcher, stderr_tail=[str(x) for x in tail] if isinstance(tail, list) else [])
    return out


def load_report(run_dir: RunDir) -> dict[str, Any] | None:
    """report.json of a run directory made fit for rendering, or None when there is none to trust
    (missing, garbled, or not a sddoctor report: the caller diagnoses from the telemetry)."""
    from sddoctor.telemetry.validate import PROBLEMS

    doc = read_json(run_dir.report_json)
    if doc is None:
        return None
    if report_version(doc) is None:
        PROBLEMS.note(
            "report.json", "not a sddoctor report (no known schema marker): diagnosed from the telemetry"
        )
        return None
    return clean_report(doc)
