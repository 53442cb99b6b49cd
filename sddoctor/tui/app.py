"""The Textual app of `sddoctor tui`.

All I/O runs in thread workers: one samples the local GPUs and host every `interval` seconds
(`Collector`, NVML + psutil), one polls rank telemetry (a run directory or `sddoctor run`
endpoints). They hand finished data to the UI thread with `call_from_thread`; the UI thread
only builds an `Overview` and renders it, so no frame ever waits on NVML or the network.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.css.query import NoMatches
from textual.widgets import Input

from sddoctor.gpu.collector import Collector
from sddoctor.gpu.overview import Overview
from sddoctor.gpu.rankfeeds import RankFeed, RankReport
from sddoctor.gpu.ranks import RankStatus
from sddoctor.gpu.samples import GpuSample, GpuSnapshot
from sddoctor.tui.footer import SteadyFooter
from sddoctor.tui.format import bar, gib, loss, mib, num, pct, rate, sparkline
from sddoctor.tui.rowtable import RowTable
from sddoctor.tui.textlines import TextLines

PROCESS_COLUMNS = ["GPU", "PID", "Rank", "Match", "User", "GPU MiB", "CPU%", "RSS MiB", "Command", "Flags"]
RANK_COLUMNS = [
    "Rank",
    "Node",
    "PID",
    "GPU",
    "Step",
    "Loss",
    "it/s",
    "img/s",
    "State",
    "Detail",
    "Last collective",
    "Call site",
]
PROCESS_SORTS = ("gpu memory", "cpu", "pid", "rank", "gpu")
RANK_SORTS = ("rank", "step", "it/s", "state")
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


class MonitorApp(App[None]):
    TITLE = "sddoctor tui"
    CSS = """
    #host { height: auto; background: $boost; padding: 0 1; }
    #gpus { height: auto; max-height: 45%; padding: 0 1; }
    #procs { height: 1fr; min-height: 4; }
    #ranks { height: 1fr; min-height: 4; }
    #alerts { height: auto; max-height: 8; padding: 0 1; background: $boost; }
    #filter { dock: bottom; display: none; }
    #filter.shown { display: block; }
    RowTable { border-top: solid $primary-darken-2; }
    """
    BINDINGS = [
        Binding("question_mark", "help", "Help"),
        Binding("s", "sort", "Sort"),
        Binding("slash", "filter", "Filter"),
        Binding("p", "pause", "Pause"),
        Binding("escape", "clear_filter", "Clear filter", show=False),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(
        self,
        collector: Collector,
        feed: RankFeed | None = None,
        interval: float = 1.0,
        rank_interval: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        self.collector = collector
        self.feed = feed
        self.interval = interval
        self.rank_interval = rank_interval if rank_interval is not None else max(interval, 1.0)
        self.clock = clock
        self.paused = False
        self.filter_text = ""
        self.proc_sort = 0
        self.rank_sort = 0
        self.snapshot: GpuSnapshot | None = None
        self.report: RankReport | None = None
        self.overview: Overview | None = None
        self.gpu_updates = 0
        self.rank_updates = 0
        self._stop = threading.Event()
        self._shown_ranks: list[RankStatus] = []

    # -- layout ------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield TextLines(id="host")
        with Vertical(id="gpus"):
            yield TextLines(id="gpu-lines")
        yield RowTable(PROCESS_COLUMNS, id="procs")
        yield RowTable(RANK_COLUMNS, id="ranks")
        yield TextLines(id="alerts")
        yield Input(placeholder="filter rows (Enter keeps it, Esc clears)", id="filter")
        yield SteadyFooter()

    def on_mount(self) -> None:
        procs, ranks = self.query_one("#procs", RowTable), self.query_one("#ranks", RowTable)
        procs.border_title = "processes"
        ranks.border_title = "ranks"
        self.run_worker(self._gpu_loop, thread=True, group="gpu", name="gpu-sampler")
        if self.feed is not None:
            self.run_worker(self._rank_loop, thread=True, group="ranks", name="rank-poller")
        else:
            self.report = RankReport()

    def on_unmount(self) -> None:
        self._stop.set()
        self.collector.close()

    # -- workers (threads) -----------------------------------------------------------------------

    def _gpu_loop(self) -> None:
        pcie_started = False
        while not self._stop.is_set():
            if not self.paused:
                snap = self.collector.sample()
                self.call_from_thread(self._on_snapshot, snap)
                if not pcie_started:
                    # Only after the first sample is on screen: PCIe reads block ~20 ms per
                    # direction per GPU inside NVML and would otherwise delay the first frame.
                    self.collector.source.start_background()
                    pcie_started = True
            self._stop.wait(self.interval)

    def _rank_loop(self) -> None:
        assert self.feed is not None
        while not self._stop.is_set():
            if not self.paused:
                try:
                    report = self.feed.poll()
                except Exception as exc:  # noqa: BLE001 - a bad file or payload must not stop the monitor
                    report = RankReport(errors=[f"reading rank telemetry failed: {exc!r}"])
                self.call_from_thread(self._on_report, report)
            self._stop.wait(self.rank_interval)

    def _on_snapshot(self, snap: GpuSnapshot) -> None:
        self.snapshot = snap
        self.gpu_updates += 1
        self._render()

    def _on_report(self, report: RankReport) -> None:
        self.report = report
        self.rank_updates += 1
        self._render()

    @property
    def ready(self) -> bool:
        return self.snapshot is not None and self.report is not None

    # -- rendering ------------------------------------------------------------------------------

    def _render(self) -> None:
        if self.snapshot is None:
            return
        self.overview = Overview.build(self.snapshot, self.report or RankReport())
        try:
            self._render_host()
            self._render_gpus()
            self._render_processes()
            self._render_ranks()
            self._render_alerts()
        except NoMatches:
            # A sample delivered by a worker while the main screen's widgets are not mounted (the
            # app is starting or shutting down): nothing to draw on; the next sample redraws.
            pass

    def _render_host(self) -> None:
        ov = self.overview
        assert ov is not None
        h = ov.snapshot.host
        t = Text()
        t.append(h.hostname, style="bold")
        cpu_frac = None if h.cpu_percent is None else h.cpu_percent / 100
        t.append(f"  CPU {bar(cpu_frac, 10)} {pct(h.cpu_percent):>4}")
        mem_frac = h.memory_used / h.memory_total if h.memory_used is not None and h.memory_total else None
        t.append(f"  MEM {bar(mem_frac, 10)} {gib(h.memory_used)}/{gib(h.memory_total)} GiB")
        if h.load_average:
            t.append("  load " + " ".join(f"{x:.2f}" for x in h.load_average))
        if ov.snapshot.driver_version:
            t.append(f"  driver {ov.snapshot.driver_version}")
        sources = ", ".join(ov.report.sources) if ov.report.sources else "no run"
        t.append(f"  run: {sources}", style="cyan")
        if self.filter_text:
            t.append(f"  filter: {self.filter_text!r}", style="magenta")
        if self.paused:
            t.append("  PAUSED", style="bold reverse")
        self.query_one("#host", TextLines).set_lines([t])

    def _render_gpus(self) -> None:
        ov = self.overview
        assert ov is not None
        widget = self.query_one("#gpu-lines", TextLines)
        if not ov.snapshot.nvml_available:
            note = f"No GPU data: {ov.snapshot.nvml_note}. Host and rank data below still update."
            widget.set_lines([Text(note, style="yellow")])
            return
        text = Text()
        for i, g in enumerate(ov.snapshot.gpus):
            if i:
                text.append("\n")
            self._gpu_lines(text, g)
        widget.set_lines(list(text.split("\n")))

    def _gpu_lines(self, text: Text, g: GpuSample) -> None:
        hist = self.collector.history
        util_style = (
            "green"
            if (g.utilization_gpu or 0) >= 60
            else "yellow"
            if (g.utilization_gpu or 0) >= 20
            else "red"
        )
        text.append(f"GPU {g.index} ", style="bold")
        text.append(f"{g.name[:22]:<22} ")
        text.append(f"util {pct(g.utilization_gpu):>4} ")
        # history widths follow the terminal so the first line of a GPU fits on narrow ones
        width = self.query_one("#gpu-lines", TextLines).size.width or 160
        util_width = max(6, min(24, width - 62))
        mem_width = 16 if width >= 62 + util_width + 17 else 0
        text.append(sparkline(hist.get(g.index, "util"), util_width), style=util_style)
        text.append(f"  mem {gib(g.memory_used):>5}/{gib(g.memory_total)} GiB ")
        if mem_width:
            text.append(sparkline(hist.get(g.index, "mem"), mem_width), style="magenta")
        text.append("\n      ")
        text.append(f"{num(g.temperature)}°C  {num(g.power_draw)}/{num(g.power_limit)} W  ")
        text.append(f"SM {num(g.clock_sm)} MEM {num(g.clock_mem)} MHz  P{num(g.pstate)}  ")
        text.append(f"PCIe rx {rate(g.pcie_rx)} tx {rate(g.pcie_tx)}  ")
        ecc = "n/a" if g.ecc_corrected is None else f"{g.ecc_corrected}/{g.ecc_uncorrected}"
        text.append(f"ECC {ecc}  ", style="bold red" if g.ecc_uncorrected else "")
        reasons = ", ".join(g.clock_event_reasons) or "none"
        text.append(
            f"clocks: {reasons}", style="yellow" if g.clock_event_reasons and reasons != "idle" else "dim"
        )

    def _matches_filter(self, cells: list[str]) -> bool:
        if not self.filter_text:
            return True
        needle = self.filter_text.lower()
        return any(needle in c.lower() for c in cells)

    def _render_processes(self) -> None:
        ov = self.overview
        assert ov is not None
        table = self.query_one("#procs", RowTable)
        rows = []
        for g in ov.snapshot.gpus:
            for p in g.processes:
                m = ov.matching.of(g.index, p.pid)
                flags = "; ".join(ov.matching.flags(g.index, p.pid))
                rank = m.rank.rank if m else None
                cells = [
                    str(g.index),
                    str(p.pid),
                    "-" if m is None else f"{m.rank.rank}/{num(m.rank.world_size)} l{num(m.rank.local_rank)}",
                    "-" if m is None else m.how,
                    p.user or "?",
                    mib(p.gpu_memory),
                    "-" if p.cpu_percent is None else f"{p.cpu_percent:.0f}",
                    mib(p.rss),
                    (p.command or "?")[:80],
                    ("!! " + flags) if flags else "",
                ]
                key = (
                    p.gpu_memory or 0,
                    p.cpu_percent or 0,
                    p.pid,
                    rank if rank is not None else 1 << 30,
                    g.index,
                )
                rows.append((key, f"{g.index}:{p.pid}", cells))
        which = self.proc_sort
        rows.sort(key=lambda r: r[0][which], reverse=which in (0, 1))
        self._fill(table, [(k, c) for _, k, c in rows if self._matches_filter(c)])
        _set_title(table, f"processes (sort: {PROCESS_SORTS[which]})")

    def _render_ranks(self) -> None:
        ov = self.overview
        assert ov is not None
        table = self.query_one("#ranks", RowTable)
        ranks = list(ov.report.ranks)
        which = RANK_SORTS[self.rank_sort]
        if which == "step":
            ranks.sort(key=lambda r: r.step if r.step is not None else -1)
        elif which == "it/s":
            ranks.sort(key=lambda r: r.it_s if r.it_s is not None else -1)
        elif which == "state":
            order = list(STATE_STYLE)
            ranks.sort(key=lambda r: -order.index(r.state) if r.state in order else 0)
        rows = []
        shown = []
        for r in ranks:
            cells = [
                str(r.rank),
                r.node[:16],
                num(r.pid),
                num(r.device),
                num(r.step),
                loss(r.loss),
                num(r.it_s, "{:.2f}"),
                num(r.images_s, "{:.1f}"),
                r.state,
                _clip(r.state_text, 48),
                r.last_collective or "-",
                r.call_site or "-",
            ]
            if self._matches_filter(cells):
                styled: list[Any] = list(cells)
                styled[8] = Text(r.state, style=STATE_STYLE.get(r.state, ""))
                rows.append((f"{r.node}:{r.rank}", styled))
                shown.append(r)
        self._shown_ranks = shown
        self._fill(table, rows)
        title = f"ranks (sort: {which})"
        if not ov.report.sources:
            title += ": no run found (use --run-dir or --connect)"
        _set_title(table, title)

    def _fill(self, table: RowTable, rows: list[tuple[str, list[Any]]]) -> None:
        table.set_rows([(k, [c if isinstance(c, Text) else Text(c) for c in cells]) for k, cells in rows])

    def _render_alerts(self) -> None:
        ov = self.overview
        assert ov is not None
        text = Text()
        for i, a in enumerate(ov.alerts[:8]):
            if i:
                text.append("\n")
            text.append(f"{a.severity.upper():<7} ", style=SEVERITY_STYLE.get(a.severity, ""))
            text.append(a.summary)
            if a.location and a.location not in a.summary:
                text.append(f"  at {a.location}", style="dim")
        if not ov.alerts:
            text.append("no alerts", style="dim")
        self.query_one("#alerts", TextLines).set_lines(list(text.split("\n")))

    # -- actions ---------------------------------------------------------------------------------

    def action_help(self) -> None:
        # The modal screens are imported when first opened: the first frame does not need them.
        from sddoctor.tui.screens import HelpScreen

        if isinstance(self.screen, HelpScreen):
            self.pop_screen()
        else:
            self.push_screen(HelpScreen())

    def action_sort(self) -> None:
        if self.focused is self.query_one("#ranks", RowTable):
            self.rank_sort = (self.rank_sort + 1) % len(RANK_SORTS)
        else:
            self.proc_sort = (self.proc_sort + 1) % len(PROCESS_SORTS)
        self._render()

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.add_class("shown")
        box.focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.value = ""
        box.remove_class("shown")
        self.filter_text = ""
        self.query_one("#procs", RowTable).focus()
        self._render()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value.strip()
        self._render()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.input.remove_class("shown")
        self.query_one("#ranks", RowTable).focus()

    def action_pause(self) -> None:
        self.paused = not self.paused
        self._render()

    def on_row_table_row_selected(self, event: RowTable.RowSelected) -> None:
        if event.table.id != "ranks" or self.overview is None:
            return
        index = event.cursor_row
        if 0 <= index < len(self._shown_ranks):
            rank = self._shown_ranks[index]
            run_dir = self.overview.report.run_dirs.get(rank.node)
            from sddoctor.tui.screens import RankScreen  # imported when first opened, as HelpScreen

            self.push_screen(RankScreen(rank, run_dir))


def _set_title(widget: RowTable, title: str) -> None:
    if widget.border_title != title:  # assigning, even the same text, repaints the widget
        widget.border_title = title


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"
