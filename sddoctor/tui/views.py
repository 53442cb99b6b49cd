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
from sddoctor.gpu.overview import Overview
from sddoctor.gpu.ranks import RankStatus, images_total
from sddoctor.gpu.samples import GpuSample
from sddoctor.tui.format import age, bar, gib, gib_short, loss_short, mib, num, pct, rate, sparkline
from sddoctor.tui.paths import elide_path, short_site, shorten_paths_in
from sddoctor.tui.rowtable import Column

STATE_STYLE = {
    "training": "green",
    "collective": "yellow",
    "oom-fallback": "yellow",
    "starting": "cyan",
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


def fit_pieces(pieces: list[tuple[int, Text]], width: int, sep: str = "  ") -> Text:
    """The pieces that fit in `width` cells joined by `sep`, in their order: priority 0 always,
    then the others by priority while they fit."""
    keep = [p == 0 for p, _ in pieces]
    used = sum(t.cell_len for (p, t) in pieces if p == 0) + len(sep) * (sum(keep) - 1)
    for i in sorted(range(len(pieces)), key=lambda i: pieces[i][0]):
        prio, text = pieces[i]
        if prio and used + len(sep) + text.cell_len <= width:
            keep[i] = True
            used += len(sep) + text.cell_len
    out = Text()
    for i, (_, text) in enumerate(pieces):
        if keep[i]:
            if out.cell_len:
                out.append(sep)
            out.append_text(text)
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
    pieces: list[tuple[int, Text]] = [
        (0, Text(h.hostname, style="bold")),
        (0, Text(cpu)),
        (0, Text(f"{mem}{gib(h.memory_used)}/{gib(h.memory_total)} GiB")),
        (3, Text("load " + " ".join(f"{x:.2f}" for x in h.load_average)) if h.load_average else Text()),
        (1, Text(f"{len(snap.gpus)} GPU{'s' if len(snap.gpus) != 1 else ''}") if snap.gpus else Text()),
        (4, Text(f"driver {snap.driver_version}") if snap.driver_version else Text()),
        (0, Text(f"run: {sources}", style="cyan")),
    ]
    if filter_text:
        pieces.append((0, Text(f"filter: {filter_text!r}", style="magenta")))
    if paused:
        pieces.append((0, Text("PAUSED", style="bold reverse")))
    return fit_pieces([(p, t) for p, t in pieces if t.cell_len], width)


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


def _reasons(g: GpuSample) -> Text:
    reasons = ",".join(g.clock_event_reasons)
    if not reasons or reasons == "idle":
        return Text(reasons, style="dim")
    return Text(reasons, style="yellow")


def _one_line(g: GpuSample, history: History, width: int, index_width: int) -> Text:
    style = _util_style(g)
    head = Text()
    head.append(f"{g.index:>{index_width}} ", style="bold")
    head.append(f"{_short_name(g.name)[:10]:<10} ")
    head.append(f"{pct(g.utilization_gpu):>4} ", style=style)
    mem = f"{gib_short(g.memory_used)}/{gib_short(g.memory_total)}G"
    tail = Text(
        f" {mem:>10} {num(g.temperature):>3}°C {num(g.power_draw):>4}/{num(g.power_limit)}W P{num(g.pstate)}"
    )
    spark = max(4, min(30, width - head.cell_len - tail.cell_len - 14))
    head.append(sparkline(history.get(g.index, "util"), spark), style=style)
    head.append_text(tail)
    extras: list[tuple[int, Text]] = []
    if g.ecc_uncorrected:
        extras.append((0, Text(f"ECC! {g.ecc_uncorrected}", style="bold red")))
    extras.append((0, _reasons(g)))
    extras.append((3, Text(f"SM {num(g.clock_sm)} MEM {num(g.clock_mem)} MHz")))
    extras.append((4, Text(f"PCIe rx {rate(g.pcie_rx)} tx {rate(g.pcie_tx)}")))
    if not g.ecc_uncorrected:
        extras.append((5, Text("ECC " + ("n/a" if g.ecc_corrected is None else f"{g.ecc_corrected}/0"))))
    rest = fit_pieces([(p, t) for p, t in extras if t.cell_len], width - head.cell_len - 1)
    if rest.cell_len:
        head.append(" ")
        head.append_text(rest)
    return head


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
    second.append_text(_reasons(g) if g.clock_event_reasons else Text("none", style="dim"))
    return [first, second]


def process_rows(ov: Overview) -> list[tuple[tuple[float, ...], str, list[Text]]]:
    """(sort keys in PROCESS_SORTS order, row key, cells) of every GPU process."""
    rows = []
    for g in ov.snapshot.gpus:
        for p in g.processes:
            m = ov.matching.of(g.index, p.pid)
            flags = "; ".join(ov.matching.flags(g.index, p.pid))
            rank = m.rank.rank if m else None
            who = "-" if m is None else f"{m.rank.rank}/{num(m.rank.world_size)} l{num(m.rank.local_rank)}"
            cells = [
                Text(str(g.index)),
                Text(str(p.pid)),
                Text(who + (" !!" if flags else ""), style="bold red" if flags else ""),
                Text("-" if m is None else m.how),
                Text(p.user or "?"),
                Text(mib(p.gpu_memory)),
                Text("-" if p.cpu_percent is None else f"{p.cpu_percent:.0f}"),
                Text(mib(p.rss)),
                Text(p.command or "?"),
                Text(("!! " + flags) if flags else "", style="bold red"),
            ]
            key = (
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


def rank_cells(r: RankStatus, multi_source: bool, job_dir: str | None) -> list[Text]:
    return [
        Text(str(r.rank)),
        Text(r.node if multi_source else ""),
        Text(num(r.pid)),
        Text(num(r.device)),
        Text(r.state, style=STATE_STYLE.get(r.state, "")),
        Text(num(r.step)),
        Text(loss_short(r.loss)),
        Text(num(r.it_s, "{:.2f}")),
        Text(num(r.images_s, "{:.1f}")),
        collective_cell(r),
        Text(short_site(r.call_site, job_dir) or "-"),
        Text(shorten_paths_in(r.state_text, job_dir)),
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
