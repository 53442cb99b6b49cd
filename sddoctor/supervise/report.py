"""report.json (versioned schema, see docs/run.md), report.md and the short summary on the terminal."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from sddoctor.supervise.health import render_health_markdown
from sddoctor.supervise.state import RankState, RunState, Verdict
from sddoctor.telemetry import RankSnapshot, RunDir, read_json
from sddoctor.telemetry.layout import atomic_write_text

REPORT_SCHEMA = "sddoctor.report/1"
REPORT_VERSION = 1
#: findings of `sddoctor run --preflight`, in the run directory
PREFLIGHT_FILE = "preflight.json"


def rank_summary(rank: RankState, state: RunState | None = None) -> dict[str, Any]:
    """The per-rank part of report.json and of /api/state (snapshot fields plus exit and stack, and
    with the run's `state` the rank's `activity`)."""
    out: dict[str, Any] = dict(rank.state)
    out["rank"] = rank.rank
    if state is not None:
        out["activity"] = rank.activity(
            state.now, state.started, state.startup_timeout, joined=state.past_startup(rank.rank)
        )
    if rank.pid is not None:
        out["pid"] = rank.pid
    if rank.host:
        out["host"] = rank.host
    out["alive"] = rank.alive
    if rank.remote:
        out["remote"] = True
    if rank.exit:
        out["exit"] = rank.exit
    if rank.exception:
        out["exception"] = {k: rank.exception.get(k) for k in ("t", "type", "message", "traceback", "caller")}
    if rank.stack:
        out["stack"] = {k: v for k, v in rank.stack.items() if k != "frames"}
        out["stack"]["frames"] = (rank.stack.get("frames") or [])[:40]
    if rank.faults:
        out["faults"] = [{k: v for k, v in f.items() if k not in ("v", "kind")} for f in rank.faults]
    return out


def build_report(
    state: RunState,
    verdicts: list[Verdict],
    *,
    run_info: dict[str, Any],
    outcome: str,
    exit_code: int | None,
    job_exit_code: int | None,
) -> dict[str, Any]:
    return {
        "schema": REPORT_SCHEMA,
        "version": REPORT_VERSION,
        "generated": time.time(),
        "run": run_info,
        "outcome": outcome,
        "exit_code": exit_code,
        "job_exit_code": job_exit_code,
        "duration_seconds": round(state.now - state.started, 3),
        "world_size": state.world_size,
        "hang_timeout": state.hang_timeout,
        "straggler_ratio": state.straggler_ratio,
        "verdicts": [v.to_dict() for v in verdicts],
        "ranks": {str(r): rank_summary(state.ranks[r], state) for r in sorted(state.ranks)},
        "stacks": {"dir": "stacks", "problem": state.stacks_problem},
        "flight_recorder": state.flight_recorder,
        "launcher": {
            "failures": state.launcher_failures,
            "stderr_tail": state.stderr_tail[-60:],
        },
    }


def attach_preflight(report: dict[str, Any], run_dir: RunDir) -> None:
    """Copy RUN_DIR/preflight.json (written by `sddoctor run --preflight`) into the report."""
    data = read_json(run_dir.path / PREFLIGHT_FILE)
    if isinstance(data, dict):
        report["preflight"] = data


def write_report(run_dir: RunDir, report: dict[str, Any]) -> None:
    """report.json and report.md, with the run's health summary attached; then report.html."""
    data = attach_health(report, run_dir)
    atomic_write_text(run_dir.report_json, json.dumps(report, indent=2, default=str))
    atomic_write_text(run_dir.report_md, render_markdown(report))
    if data is not None:
        write_html(data)


def attach_health(report: dict[str, Any], run_dir: RunDir) -> Any:
    """Add `health` (throughput, step times, waits, memory, OOMs, settings) to the report.

    Returns the loaded RunData for the other views, or None when the run directory could not be
    read (the report keeps `health: {"error": ...}`: a bug here must not cost the diagnosis).
    """
    from sddoctor.supervise.health import health_summary
    from sddoctor.supervise.rundata import RunData

    try:
        data = RunData.load(run_dir, report)
        report["health"] = health_summary(data.view, data.timeline, data.gpu_samples)
    except Exception as exc:  # noqa: BLE001 - the verdicts matter more than the summary
        report["health"] = {"error": f"{type(exc).__name__}: {exc}"}
        return None
    return data


def write_html(data: Any, path: Path | None = None) -> str | None:
    """report.html (RUN_DIR/report.html unless `path`); returns why it could not be written, or None."""
    from sddoctor.supervise.report_html import render_html

    try:
        atomic_write_text(path or data.run_dir.report_html, render_html(data))
    except Exception as exc:  # noqa: BLE001 - report.json and report.md are written already
        return f"{type(exc).__name__}: {exc}"
    return None


def headline(report: dict[str, Any]) -> str:
    verdicts = report.get("verdicts") or []
    outcome = report.get("outcome", "?")
    code = report.get("exit_code")
    if outcome == "preflight_failed":
        return f"sddoctor: the preflight failed (exit code {code}); the job was not launched"
    if outcome == "usage_error":
        return (
            f"sddoctor: a rank stopped the job on a usage error (exit code {code}); see the message above "
            "(SDDOCTOR_FAULT names a rank outside the world the job turned out to have)"
        )
    how = f"exit code {code}" if code is not None else "diagnosed from the run directory's files"
    if not verdicts:
        return f"sddoctor: {outcome} ({how}); no problem found"
    return f"sddoctor: {outcome} ({how}); {len(verdicts)} finding{'s' if len(verdicts) > 1 else ''}"


def unfired_faults(report: dict[str, Any]) -> list[str]:
    """A line for each injected fault (SDDOCTOR_FAULT in run.json) that no rank fired in a run that
    has ended: a test of sddoctor whose fault never happened must not read as a clean bill."""
    spec = (report.get("run") or {}).get("fault")
    if not isinstance(spec, str) or report.get("outcome") in (
        None,
        "running",
        "usage_error",
        "preflight_failed",
    ):
        return []
    fired = {
        str(event.get("fault", "")).strip()
        for rank in (report.get("ranks") or {}).values()
        for event in (rank or {}).get("faults") or []
        if isinstance(event, dict)
    }
    return [
        f"the injected fault {fault!r} never fired ({_why_unfired(fault)})"
        for fault in (part.strip() for part in spec.split(";"))
        if fault and fault not in fired
    ]


def _why_unfired(fault: str) -> str:
    why = "its rank never reached that step or collective"
    if fault.startswith("shape"):
        # a shape fault leaves a call without a tensor payload (all_gather_object, ...) alone
        why += ", or that collective carries no tensor whose shape it could change"
    return why


def render_summary(report: dict[str, Any], run_dir: str | None = None) -> str:
    """The few lines printed at the end of `sddoctor run` and by `sddoctor report`."""
    lines = [headline(report)]
    for v in report.get("verdicts") or []:
        where = []
        if v.get("culprit_rank") is not None:
            where.append(f"rank {v['culprit_rank']}")
        if v.get("location"):
            where.append(str(v["location"]))
        lines.append(f"  [{v.get('severity')}] {v.get('kind')}" + (f" ({', '.join(where)})" if where else ""))
        lines.append(f"      {v.get('summary')}")
    problem = (report.get("stacks") or {}).get("problem")
    if problem:
        lines.append(f"  stacks: {problem}")
    lines += [f"  note: {note}" for note in unfired_faults(report)]
    lines += _preflight_lines(report)
    if run_dir and report.get("diagnosed_offline"):
        lines.append(f"  full report: sddoctor report --markdown {run_dir} (--json for machines)")
    elif run_dir:
        lines.append(f"  report: {run_dir}/report.md (report.json for machines)")
    return "\n".join(lines)


def render_markdown(report: dict[str, Any]) -> str:
    run = report.get("run") or {}
    out = [
        "# sddoctor report",
        "",
        f"- command: `{' '.join(run.get('command') or [])}`",
        f"- host: {run.get('host')}, world size: {report.get('world_size')}",
        f"- outcome: **{report.get('outcome')}**, exit code {report.get('exit_code')}"
        f" (job: {report.get('job_exit_code')}), {report.get('duration_seconds')} s",
        "",
        "## Verdicts",
        "",
    ]
    verdicts = report.get("verdicts") or []
    if not verdicts:
        out.append("No problem found.")
    for note in unfired_faults(report):
        out += ["", f"Note: {note}."]
    for v in verdicts:
        out.append(f"### {v.get('kind')} ({v.get('severity')})")
        out.append("")
        out.append(str(v.get("summary")))
        out.append("")
        out.append(f"- culprit rank: {v.get('culprit_rank')}")
        out.append(f"- location: `{v.get('location')}`")
        for e in v.get("evidence") or []:
            out.append(f"- {e}")
        tb = (v.get("details") or {}).get("traceback")
        if tb:
            out += ["", "```", *[str(x) for x in tb], "```"]
        out.append("")
    out += [
        "## Ranks",
        "",
        "| rank | pid | activity | step | phase | last collective | in flight | exit | stack top |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in (report.get("ranks") or {}).items():
        stack = r.get("stack") or {}
        snapshot = RankSnapshot.of(r)
        done = snapshot.last_done
        last = f"{done.op} #{done.seq} ({done.caller})" if done else ""
        inflight = ", ".join(f"{c.op} #{c.seq}" for c in snapshot.inflight)
        out.append(
            f"| {key} | {r.get('pid')} | {r.get('activity', r.get('alive'))} | {r.get('step')} | {r.get('phase')} "
            f"| {last} | {inflight} "
            f"| {_exit_text(r.get('exit'))} | {stack.get('top_user_frame') or stack.get('error') or ''} |"
        )
    problem = (report.get("stacks") or {}).get("problem")
    if problem:
        out += ["", f"Stacks: {problem}"]
    health = report.get("health")
    if isinstance(health, dict) and "ranks" in health:
        out += ["", *render_health_markdown(health)]
    preflight = report.get("preflight")
    if isinstance(preflight, dict):
        out += [
            "",
            "## Preflight",
            "",
            f"Worst: **{preflight.get('worst')}** ({preflight.get('seconds')} s).",
            "",
        ]
        out += ["| severity | id | finding | remedy |", "|---|---|---|---|"]
        for f in preflight.get("findings") or []:
            if isinstance(f, dict):
                cells = [
                    str(f.get(k) or "").replace("|", "\\|") for k in ("severity", "id", "title", "remedy")
                ]
                out.append("| " + " | ".join(cells) + " |")
    tail = (report.get("launcher") or {}).get("stderr_tail") or []
    if tail:
        out += ["", "## Launcher stderr (last lines)", "", "```", *tail[-30:], "```"]
    return "\n".join(out) + "\n"


def _exit_text(exit_info: Any) -> str:
    if not isinstance(exit_info, dict):
        return ""
    if exit_info.get("signal"):
        return f"signal {exit_info['signal']}"
    if exit_info.get("code") is None:
        return "gone" if exit_info.get("unclean") or exit_info.get("t") else ""
    return f"code {exit_info.get('code')}"


def _preflight_lines(report: dict[str, Any]) -> list[str]:
    preflight = report.get("preflight")
    if not isinstance(preflight, dict):
        return []
    bad = [
        f
        for f in preflight.get("findings") or []
        if isinstance(f, dict) and f.get("severity") in ("warn", "fail")
    ]
    if not bad:
        return [f"  preflight: {preflight.get('worst')}, nothing to fix"]
    return [f"  preflight: {f.get('severity')} {f.get('id')}: {f.get('title')}" for f in bad]
