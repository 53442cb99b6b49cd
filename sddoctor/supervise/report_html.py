"""report.html: the whole report on one self-contained page (inline CSS, SVG and a little JS).

Verdict first; then every rank's steps and collectives on one time axis (arrival, waiting for the
last rank, completion; the rank the others waited for, or the one that never arrived, stands out);
the health summary; step time, loss, throughput and memory plots; GPU utilisation and memory
over time when `sddoctor run` sampled them; OOM fallbacks; every rank's stack, folded.

The page fetches nothing (a Content-Security-Policy forbids it): it can be mailed, attached to a
ticket or opened from a cluster's shared disk. Without JavaScript everything is still there; the
script only adds zooming the timeline and highlighting one collective across ranks.
"""

from __future__ import annotations

import json
import time
from html import escape
from typing import Any

from sddoctor import __version__
from sddoctor.supervise.health import gib_text, seconds_text, share_text
from sddoctor.supervise.report import headline
from sddoctor.supervise.rundata import RunData
from sddoctor.supervise.svgplot import Series, colour, line_chart
from sddoctor.supervise.timeline import Call, Lane, Timeline, window
from sddoctor.telemetry import RankSnapshot

LANE_H = 46
AXIS_H = 26
#: collectives drawn in the timeline, all ranks together (the page stays a few MB)
CALL_BUDGET = 24000


def render_html(data: RunData) -> str:
    report = data.report
    run = report.get("run") or {}
    title = f"sddoctor report: {report.get('outcome')} - {data.run_dir.path.name}"
    body = [
        _header(report, run, data),
        _verdicts(report),
        _timeline_section(data.timeline, str(data.run_dir.path)),
        _health_section(report.get("health") or {}),
        _plots_section(data),
        _oom_section(report.get("health") or {}, data.timeline),
        _ranks_section(report),
        _comm_section((report.get("health") or {}).get("comm") or {}),
        _preflight_section(report),
        _launcher_section(report),
        f"<footer>sddoctor {escape(__version__)}, written {escape(time.strftime('%Y-%m-%d %H:%M:%S'))}. "
        f"The raw data: report.json and ranks/ in {escape(str(data.run_dir.path))}.</footer>",
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:\">"
        '<link rel="icon" href="data:,">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body>"
        + "\n".join(part for part in body if part)
        + f"<script>{JS}</script></body></html>\n"
    )


# -- header and verdicts ----------------------------------------------------------------------------


def _header(report: dict[str, Any], run: dict[str, Any], data: RunData) -> str:
    outcome = str(report.get("outcome") or "?")
    worst = _worst(report.get("verdicts") or [])
    started = run.get("started") or run.get("created")
    facts = [
        ("command", " ".join(str(x) for x in run.get("command") or []) or "-"),
        ("host", str(run.get("host") or "-")),
        ("world size", str(report.get("world_size") or "-")),
        ("duration", seconds_text(report.get("duration_seconds"))),
        ("started", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "-"),
        ("run dir", str(data.run_dir.path)),
    ]
    rows = "".join(f"<tr><th>{escape(k)}</th><td><code>{escape(v)}</code></td></tr>" for k, v in facts)
    return (
        f'<header class="outcome outcome-{escape(outcome)} worst-{escape(worst)}">'
        f'<h1 id="headline">{escape(headline(report))}</h1><table class="facts">{rows}</table></header>'
    )


def _worst(verdicts: list[dict[str, Any]]) -> str:
    order = {"error": 3, "warning": 2, "info": 1}
    worst = max((order.get(str(v.get("severity")), 0) for v in verdicts), default=0)
    return {3: "error", 2: "warning", 1: "info"}.get(worst, "none")


def _verdicts(report: dict[str, Any]) -> str:
    verdicts = report.get("verdicts") or []
    if not verdicts:
        return '<section id="verdicts"><p class="ok-line">No problem found.</p></section>'
    cards = []
    for v in verdicts:
        where = []
        if v.get("culprit_rank") is not None:
            where.append(f"rank {v['culprit_rank']}")
        if v.get("location"):
            where.append(str(v["location"]))
        evidence = "".join(f"<li>{escape(str(e))}</li>" for e in v.get("evidence") or [])
        details = json.dumps(v.get("details") or {}, indent=1, default=str)
        traceback = (v.get("details") or {}).get("traceback")
        tb = ""
        if traceback:
            tb = f"<details><summary>traceback</summary><pre>{escape(chr(10).join(map(str, traceback)))}</pre></details>"
        cards.append(
            f'<article class="verdict sev-{escape(str(v.get("severity")))}">'
            f'<h2><span class="kind">{escape(str(v.get("kind")))}</span> <span class="sev">{escape(str(v.get("severity")))}</span>'
            f"{' <span class=where>' + escape(' · '.join(where)) + '</span>' if where else ''}</h2>"
            f'<p class="summary">{escape(str(v.get("summary")))}</p><ul>{evidence}</ul>{tb}'
            f"<details><summary>details</summary><pre>{escape(details)}</pre></details></article>"
        )
    return f'<section id="verdicts">{"".join(cards)}</section>'


# -- the timeline ------------------------------------------------------------------------------------


def _timeline_section(timeline: Timeline, run_dir: str) -> str:
    head = '<section id="timeline"><h2>Timeline</h2>'
    span = window(timeline, max_calls=max(100, CALL_BUDGET // max(1, len(timeline.lanes))))
    if timeline.is_empty() or span is None:
        return head + "<p>No steps or collectives were recorded in this run directory.</p></section>"
    ws, we = span
    we = max(we, ws + 1e-3)
    origin = timeline.start or ws
    whole = (timeline.end or we) - origin
    shown = f"from {seconds_text(ws - origin)} to {seconds_text(we - origin)} of {seconds_text(whole)}"
    if ws <= origin:
        shown = f"the whole run ({seconds_text(whole)})"
    intro = (
        f"<p>Each rank's steps (upper row) and collectives (lower row), {shown}, on one clock "
        f"(seconds since the first rank started; several hosts: each host's clock). "
        f'<span class="sw wait"></span> waiting for the last rank to arrive, <span class="sw xfer"></span> the rest of '
        f'the collective, <span class="sw last"></span> the rank that arrived last (the others waited for it), '
        f'<span class="sw stuck"></span> still inside at the end, <span class="sw mark"></span> an event (hover for what). '
        f"Hover a collective to see it on every rank; zoom with the buttons or Ctrl + wheel. The whole run as a "
        f"trace for ui.perfetto.dev: <code>sddoctor trace {escape(run_dir)} -o trace.json</code>.</p>"
    )
    labels = "".join(_lane_label(lane) for lane in timeline.lanes.values())
    plot_h = AXIS_H + LANE_H * len(timeline.lanes)
    lanes = "".join(_lane_svg(lane, i, ws, we) for i, lane in enumerate(timeline.lanes.values()))
    axis = "".join(_axis_ticks(ws, we, origin))
    return (
        head + intro + '<div class="zoom"><button type="button" data-zoom="2">zoom in</button>'
        '<button type="button" data-zoom="0.5">zoom out</button><button type="button" data-zoom="0">reset</button></div>'
        f'<div class="tl"><div class="tl-labels" style="padding-top:{AXIS_H}px">{labels}</div>'
        f'<div class="tl-scroll"><svg id="timeline-plot" class="tl-plot" height="{plot_h}" '
        f'data-start="{ws - origin:.6f}" data-end="{we - origin:.6f}" xmlns="http://www.w3.org/2000/svg">'
        f'<g class="axis">{axis}</g>{lanes}</svg></div></div></section>'
    )


def _lane_label(lane: Lane) -> str:
    stats = lane.last_arrivals(), sum(1 for c in lane.calls if c.late_rank is not None)
    bits = [f"waited {seconds_text(lane.waited())}"] if lane.calls else []
    if stats[1]:
        bits.append(f"last {stats[0]}/{stats[1]}")
    badge = f'<span class="badge {escape(lane.role)}">{escape(lane.role)}</span>' if lane.role else ""
    note = f' title="{escape(lane.note)}"' if lane.note else ""
    host = f" · {escape(lane.host)}" if lane.host else ""
    return (
        f'<div class="lane-label role-{escape(lane.role or "none")}"{note} style="height:{LANE_H}px">'
        f"<b>rank {lane.rank}</b>{host} {badge}<br><small>{escape(', '.join(bits))}</small></div>"
    )


def _pct(t: float, ws: float, we: float) -> float:
    return max(0.0, min(100.0, (t - ws) / (we - ws) * 100.0))


def _axis_ticks(ws: float, we: float, origin: float) -> list[str]:
    from sddoctor.supervise.svgplot import nice_ticks, tick_text

    out = []
    for tick in nice_ticks(ws - origin, we - origin, 10):
        x = _pct(tick + origin, ws, we)
        if 2.0 < x < 98.0:  # a centred label at the very edge would be cut
            out.append(
                f'<line class="tick" x1="{x:.4f}%" x2="{x:.4f}%" y1="{AXIS_H - 6}" y2="100%"/>'
                f'<text class="tick" x="{x:.4f}%" y="{AXIS_H - 10}" text-anchor="middle">{tick_text(tick)} s</text>'
            )
    return out


def _lane_svg(lane: Lane, index: int, ws: float, we: float) -> str:
    y = AXIS_H + index * LANE_H
    out = [f'<g class="lane role-{escape(lane.role or "none")}" data-rank="{lane.rank}">']
    out.append(f'<rect class="lane-bg" x="0" y="{y}" width="100%" height="{LANE_H}"/>')
    end = lane.end if lane.end is not None else we
    for step in lane.steps:
        if step.t1 < ws or step.t0 > we:
            continue
        out.append(
            _rect(
                "step" + (" odd" if step.step % 2 else ""),
                step.t0,
                step.t1,
                y + 4,
                12,
                ws,
                we,
                _step_title(step),
            )
        )
    for call in lane.calls:
        call_end = call.end(end)
        if call_end < ws or call.t0 > we:
            continue
        out.append(_call_svg(call, call_end, y + 20, ws, we))
    if lane.role == "missing" and lane.note:
        at = next((m.t for m in lane.marks if m.kind == "hang"), end)
        x = _pct(at, ws, we)
        anchor, dx = ("end", -8) if x > 70 else ("start", 8)
        out.append(
            f'<text class="lane-note" x="{x:.4f}%" dx="{dx}" y="{y + 33}" text-anchor="{anchor}">'
            f"{escape(lane.note)}</text>"
        )
    for mark in lane.marks:
        if ws <= mark.t <= we:
            x = _pct(mark.t, ws, we)
            out.append(
                f'<g class="mark sev-{escape(mark.severity)} kind-{escape(mark.kind)}">'
                f'<line x1="{x:.4f}%" x2="{x:.4f}%" y1="{y + 2}" y2="{y + LANE_H - 2}"/>'
                f'<circle cx="{x:.4f}%" cy="{y + 6}" r="4"/><title>rank {lane.rank}: {escape(mark.label)}</title></g>'
            )
    out.append("</g>")
    return "".join(out)


def _rect(
    cls: str, t0: float, t1: float, y: float, h: float, ws: float, we: float, title: str, key: str = ""
) -> str:
    x0, x1 = _pct(t0, ws, we), _pct(t1, ws, we)
    width = max(x1 - x0, 0.04)  # visible even when shorter than a pixel
    data = f' data-k="{escape(key)}"' if key else ""
    return (
        f'<rect class="{cls}"{data} x="{x0:.4f}%" y="{y}" width="{width:.4f}%" height="{h}">'
        f"<title>{escape(title)}</title></rect>"
    )


def _call_svg(call: Call, call_end: float, y: float, ws: float, we: float) -> str:
    key = f"{call.pg}#{call.seq}"
    name = f"rank {call.rank}: {call.op} #{call.seq} (pg {call.pg})" + (
        f" at {call.caller}" if call.caller else ""
    )
    if call.t1 is None:
        title = f"{name}: still inside at the end, {seconds_text(call_end - call.t0)} after entering it"
        return _rect("c stuck", call.t0, call_end, y, 18, ws, we, title, key)
    took = f"took {seconds_text(call.t1 - call.t0)}" + (
        " (completion seen by polling, +-1 s)" if call.polled else ""
    )
    if call.last:
        title = f"{name}: arrived last, the others waited for this rank; {took}"
        return _rect("c xfer last", call.t0, call_end, y, 18, ws, we, title, key)
    if call.wait and call.wait > 0 and call.late_rank is not None:
        split = min(call.t0 + call.wait, call_end)
        wait_title = f"{name}: waited {seconds_text(call.wait)} for rank {call.late_rank} to arrive; {took}"
        return _rect("c wait", call.t0, split, y, 18, ws, we, wait_title, key) + _rect(
            "c xfer", split, call_end, y, 18, ws, we, f"{name}: {took}", key
        )
    return _rect("c xfer", call.t0, call_end, y, 18, ws, we, f"{name}: {took}", key)


def _step_title(step: Any) -> str:
    f = step.fields
    bits = [f"rank {step.rank}: step {step.step}", seconds_text(step.t1 - step.t0)]
    if isinstance(f.get("loss"), (int, float)):
        bits.append(f"loss {f['loss']:.4g}")
    if isinstance(f.get("images_per_s"), (int, float)):
        bits.append(f"{f['images_per_s']:.1f} images/s")
    if f.get("micro_batch") is not None:
        bits.append(f"micro-batch {f.get('micro_batch')} x {f.get('grad_accum')}")
    return ", ".join(bits)


# -- health, plots, OOM ------------------------------------------------------------------------------


def _health_section(health: dict[str, Any]) -> str:
    if "ranks" not in health:
        return ""
    tp = health.get("throughput") or {}
    lines = []
    if tp.get("images_per_s") is not None:
        lines.append(
            f"<p>Throughput <b>{tp['images_per_s']:.2f} images/s</b> ({tp.get('samples')} samples on all ranks in "
            f"{tp.get('steps')} steps over {seconds_text(tp.get('window_seconds'))})"
            + (
                f"; the steps' own median {tp['images_per_s_median']:.2f} images/s"
                if tp.get("images_per_s_median")
                else ""
            )
            + ".</p>"
        )
    rows = []
    for rank, r in (health.get("ranks") or {}).items():
        share, wait = r.get("collective_share"), r.get("wait_share")
        bar = ""
        if share is not None:
            bar = (
                f'<div class="bar" title="in collectives {share * 100:.1f}% of wall time">'
                f'<div class="in" style="width:{min(100.0, share * 100):.1f}%"></div>'
                f'<div class="waitbar" style="width:{min(100.0, (wait or 0) * 100):.1f}%"></div></div>'
            )
        last, matched = r.get("arrived_last"), r.get("matched_collectives")
        rows.append(
            f"<tr><td>{escape(rank)}</td><td>{escape(str(r.get('host') or '-'))}</td><td>{r.get('steps')}</td>"
            f"<td>{seconds_text(r.get('step_time_p50'))}</td><td>{seconds_text(r.get('step_time_p95'))}</td>"
            f"<td>{share_text(share, r.get('collective_seconds'))}{bar}</td>"
            f"<td>{share_text(wait, r.get('waited_seconds'))}</td>"
            f"<td>{'-' if last is None else f'{last} of {matched}'}</td>"
            f"<td>{gib_text(r.get('mem_peak'))}</td></tr>"
        )
    return (
        '<section id="health"><h2>Health</h2>'
        + "".join(lines)
        + '<table class="grid"><thead><tr><th>rank</th><th>host</th><th>steps</th><th>step p50</th><th>step p95</th>'
        "<th>in collectives</th><th>waiting for others</th><th>arrived last</th><th>memory peak</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
        '<p class="note">In collectives: wall time inside traced collectives (a rank that waits for a slower one '
        "waits there). Waiting for others: the part between the rank's own arrival and the last rank's arrival. "
        "Arrived last: how often the others waited for this rank.</p></section>"
    )


def _plots_section(data: RunData) -> str:
    lanes = list(data.timeline.lanes.values())
    charts = [
        _step_chart(lanes, "step-time", "Step time", "seconds", lambda s: s.t1 - s.t0),
        _step_chart(lanes, "loss", "Loss", "loss", lambda s: s.fields.get("loss")),
        _step_chart(
            lanes,
            "throughput",
            "Throughput (all ranks)",
            "images/s",
            lambda s: s.fields.get("images_per_s"),
            only_first=True,
        ),
        _step_chart(
            lanes, "memory", "Memory peak (torch allocator)", "GiB", lambda s: _gib(s.fields.get("mem_peak"))
        ),
        *_gpu_charts(data.gpu_samples, data.timeline.start),
    ]
    charts = [c for c in charts if c]
    if not charts:
        return '<section id="plots"><h2>Plots</h2><p>No step events and no GPU samples in this run directory.</p></section>'
    return '<section id="plots"><h2>Plots</h2><div class="charts">' + "".join(charts) + "</div></section>"


def _gib(value: Any) -> float | None:
    return value / 2**30 if isinstance(value, (int, float)) and value else None


def _step_chart(
    lanes: list[Lane], chart_id: str, title: str, unit: str, value: Any, only_first: bool = False
) -> str:
    series = []
    for i, lane in enumerate(lanes[:1] if only_first else lanes[:16]):
        points = [(float(s.step), float(v)) for s in lane.steps if isinstance(v := value(s), (int, float))]
        if points:
            series.append(Series(f"rank {lane.rank}", points, colour(i)))
    return line_chart(series, title=title, x_label="step", y_label=unit, chart_id=chart_id)


def _gpu_charts(samples: list[dict[str, Any]], origin: float | None) -> list[str]:
    if not samples:
        return []
    t0 = origin if origin is not None else float(samples[0]["t"])
    util: dict[str, list[tuple[float, float]]] = {}
    mem: dict[str, list[tuple[float, float]]] = {}
    for line in samples:
        for g in line.get("gpus") or []:
            name = f"{line.get('host')}:{g.get('index')}"
            x = float(line["t"]) - t0
            if isinstance(g.get("util"), (int, float)):
                util.setdefault(name, []).append((x, float(g["util"])))
            if isinstance(g.get("mem_used"), (int, float)):
                mem.setdefault(name, []).append((x, g["mem_used"] / 2**30))
    charts = [
        (util, "GPU utilisation (NVML)", "%", "gpu-util"),
        (mem, "GPU memory in use (NVML, all processes)", "GiB", "gpu-memory"),
    ]
    return [
        line_chart(
            [Series(f"GPU {k}", v, colour(i)) for i, (k, v) in enumerate(series.items())],
            title=title,
            x_label="seconds since start",
            y_label=unit,
            chart_id=chart_id,
        )
        for series, title, unit, chart_id in charts
    ]


def _oom_section(health: dict[str, Any], timeline: Timeline) -> str:
    oom = health.get("oom") or {}
    marks = [m for lane in timeline.lanes.values() for m in lane.marks if m.kind in ("oom", "fallback")]
    if not oom.get("events") and not oom.get("fallbacks") and not marks:
        return '<section id="oom"><h2>Out of memory</h2><p>No OOM, no fallback.</p></section>'
    rows = "".join(
        f"<tr><td>{m.rank}</td><td>{escape(time.strftime('%H:%M:%S', time.localtime(m.t)))}</td>"
        f"<td>{escape(m.kind)}</td><td>{escape(m.label)}</td></tr>"
        for m in sorted(marks, key=lambda m: (m.t, m.rank))
    )
    return (
        '<section id="oom"><h2>Out of memory</h2>'
        f"<p>{oom.get('events', 0)} OOM event(s); {len(oom.get('fallbacks') or [])} fallback(s) agreed by all ranks.</p>"
        f'<table class="grid"><thead><tr><th>rank</th><th>time</th><th>event</th><th>what</th></tr></thead><tbody>{rows}</tbody></table></section>'
    )


# -- ranks, settings, preflight, launcher -------------------------------------------------------------


def _ranks_section(report: dict[str, Any]) -> str:
    ranks = report.get("ranks") or {}
    if not ranks:
        return ""
    rows, folds = [], []
    for key, r in ranks.items():
        stack = r.get("stack") or {}
        inflight = ", ".join(f"{c.op} #{c.seq}" for c in RankSnapshot.of(r).inflight)
        exit_info = r.get("exit") or {}
        ended = (
            f"signal {exit_info['signal']}"
            if exit_info.get("signal")
            else (f"code {exit_info.get('code')}" if exit_info.get("code") is not None else "")
        )
        rows.append(
            f"<tr><td>{escape(key)}</td><td>{escape(str(r.get('host') or '-'))}</td><td>{escape(str(r.get('pid')))}</td>"
            f"<td>{escape(str(r.get('step')))}</td><td>{escape(str(r.get('phase') or ''))}</td>"
            f"<td>{escape(inflight)}</td><td>{escape(ended)}</td>"
            f"<td><code>{escape(str(stack.get('top_user_frame') or stack.get('error') or ''))}</code></td></tr>"
        )
        if stack.get("frames"):
            folds.append(
                f"<details><summary>rank {escape(key)}: stack at <code>{escape(str(stack.get('top_user_frame')))}</code> "
                f"in {escape(str(stack.get('top_user_function')))}</summary><pre>{escape(chr(10).join(map(str, stack['frames'])))}</pre></details>"
            )
        exc = r.get("exception") or {}
        if exc.get("traceback"):
            folds.append(
                f"<details><summary>rank {escape(key)}: {escape(str(exc.get('type')))}: {escape(str(exc.get('message'))[:200])}</summary>"
                f"<pre>{escape(chr(10).join(map(str, exc['traceback'])))}</pre></details>"
            )
    problem = (report.get("stacks") or {}).get("problem")
    return (
        '<section id="ranks"><h2>Ranks</h2><table class="grid"><thead><tr><th>rank</th><th>host</th><th>pid</th>'
        "<th>step</th><th>phase</th><th>in flight</th><th>exit</th><th>stack top</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
        + (f"<p>Stacks: {escape(problem)}</p>" if problem else "")
        + "".join(folds)
        + "</section>"
    )


def _comm_section(comm: dict[str, Any]) -> str:
    if not comm:
        return ""
    head = f'<section id="comm"><h2>Communication settings</h2><p>Backend: {escape(str(comm.get("backend") or "unknown"))}.</p>'
    if not comm.get("recorded"):
        return head + "<p>Not recorded in this run directory.</p></section>"
    env = comm.get("env") or {}
    items = "".join(f"<li><code>{escape(k)}={escape(v)}</code></li>" for k, v in env.items())
    differ = "".join(
        f"<li><code>{escape(k)}</code> differs: {escape(', '.join(f'rank {r}: {v}' for r, v in per.items()))}</li>"
        for k, per in (comm.get("differ") or {}).items()
    )
    body = f"<ul>{items}{differ}</ul>" if items or differ else "<p>None set: the defaults were in effect.</p>"
    return head + body + "</section>"


def _preflight_section(report: dict[str, Any]) -> str:
    preflight = report.get("preflight")
    if not isinstance(preflight, dict):
        return ""
    rows = "".join(
        f"<tr><td>{escape(str(f.get('severity')))}</td><td>{escape(str(f.get('id')))}</td>"
        f"<td>{escape(str(f.get('title')))}</td><td>{escape(str(f.get('remedy') or ''))}</td></tr>"
        for f in preflight.get("findings") or []
        if isinstance(f, dict)
    )
    return (
        f'<section id="preflight"><h2>Preflight</h2><p>Worst: <b>{escape(str(preflight.get("worst")))}</b>.</p>'
        f'<table class="grid"><thead><tr><th>severity</th><th>id</th><th>finding</th><th>remedy</th></tr></thead>'
        f"<tbody>{rows}</tbody></table></section>"
    )


def _launcher_section(report: dict[str, Any]) -> str:
    tail = (report.get("launcher") or {}).get("stderr_tail") or []
    if not tail:
        return ""
    return (
        '<section id="launcher"><details><summary>Launcher stderr (last lines)</summary>'
        f"<pre>{escape(chr(10).join(map(str, tail[-60:])))}</pre></details></section>"
    )


CSS = """
:root{--err:#c62828;--warn:#e08600;--ok:#2e7d32;--ink:#1d2330;--mute:#5b6472;--line:#d9dde3;
--wait:#f2a541;--xfer:#4e79a7;--last:#c62828;--stuck:#c62828}
*{box-sizing:border-box}body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--ink);
margin:0 auto;max-width:1500px;padding:16px 24px}
h1{font-size:22px;margin:0 0 8px}h2{font-size:18px;margin:24px 0 8px}section{margin-bottom:8px}
code,pre{font:12px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}pre{background:#f5f6f8;padding:8px;overflow:auto}
header.outcome{border-left:8px solid var(--mute);padding:10px 16px;background:#f7f8fa}
header.worst-error{border-color:var(--err)}header.worst-warning{border-color:var(--warn)}
header.worst-none{border-color:var(--ok)}
table.facts th{text-align:left;color:var(--mute);font-weight:normal;padding-right:12px}
.verdict{border:1px solid var(--line);border-left:6px solid var(--mute);padding:8px 14px;margin:10px 0;background:#fff}
.verdict.sev-error{border-left-color:var(--err)}.verdict.sev-warning{border-left-color:var(--warn)}
.verdict h2{margin:4px 0;font-size:16px}.verdict .sev{font-size:12px;text-transform:uppercase;color:var(--mute)}
.verdict .where{font-weight:normal;color:var(--mute);font-size:13px}.verdict .summary{font-size:15px}
.ok-line{color:var(--ok);font-weight:600}
table.grid{border-collapse:collapse;margin:6px 0}table.grid th,table.grid td{border:1px solid var(--line);padding:3px 8px;text-align:left;vertical-align:top}
table.grid th{background:#f2f4f7}.note{color:var(--mute);font-size:12px}
.bar{position:relative;height:6px;background:#eceff3;margin-top:3px;width:140px}
.bar .in{position:absolute;height:6px;background:var(--xfer)}.bar .waitbar{position:absolute;height:6px;background:var(--wait)}
.tl{display:flex;border:1px solid var(--line)}.tl-labels{flex:0 0 190px;border-right:1px solid var(--line);background:#fafbfc}
.lane-label{padding:4px 8px;border-top:1px solid #eef0f3;overflow:hidden;white-space:nowrap}
.lane-label small{color:var(--mute)}.tl-scroll{flex:1;overflow-x:auto}.tl-plot{display:block;width:100%;min-width:100%}
.badge{font-size:11px;padding:0 5px;border-radius:3px;color:#fff;background:var(--mute)}
.badge.missing,.badge.crashed,.badge.culprit{background:var(--err)}.badge.straggler{background:var(--warn)}
.role-missing.lane-label,.role-crashed.lane-label,.role-culprit.lane-label{background:#fdecea}
.role-straggler.lane-label{background:#fff4e0}
.lane-bg{fill:#fff;stroke:#eef0f3}.role-missing .lane-bg,.role-crashed .lane-bg,.role-culprit .lane-bg{fill:#fdf3f2}
.role-straggler .lane-bg{fill:#fffaf0}
.step{fill:#c9d3df}.step.odd{fill:#aebccc}.c.xfer{fill:var(--xfer)}.c.wait{fill:var(--wait)}
.c.last{stroke:var(--last);stroke-width:2}.c.stuck{fill:var(--stuck);opacity:.75}
.c.hl{stroke:#000;stroke-width:2;opacity:1}
.mark line{stroke:#555;stroke-width:1.5}.mark circle{fill:#555}.mark.sev-error line{stroke:var(--err)}
.mark.sev-error circle{fill:var(--err)}.mark.sev-warning line{stroke:var(--warn)}.mark.sev-warning circle{fill:var(--warn)}
.lane-note{font-size:12px;font-weight:600;fill:var(--err)}
.axis line.tick{stroke:#e3e6ea}.axis text.tick,.tick{font-size:11px;fill:var(--mute)}
.sw{display:inline-block;width:14px;height:10px;vertical-align:middle;margin:0 2px}.sw.wait{background:var(--wait)}
.sw.xfer{background:var(--xfer)}.sw.last{background:var(--xfer);outline:2px solid var(--last)}.sw.stuck{background:var(--stuck)}
.sw.mark{background:#555;width:3px}
.zoom{margin:6px 0}.zoom button{margin-right:6px}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:12px}
svg.chart{width:100%;height:auto;border:1px solid var(--line);background:#fff}
svg.chart .grid{stroke:#eceff3}svg.chart .frame{fill:none;stroke:#c5cbd3}svg.chart .series{stroke-width:1.6}
svg.chart .chart-title{font-weight:600;font-size:13px}svg.chart .legend,svg.chart .axis-label{font-size:11px;fill:var(--mute)}
svg.chart .tickmark{stroke:#c5cbd3}details{margin:4px 0}summary{cursor:pointer}footer{margin-top:24px;color:var(--mute);font-size:12px}
"""

JS = """
(function(){
  var plot=document.getElementById('timeline-plot');
  if(plot){
    var zoom=1;
    function setZoom(z){zoom=Math.max(1,Math.min(z,512));plot.style.width=(zoom*100)+'%';}
    document.querySelectorAll('.zoom button').forEach(function(b){
      b.addEventListener('click',function(){var f=parseFloat(b.getAttribute('data-zoom'));setZoom(f?zoom*f:1);});
    });
    var scroller=plot.parentNode;
    scroller.addEventListener('wheel',function(e){
      if(!e.ctrlKey){return;}
      e.preventDefault();
      var rect=scroller.getBoundingClientRect();
      var at=(scroller.scrollLeft+e.clientX-rect.left)/plot.clientWidth;
      setZoom(zoom*(e.deltaY<0?1.25:0.8));
      scroller.scrollLeft=at*plot.clientWidth-(e.clientX-rect.left);
    },{passive:false});
    var lit=[];
    plot.addEventListener('mouseover',function(e){
      var k=e.target.getAttribute&&e.target.getAttribute('data-k');
      lit.forEach(function(n){n.classList.remove('hl');});
      lit=[];
      if(!k){return;}
      plot.querySelectorAll('[data-k="'+k.replace(/"/g,'')+'"]').forEach(function(n){n.classList.add('hl');lit.push(n);});
    });
  }
})();
"""
