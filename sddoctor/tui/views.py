"""What the main screen shows, as Rich Text built from an `Overview` (pure functions, no widgets).

Each line is built for the width it is drawn in: pieces and columns that do not fit are left
out, least important first, so a fresh 80x24 terminal shows what matters (every GPU on one line,
the ranks' state, step, img/s, collective and call site) and a wide one shows everything.
Call sites and paths are shown relative to the job's folder (`sddoctor.tui.paths`).

img/s has one meaning everywhere on screen: the images one rank processes per second (the
samples it reports). The whole job's rate is their sum, and is labelled "all ranks".
"""

from __future__ import annotations

import textwrap

from rich.text import Text

from sddoctor.gpu.collector import History
from sddoctor.gpu.samples import GpuSample
from sddoctor.ranks.overview import Overview
from sddoctor.ranks.status import RankStatus, images_total
from sddoctor.tui.format import age, bar, gib, gib_short, loss_short, mib, num, pct, rate, sparkline
from sddoctor.tui.paths import elide_path, short_site, shorten_paths_in
from sddoctor.tui.rowtable import Cell, Column

STATE_STYLE = {
    "training": "green",
    "collective": "yellow",
    "oom-fallback": "yellow",
    "running": "green",
    "starting": "cyan",
    "stuck": "bold red",
    "silent": "bold yellow",
    "hung": "bold red",
    "crashed": "bold red",
    "exited": "dim",
}
SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}

PROCESS_COLUMNS = [
    Column("GPU", align="right", max_width=3),
    Column("PID", align="right", max_width=8),
    Column("Rank", max_width=12),
    Column("Match", priority=5),
    Column("User", priority=2, max_width=12),
    Column("GPU MiB", align="right"),
    Column("CPU%", priority=1, align="right"),
    Column("RSS MiB", priority=3, align="right"),
    Column("Command", flex=True, min_width=24, max_width=400),
    Column("Flags", priority=4, max_width=48),
]
PROCESS_SORTS = ("gpu memory", "cpu", "pid", "rank", "gpu")

RANK_COLUMNS = [
    Column("Rank", align="right", max_width=8),
    Column("Node", priority=1, max_width=21),
    Column("PID", priority=5, align="right", max_width=8),
    Column("GPU", priority=3, align="right", max_width=3),
    Column("State", max_width=14),
    Column("Step", align="right", max_width=9),
    Column("Loss", priority=2, align="right", max_width=8),
    Column("it/s", priority=4, align="right", max_width=7),
    Column("img/s", align="right", max_width=8),
    Column("Collective", max_width=28),
    Column("Call site", flex=True, min_width=24, max_width=200, clip=elide_path),
    Column("Detail", priority=6, flex=True, min_width=16, max_width=90),
]
RANK_SORTS = ("rank", "step", "it/s", "state")

#: Width from which each GPU gets two lines (all its figures) when the panel has the height.
TWO_LINE_WIDTH = 120


#: A piece of a line: (priority, text, style); priority 0 is always shown.
Piece = tuple[int, str, str]


def fit_pieces(pieces: list[Piece], width: int, sep: str = "  ") -> Text:
    """The pieces that fit in `width` cells joined by `sep`, in their order: priority 0 always,
    then the others by priority while they fit. Empty pieces are left out. One Text with a
    style span per piece (a Text per piece costs more than building the line)."""
    pieces = [p for p in pieces if p[1]]
    keep = [p[0] == 0 for p in pieces]
    used = sum(len(t) for (p, t, _) in pieces if p == 0) + len(sep) * (sum(keep) - 1)
    for i in sorted(range(len(pieces)), key=lambda i: pieces[i][0]):
        prio, text, _ = pieces[i]
        if prio and used + len(sep) + len(text) <= width:
            keep[i] = True
            used += len(sep) + len(text)
    out = Text()
    for i, (_, text, style) in enumerate(pieces):
        if keep[i]:
            if out:
                out.append(sep)
            out.append(text, style or None)
    return out


def host_line(ov: Overview, width: int, *, paused: bool, filter_text: str) -> Text:
    snap = ov.snapshot
    h = snap.host
    cpu_frac = None if h.cpu_percent is None else h.cpu_percent / 100
    mem_frac = h.memory_used / h.memory_total if h.memory_used is not None and h.memory_total else None
    sources = ", ".join(ov.report.sources) if ov.report.sources else "no run"
    bars = width >= 110  # CPU and memory bars (as htop's) where the line has room for them
    cpu = f"CPU {bar(cpu_frac, 10)} {pct(h.cpu_percent):>4}" if bars else f"CPU {pct(h.cpu_percent)}"
    mem = f"MEM {bar(mem_frac, 10)} " if bars else "MEM "
    gpus = f"{len(snap.gpus)} GPU{'s' if len(snap.gpus) != 1 else ''}" if snap.gpus else ""
    pieces: list[Piece] = [
        (0, h.hostname, "bold"),
        (0, cpu, ""),
        (0, f"{mem}{gib(h.memory_used)}/{gib(h.memory_total)} GiB", ""),
        (3, "load " + " ".join(f"{x:.2f}" for x in h.load_average) if h.load_average else "", ""),
        (1, gpus, ""),
        (4, f"driver {snap.driver_version}" if snap.driver_version else "", ""),
        (0, f"run: {sources}", "cyan"),
    ]
    if filter_text:
        pieces.append((0, f"filter: {filter_text!r}", "magenta"))
    if paused:
        pieces.append((0, "PAUSED", "bold reverse"))
    return fit_pieces(pieces, width)


def gpu_lines(ov: Overview, history: History, width: int, max_lines: int) -> list[Text]:
    """Two lines per GPU where the width and `max_lines` allow it, else one (gpustat-like)."""
    snap = ov.snapshot
    if not snap.nvml_available:
        note = f"No GPU data: {snap.nvml_note}. Host and rank data below still update."
        return [Text(line, style="yellow") for line in textwrap.wrap(note, max(20, width))]
    two = width >= TWO_LINE_WIDTH and 2 * len(snap.gpus) <= max_lines
    index_width = len(str(max((g.index for g in snap.gpus), default=0)))
    lines = []
    for g in snap.gpus:
        lines += _two_lines(g, history, width) if two else [_one_line(g, history, width, index_width)]
    return lines


def _util_style(g: GpuSample) -> str:
    util = g.utilization_gpu or 0
    return "green" if util >= 60 else "yellow" if util >= 20 else "red"


def _short_name(name: str) -> str:
    for prefix in ("NVIDIA ", "GeForce "):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def _reasons(g: GpuSample) -> tuple[str, str]:
    """Why the clocks are held back, and its style (quiet when they are not, or only for idling)."""
    reasons = ",".join(g.clock_event_reasons)
    return reasons, "dim" if not reasons or reasons == "idle" else "yellow"


def _one_line(g: GpuSample, history: History, width: int, index_width: int) -> Text:
    # Built as one string with style spans: a Text per piece costs more than the rest of the line.
    style = _util_style(g)
    head = f"{g.index:>{index_width}} {_short_name(g.name)[:10]:<10} "
    util = f"{pct(g.utilization_gpu):>4} "
    mem = f"{gib_short(g.memory_used)}/{gib_short(g.memory_total)}G"
    tail = (
        f" {mem:>10} {num(g.temperature):>3}°C {num(g.power_draw):>4}/{num(g.power_limit)}W P{num(g.pstate)}"
    )
    spark = sparkline(history.get(g.index, "util"), max(4, min(30, width - len(head) - 5 - len(tail) - 14)))
    line = Text(head + util + spark + tail)
    line.stylize("bold", 0, index_width)
    line.stylize(style, len(head), len(head) + len(util) + len(spark))
    extras: list[Piece] = [
        (0, f"ECC! {g.ecc_uncorrected}" if g.ecc_uncorrected else "", "bold red"),
        (0, *_reasons(g)),
        (3, f"SM {num(g.clock_sm)} MEM {num(g.clock_mem)} MHz", ""),
        (4, f"PCIe rx {rate(g.pcie_rx)} tx {rate(g.pcie_tx)}", ""),
        (
            5,
            ""
            if g.ecc_uncorrected
            else "ECC " + ("n/a" if g.ecc_corrected is None else f"{g.ecc_corrected}/0"),
            "",
        ),
    ]
    rest = fit_pieces(extras, width - len(line) - 1)
    if rest:
        line.append(" ")
        line.append_text(rest)
    return line


def _two_lines(g: GpuSample, history: History, width: int) -> list[Text]:
    style = _util_style(g)
    first = Text()
    first.append(f"GPU {g.index} ", style="bold")
    first.append(f"{g.name[:22]:<22} ")
    first.append(f"util {pct(g.utilization_gpu):>4} ")
    util_width = max(6, min(24, width - 62))
    first.append(sparkline(history.get(g.index, "util"), util_width), style=style)
    first.append(f"  mem {gib(g.memory_used):>5}/{gib(g.memory_total)} GiB ")
    if width >= 62 + util_width + 17:
        first.append(sparkline(history.get(g.index, "mem"), 16), style="magenta")
    second = Text("      ")
    second.append(f"{num(g.temperature)}°C  {num(g.power_draw)}/{num(g.power_limit)} W  ")
    second.append(f"SM {num(g.clock_sm)} MEM {num(g.clock_mem)} MHz  P{num(g.pstate)}  ")
    second.append(f"PCIe rx {rate(g.pcie_rx)} tx {rate(g.pcie_tx)}  ")
    ecc = "n/a" if g.ecc_corrected is None else f"{g.ecc_corrected}/{g.ecc_uncorrected}"
    second.append(f"ECC {ecc}  ", style="bold red" if g.ecc_uncorrected else "")
    second.append("clocks: ")
    second.append(*(_reasons(g) if g.clock_event_reasons else ("none", "dim")))
    return [first, second]


def process_rows(ov: Overview) -> list[tuple[tuple[float, ...], str, list[Cell]]]:
    """(sort keys in PROCESS_SORTS order, row key, cells) of every GPU process."""
    rows: list[tuple[tuple[float, ...], str, list[Cell]]] = []
    for g in ov.snapshot.gpus:
        for p in g.processes:
            m = ov.matching.of(g.index, p.pid)
            flags = "; ".join(ov.matching.flags(g.index, p.pid))
            rank = m.rank.rank if m else None
            who = "-" if m is None else f"{m.rank.rank}/{num(m.rank.world_size)} l{num(m.rank.local_rank)}"
            cells: list[Cell] = [
                str(g.index),
                str(p.pid),
                Text(who + " !!", style="bold red") if flags else who,
                "-" if m is None else m.how,
                p.user or "?",
                mib(p.gpu_memory),
                "-" if p.cpu_percent is None else f"{p.cpu_percent:.0f}",
                mib(p.rss),
                p.command or "?",
                Text("!! " + flags, style="bold red") if flags else "",
            ]
            key: tuple[float, ...] = (
                p.gpu_memory or 0,
                p.cpu_percent or 0,
                p.pid,
                rank if rank is not None else 1 << 30,
                g.index,
            )
            rows.append((key, f"{g.index}:{p.pid}", cells))
    return rows


def collective_cell(r: RankStatus) -> Text:
    """The collective the rank waits in (and for how long), else the last one it completed."""
    if r.inflight:
        style = "bold red" if r.state == "hung" else "yellow"
        return Text(f"in {r.inflight} {age(r.inflight_for)}", style=style)
    return Text(r.last_collective or "-")


def rank_cells(r: RankStatus, multi_source: bool, job_dir: str | None) -> list[Cell]:
    return [
        str(r.rank),
        r.node if multi_source else "",
        num(r.pid),
        num(r.device),
        Text(r.state, style=STATE_STYLE.get(r.state, "")),
        num(r.step),
        loss_short(r.loss),
        num(r.it_s, "{:.2f}"),
        num(r.images_s, "{:.1f}"),
        collective_cell(r) if r.inflight else r.last_collective or "-",
        short_site(r.call_site, job_dir) or "-",
        shorten_paths_in(r.state_text, job_dir),
    ]


def sort_ranks(ranks: list[RankStatus], which: str) -> list[RankStatus]:
    ranks = list(ranks)
    if which == "step":
        ranks.sort(key=lambda r: r.step if r.step is not None else -1)
    elif which == "it/s":
        ranks.sort(key=lambda r: r.it_s if r.it_s is not None else -1)
    elif which == "state":
        order = list(STATE_STYLE)
        ranks.sort(key=lambda r: -order.index(r.state) if r.state in order else 0)
    return ranks


def ranks_title(ov: Overview, sort: str) -> str:
    title = f"ranks (sort: {sort})"
    if not ov.report.sources:
        return title + ": no run found (use --run-dir or --connect)"
    total = images_total(ov.report.ranks)
    title += " · img/s per rank"
    if total is not None:
        title += f" · all ranks {total:.1f} img/s"
    return title


def alert_lines(ov: Overview) -> list[Text]:
    if not ov.alerts:
        return [Text("no alerts", style="dim")]
    job_dirs = ov.report.job_dirs
    lines = []
    for a in ov.alerts:
        job_dir = job_dirs.get(a.source or "")
        text = Text()
        text.append(f"{a.severity.upper():<7} ", style=SEVERITY_STYLE.get(a.severity, ""))
        summary = shorten_paths_in(a.summary, job_dir)
        text.append(summary)
        location = short_site(a.location, job_dir)
        if location and location not in summary:
            text.append(f"  at {location}", style="dim")
        lines.append(text)
    return lines
