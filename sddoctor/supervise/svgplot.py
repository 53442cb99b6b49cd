"""Small inline-SVG charts for report.html: line charts with axes and a legend, nothing to fetch.

Every function returns SVG markup as a string; text is escaped here. Long series are reduced to
the minimum and maximum of each of `MAX_POINTS / 2` buckets, so a spike survives the reduction.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

#: colours of ranks and GPUs, in order (Tableau 10: distinguishable, also when printed)
PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#e15759",
    "#76b7b2",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
)
MAX_POINTS = 800


def colour(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


@dataclass
class Series:
    name: str
    points: list[tuple[float, float]]
    colour: str


def nice_ticks(lo: float, hi: float, count: int = 6) -> list[float]:
    """Round tick values covering [lo, hi] (1, 2, 5 x 10^k steps)."""
    if not math.isfinite(lo) or not math.isfinite(hi):
        return []
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(1, count)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step) * step
    ticks = []
    value = first
    while value <= hi + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    return ticks


def tick_text(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000 or abs(value) < 0.01:
        return f"{value:.3g}"
    return f"{value:.6g}"


def reduce_points(
    points: Sequence[tuple[float, float]], limit: int = MAX_POINTS
) -> list[tuple[float, float]]:
    """At most about `limit` points: per bucket of x order, its minimum and maximum (spikes stay)."""
    if len(points) <= limit:
        return list(points)
    buckets = max(1, limit // 2)
    size = len(points) / buckets
    out: list[tuple[float, float]] = []
    for b in range(buckets):
        chunk = points[int(b * size) : int((b + 1) * size)]
        if not chunk:
            continue
        lo = min(chunk, key=lambda p: p[1])
        hi = max(chunk, key=lambda p: p[1])
        out.extend(sorted({lo, hi}))
    return out


def line_chart(
    series: list[Series],
    *,
    title: str,
    x_label: str,
    y_label: str,
    chart_id: str,
    y_format: Callable[[float], str] = tick_text,
    x_format: Callable[[float], str] = tick_text,
    width: int = 640,
    height: int = 240,
    y_zero: bool = True,
) -> str:
    """A line chart (points joined, dots when there are few) with ticks, axis labels and a legend."""
    series = [Series(s.name, reduce_points(s.points), s.colour) for s in series if s.points]
    if not series:
        return ""
    left, right, top, bottom = 64, 12, 26, 40
    xs = [x for s in series for x, _ in s.points]
    ys = [y for s in series for _, y in s.points]
    x_lo, x_hi = min(xs), max(xs)
    y_lo, y_hi = (min(0.0, min(ys)) if y_zero else min(ys)), max(ys)
    x_ticks, y_ticks = nice_ticks(x_lo, x_hi), nice_ticks(y_lo, y_hi, 4)
    if x_ticks:
        x_lo, x_hi = min(x_lo, x_ticks[0]), max(x_hi, x_ticks[-1])
    if y_ticks:
        y_lo, y_hi = min(y_lo, y_ticks[0]), max(y_hi, y_ticks[-1])
    x_span = (x_hi - x_lo) or 1.0
    y_span = (y_hi - y_lo) or 1.0
    plot_w, plot_h = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + (x - x_lo) / x_span * plot_w

    def py(y: float) -> float:
        return top + plot_h - (y - y_lo) / y_span * plot_h

    parts = [
        f'<svg class="chart" id="{escape(chart_id)}" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
        f'<text class="chart-title" x="{left}" y="16">{escape(title)}</text>',
    ]
    for t in y_ticks:
        y = py(t)
        parts.append(f'<line class="grid" x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}"/>')
        parts.append(
            f'<text class="tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{escape(y_format(t))}</text>'
        )
    for t in x_ticks:
        x = px(t)
        parts.append(
            f'<line class="tickmark" x1="{x:.1f}" x2="{x:.1f}" y1="{top + plot_h}" y2="{top + plot_h + 4}"/>'
        )
        parts.append(
            f'<text class="tick" x="{x:.1f}" y="{top + plot_h + 16}" text-anchor="middle">{escape(x_format(t))}</text>'
        )
    parts.append(f'<rect class="frame" x="{left}" y="{top}" width="{plot_w}" height="{plot_h}"/>')
    parts.append(
        f'<text class="axis-label" x="{left + plot_w / 2:.0f}" y="{height - 4}" text-anchor="middle">{escape(x_label)}</text>'
    )
    parts.append(
        f'<text class="axis-label" x="12" y="{top + plot_h / 2:.0f}" text-anchor="middle" '
        f'transform="rotate(-90 12 {top + plot_h / 2:.0f})">{escape(y_label)}</text>'
    )
    for s in series:
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in s.points)
        parts.append(
            f'<polyline class="series" fill="none" stroke="{s.colour}" points="{coords}"><title>{escape(s.name)}</title></polyline>'
        )
        if len(s.points) <= 40:
            for x, y in s.points:
                parts.append(
                    f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{s.colour}">'
                    f"<title>{escape(s.name)}: {escape(x_format(x))}, {escape(y_format(y))}</title></circle>"
                )
    parts.append(_legend(series, left, width - right))
    parts.append("</svg>")
    return "".join(parts)


def _legend(series: list[Series], left: int, right: int) -> str:
    if len(series) < 2:
        return ""
    out = []
    x = right
    for s in reversed(series[:16]):
        x -= 12 + 7 * len(s.name)
        out.append(
            f'<rect x="{x}" y="7" width="10" height="10" fill="{s.colour}"/>'
            f'<text class="legend" x="{x + 13}" y="16">{escape(s.name)}</text>'
        )
        if x < left + 160:
            break
    return "".join(out)
