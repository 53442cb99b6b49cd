"""report.md's health summary, report.html and `sddoctor trace` on real 2-rank gloo runs under
`sddoctor run`: a straggler (rank 1 sleeps before every collective) and a hang (rank 1 skips
all_reduce #5). Both runs start side by side in one module-scoped fixture.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from supervise_fixtures import SCRIPT, Supervised, run_supervised, script_line, torchrun

from conftest import subprocess_env
from sddoctor.supervise.timeline import load_timeline
from sddoctor.supervise.trace import check_trace
from sddoctor.telemetry import RunDir

pytestmark = pytest.mark.slow

STEPS = 16
COLLECTIVE = script_line("# COLLECTIVE")
RUNS = {
    "straggler": (
        "sleep:rank=1,seconds=0.25,seq=1,every=1",
        {"STEPS": str(STEPS), "PAUSE": "0.01", "REPORT_STEPS": "1"},
        ("--hang-timeout", "30"),
    ),
    "hang": (
        "skip:rank=1,seq=5",
        {"STEPS": "50", "REPORT_STEPS": "1"},
        ("--hang-timeout", "4", "--on-hang", "kill"),
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Supervised]:
    root = tmp_path_factory.mktemp("report-views")

    def one(name: str) -> Supervised:
        fault, env, options = RUNS[name]
        where = root / name
        where.mkdir()
        return run_supervised(
            where, torchrun(2, str(SCRIPT)), fault=fault, env=env, options=options, timeout=120
        )

    with ThreadPoolExecutor(max_workers=len(RUNS)) as pool:
        futures = {name: pool.submit(one, name) for name in RUNS}
        return {name: f.result() for name, f in futures.items()}


def test_straggler_timeline_names_the_rank_everyone_waited_for(runs):
    res = runs["straggler"]
    assert res.returncode == 0, res.stderr
    timeline = load_timeline(RunDir(res.run_dir))
    slow, fast = timeline.lanes[1], timeline.lanes[0]
    assert slow.role == "straggler" and fast.role == ""
    # STEPS all_reduces + the final barrier, on both ranks, matched by sequence number
    assert timeline.matched == STEPS + 1
    assert [c.seq for c in fast.calls] == list(range(1, STEPS + 2))
    assert all(c.caller == COLLECTIVE for c in fast.calls[:STEPS])
    # rank 1 sleeps 0.25 s before each collective: it arrives last every time, rank 0 waits for it
    assert slow.last_arrivals() == STEPS + 1 and fast.last_arrivals() == 0
    waits = [c.wait for c in fast.calls]
    assert all(c.late_rank == 1 for c in fast.calls) and min(waits) > 0.15, waits
    assert fast.waited() > 10 * slow.waited()
    assert [s.step for s in fast.steps] == list(range(1, STEPS + 1))


def test_health_summary_in_report_md_and_json(runs):
    res = runs["straggler"]
    health = res.report["health"]
    r0, r1 = health["ranks"]["0"], health["ranks"]["1"]
    assert r0["steps"] == r1["steps"] == STEPS
    assert 0.2 < r0["step_time_p50"] < 2.0 and r0["step_time_p95"] >= r0["step_time_p50"]
    assert r1["arrived_last"] == r1["matched_collectives"] == STEPS + 1
    assert r0["wait_share"] > 0.1 > r1["wait_share"]
    assert r0["collective_share"] > r1["collective_share"]
    assert health["throughput"]["samples"] == 2 * 4 * STEPS and health["throughput"]["images_per_s"] > 0
    assert health["comm"]["recorded"] and health["comm"]["backend"] == "gloo"
    assert health["comm"]["env"]["MASTER_ADDR"] and "TORCH_FR_BUFFER_SIZE" in health["comm"]["env"]
    md = (res.run_dir / "report.md").read_text()
    assert "## Health" in md and "### Communication settings" in md and "No OOM, no fallback." in md
    assert f"| {STEPS + 1} of {STEPS + 1} |" in md  # rank 1 arrived last at every collective


def test_hang_timeline_shows_the_missing_rank_and_the_wait(runs):
    res = runs["hang"]
    assert res.returncode == 124, res.stderr
    timeline = load_timeline(RunDir(res.run_dir))
    missing, waiting = timeline.lanes[1], timeline.lanes[0]
    assert missing.role == "missing" and missing.note == "never reached all_reduce #5 (pg 0)"
    assert [c.seq for c in missing.calls] == [1, 2, 3, 4]
    stuck = waiting.calls[-1]
    assert (stuck.seq, stuck.t1) == (5, None) and stuck.wait >= 4.0  # --hang-timeout 4
    (never,) = [m for m in missing.marks if "never reached" in m.label]
    assert never.t == stuck.t0 and never.severity == "error"
    assert any(m.kind == "fault" for m in missing.marks)


def test_report_html_is_written_next_to_report_md(runs):
    for res in runs.values():
        page = (res.run_dir / "report.html").read_text()
        assert res.report["verdicts"][0]["summary"].split(":")[0] in page
        assert 'id="timeline-plot"' in page and 'class="c ' in page
        assert "rank 1" in page and 'id="step-time"' in page and 'id="loss"' in page
    hang_page = (runs["hang"].run_dir / "report.html").read_text()
    assert 'class="badge missing"' in hang_page and 'class="c stuck"' in hang_page
    assert "<details><summary>rank 1: stack at" in hang_page
    assert 'class="badge straggler"' in (runs["straggler"].run_dir / "report.html").read_text()


def _sddoctor(*args: str, cwd=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sddoctor", *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def test_trace_export_of_a_hang(runs, tmp_path):
    res = runs["hang"]
    out = tmp_path / "trace.json"
    proc = _sddoctor("trace", str(res.run_dir), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stderr and "ui.perfetto.dev" in proc.stderr
    trace = json.loads(out.read_text())
    assert check_trace(trace) == []
    events = trace["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {
        (0, "rank 0 (" + res.report["ranks"]["0"]["host"] + ")"),
        (1, f"rank 1 ({res.report['ranks']['1']['host']}) [missing]"),
    }
    slices = [e for e in events if e["ph"] == "X"]
    assert any(e["pid"] == 0 and e["name"] == "all_reduce #5 (still inside at the end)" for e in slices)
    assert sum(1 for e in slices if e["pid"] == 1 and e["cat"] == "collective") == 4
    assert any(e["pid"] == 1 and e["cat"] == "step" for e in slices)
    instants = [e for e in events if e["ph"] == "i"]
    assert any(e["pid"] == 1 and "never reached all_reduce #5" in e["name"] for e in instants)
    assert any(e["s"] == "g" and e["name"].startswith("hang declared") for e in instants)
    assert trace["otherData"]["outcome"] == "hang"


def test_trace_export_of_a_straggler_has_the_waits(runs, tmp_path):
    res = runs["straggler"]
    proc = _sddoctor("trace", str(res.run_dir))
    assert proc.returncode == 0, proc.stderr
    trace = json.loads((res.run_dir / "trace.json").read_text())
    waits = [e for e in trace["traceEvents"] if e.get("cat") == "wait"]
    assert len(waits) == STEPS + 1 and {e["pid"] for e in waits} == {0}
    assert all(e["name"] == "wait for rank 1" and e["dur"] > 150_000 for e in waits)  # microseconds


def test_report_html_from_the_command_line_without_a_report(runs, tmp_path):
    """`sddoctor report --html` on a copy with no report at all: diagnosed from the files, then drawn."""
    copy = tmp_path / "copy"
    shutil.copytree(runs["straggler"].run_dir, copy)
    for name in ("report.json", "report.md", "report.html"):
        (copy / name).unlink()
    proc = _sddoctor("report", "--html", str(copy))
    assert proc.returncode == 0, proc.stderr  # a straggler is a warning
    assert f"wrote {copy / 'report.html'}" in proc.stderr
    page = (copy / "report.html").read_text()
    assert "straggler" in page and 'id="timeline-plot"' in page
    md = _sddoctor("report", "--markdown", str(copy))
    assert "## Health" in md.stdout
    elsewhere = _sddoctor("report", "--html", "-o", str(tmp_path / "page.html"), str(copy))
    assert elsewhere.returncode == 0 and (tmp_path / "page.html").exists()


def test_bad_input_is_one_line_with_a_fix(tmp_path):
    missing = _sddoctor("trace", str(tmp_path / "nope"))
    assert (
        missing.returncode == 2
        and "is not a directory" in missing.stderr
        and "Traceback" not in missing.stderr
    )
    empty = _sddoctor("trace", str(tmp_path))
    assert empty.returncode == 2 and "not a sddoctor or trainer run directory" in empty.stderr
    none = _sddoctor("trace", cwd=tmp_path)
    assert none.returncode == 2 and "no run directory found" in none.stderr
    lone = _sddoctor("report", "-o", "x.html", str(tmp_path))
    assert lone.returncode == 2 and "--output goes with --html" in lone.stderr
