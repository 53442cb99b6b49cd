"""The Textual app of `sddoctor tui`.

All I/O runs in thread workers: one samples the local GPUs and host every `interval` seconds
(`Collector`, NVML + psutil), one polls rank telemetry (a run directory or `sddoctor run`
endpoints). They hand finished data to the UI thread with `call_from_thread`; the UI thread
only builds an `Overview` and renders it (`sddoctor.tui.views`), so no frame ever waits on
NVML or the network.

The layout fits the terminal: a host line, the GPU panel (one line per GPU on narrow or short
terminals, two where there is room; it scrolls past a third of the height), the processes and
ranks tables (columns left out by priority when narrow; they scroll), the alerts, the footer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.events import Resize
from textual.widgets import Input

from sddoctor.gpu.collector import Collector
from sddoctor.gpu.samples import GpuSnapshot
from sddoctor.ranks.feeds import RankFeed, RankReport, RunDirFeed
from sddoctor.ranks.overview import Overview
from sddoctor.ranks.status import RankStatus
from sddoctor.tui import views
from sddoctor.tui.footer import SteadyFooter
from sddoctor.tui.rowtable import Cell, RowTable
from sddoctor.tui.textlines import ScrollLines, TextLines

if TYPE_CHECKING:
    from sddoctor.telemetry.registry import LiveRun
    from sddoctor.tui.screens import RankScreen

#: Seconds the GPU sampler waits for the rank poll started with it, to draw both in one frame.
JOINT_WAIT = 0.25


class MonitorApp(App[None]):
    TITLE = "sddoctor tui"
    CSS = """
    #host { background: $boost; padding: 0 1; }
    #gpus { padding: 0 0 0 1; scrollbar-gutter: stable; scrollbar-size-horizontal: 0; }
    #procs { height: 1fr; min-height: 4; }
    #ranks { height: 1fr; min-height: 4; }
    #alerts { max-height: 15%; padding: 0 0 0 1; background: $boost; }
    #filter { dock: bottom; display: none; }
    #filter.shown { display: block; }
    #procs, #ranks { border-top: solid $primary-darken-2; }
    #procs.empty, #ranks.empty { height: auto; min-height: 2; }
    """
    AUTO_FOCUS = None  # on_mount focuses the ranks of a run, else the processes
    BINDINGS = [
        Binding("question_mark", "help", "Help"),
        Binding("s", "sort", "Sort"),
        Binding("slash", "filter", "Filter"),
        Binding("p", "pause", "Pause"),
        Binding("r", "runs", "Runs"),
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
        pick_runs: list[LiveRun] | None = None,
    ) -> None:
        super().__init__()
        self.animation_level = "none"  # a monitor: scrolling jumps, nothing glides
        self.collector = collector
        self.feed = feed
        self.interval = interval
        self.rank_interval = rank_interval if rank_interval is not None else max(interval, 1.0)
        self.clock = clock
        self.pick_runs = pick_runs
        self.paused = False
        self.filter_text = ""
        self.proc_sort = 0
        self.rank_sort = 0
        self.snapshot: GpuSnapshot | None = None
        self.report: RankReport | None = None
        self.overview: Overview | None = None
        self.gpu_updates = 0
        self._stop = threading.Event()
        self._poll_now = threading.Event()
        self._shown_ranks: list[RankStatus] = []
        self._rank_screen: RankScreen | None = None  # the open rank details, refreshed with the data
        self._joint = JointDelivery()
        self._shown_data = False

    # -- layout ------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield TextLines(id="host")
        yield ScrollLines(id="gpus")
        yield RowTable(views.PROCESS_COLUMNS, id="procs")
        yield RowTable(views.RANK_COLUMNS, id="ranks")
        yield ScrollLines(id="alerts", wrap=True)
        yield Input(placeholder="filter rows (Enter keeps it, Esc clears)", id="filter")
        yield SteadyFooter()

    def on_mount(self) -> None:
        procs, ranks = self.query_one("#procs", RowTable), self.query_one("#ranks", RowTable)
        procs.border_title = "processes"
        ranks.border_title = "ranks"
        (ranks if self.feed is not None else procs).focus()
        self._fit_gpu_panel()
        if self.feed is None:
            self.report = RankReport()
        self.run_worker(self._gpu_loop, thread=True, group="gpu", name="gpu-sampler")
        self.run_worker(self._rank_loop, thread=True, group="ranks", name="rank-poller")
        if self.pick_runs:
            self._show_runs(self.pick_runs)

    def on_unmount(self) -> None:
        self._stop.set()
        self._poll_now.set()
        self.collector.close()

    def on_resize(self, event: Resize) -> None:
        self._fit_gpu_panel()
        self._render()

    def _fit_gpu_panel(self) -> None:
        # a third of the height at most (at least 3 lines): the tables below need the rest
        self.query_one("#gpus").styles.max_height = self._gpu_rows()

    def _gpu_rows(self) -> int:
        return max(3, self.size.height // 3)

    # -- workers (threads) -----------------------------------------------------------------------

    def _gpu_loop(self) -> None:
        pcie_started = False
        polled_ranks = float("-inf")
        while not self._stop.is_set():
            if not self.paused:
                with_ranks = (
                    self.feed is not None and time.monotonic() - polled_ranks >= 0.9 * self.rank_interval
                )
                if with_ranks:
                    polled_ranks = time.monotonic()
                    self._joint.expect()
                    self._poll_now.set()  # the rank poll runs alongside this sample
                snap = self.collector.sample()
                report = self._joint.take(JOINT_WAIT) if with_ranks else None
                self.call_from_thread(self._on_data, snap, report)
                if not pcie_started:
                    # Only after the first sample is on screen: PCIe reads block ~20 ms per
                    # direction per GPU inside NVML and would otherwise delay the first frame.
                    self.collector.source.start_background()
                    pcie_started = True
            self._stop.wait(self.interval)

    def _rank_loop(self) -> None:
        while not self._stop.is_set():
            feed = self.feed  # replaced when the user picks another run
            if feed is not None and not self.paused:
                try:
                    report = feed.poll()
                except Exception as exc:  # noqa: BLE001 - a bad file or payload must not stop the monitor
                    report = RankReport(errors=[f"reading rank telemetry failed: {exc!r}"])
                if feed is self.feed and not self._joint.give(report):
                    self.call_from_thread(self._on_data, None, report)
            # woken by the GPU sampler (in step with its samples), else by a timeout of its own
            self._poll_now.wait(1.5 * self.rank_interval)
            self._poll_now.clear()

    def _on_data(self, snap: GpuSnapshot | None, report: RankReport | None) -> None:
        if snap is not None:
            self.snapshot = snap
            self.gpu_updates += 1
        if report is not None:
            self.report = report
        self._render()

    @property
    def ready(self) -> bool:
        """Whether the screen shows a GPU sample and a rank report."""
        return self._shown_data

    # -- rendering ------------------------------------------------------------------------------

    def _render(self) -> None:
        if self.snapshot is None:
            return
        self.overview = Overview.build(self.snapshot, self.report or RankReport())
        try:
            self._render_main()
        except NoMatches:
            # A sample delivered by a worker while the main screen's widgets are not mounted (the
            # app is starting or shutting down): nothing to draw on; the next sample redraws.
            return
        self._shown_data = self.report is not None
        if self._rank_screen is not None:
            if self._rank_screen.is_attached:
                self._update_rank_screen(self._rank_screen)
            else:
                self._rank_screen = None  # closed

    def _render_main(self) -> None:
        ov = self.overview
        assert ov is not None
        host = self.query_one("#host", TextLines)
        width = host.size.width or self.size.width - 2
        host.set_lines([views.host_line(ov, width, paused=self.paused, filter_text=self.filter_text)])
        gpus = self.query_one("#gpus", ScrollLines)
        # the scrollbar's column is always kept (gutter: stable): the width changes only with the
        # terminal's, so lines built for it stay right when the panel starts or stops scrolling
        gpu_width = gpus.scrollable_content_region.width or self.size.width - 2
        gpus.set_lines(views.gpu_lines(ov, self.collector.history, gpu_width, self._gpu_rows()))
        self._render_processes(ov)
        self._render_ranks(ov)
        self.query_one("#alerts", ScrollLines).set_lines(views.alert_lines(ov))

    def _matches_filter(self, cells: list[Cell]) -> bool:
        if not self.filter_text:
            return True
        needle = self.filter_text.lower()
        return any(needle in (c if isinstance(c, str) else c.plain).lower() for c in cells)

    def _render_processes(self, ov: Overview) -> None:
        table = self.query_one("#procs", RowTable)
        rows = views.process_rows(ov)
        which = self.proc_sort
        rows.sort(key=lambda r: r[0][which], reverse=which in (0, 1))
        table.set_rows([(k, c) for _, k, c in rows if self._matches_filter(c)])
        table.set_class(table.row_count == 0, "empty")  # the other table gets the room
        _set_title(table, f"processes (sort: {views.PROCESS_SORTS[which]})")

    def _render_ranks(self, ov: Overview) -> None:
        table = self.query_one("#ranks", RowTable)
        which = views.RANK_SORTS[self.rank_sort]
        multi = len(ov.report.sources) > 1
        rows, shown = [], []
        for r in views.sort_ranks(ov.report.ranks, which):
            cells = views.rank_cells(r, multi, ov.report.job_dirs.get(r.node))
            if self._matches_filter(cells):
                rows.append((f"{r.node}:{r.rank}", cells))
                shown.append(r)
        self._shown_ranks = shown
        table.set_rows(rows)
        table.set_class(not rows, "empty")
        title = views.ranks_title(ov, which)
        if not ov.report.sources and self.feed is None and self.pick_runs:
            title = f"ranks: no run picked; r lists the {len(self.pick_runs)} live runs"
        _set_title(table, title)

    def _update_rank_screen(self, screen: RankScreen) -> None:
        ov = self.overview
        assert ov is not None
        key = (screen.rank.node, screen.rank.rank)
        fresh = next((r for r in ov.report.ranks if (r.node, r.rank) == key), None)
        gpu = next((g for g in ov.snapshot.gpus if fresh is not None and g.index == fresh.device), None)
        screen.update_rank(fresh, gpu, ov.report.job_dirs.get(key[0]))

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
            self.rank_sort = (self.rank_sort + 1) % len(views.RANK_SORTS)
        else:
            self.proc_sort = (self.proc_sort + 1) % len(views.PROCESS_SORTS)
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

    def action_runs(self) -> None:
        from sddoctor.telemetry.registry import live_runs

        runs = live_runs()
        if not runs:
            self.notify("no running `sddoctor run` of yours on this host", timeout=4)
            return
        self._show_runs(runs)

    def _show_runs(self, runs: list[LiveRun]) -> None:
        from sddoctor.tui.screens import RunsScreen

        self.push_screen(RunsScreen(runs, now=self.clock()), callback=self.open_run)

    def open_run(self, run: LiveRun | None) -> None:
        """Watch the ranks of `run` (a live run picked from the registry) from now on."""
        if run is None:
            return
        self.feed = RunDirFeed(run.run_dir, job_dir=run.cwd)
        self.report = RankReport()
        self._render()
        self.query_one("#ranks", RowTable).focus()
        self._poll_now.set()

    def on_row_table_row_selected(self, event: RowTable.RowSelected) -> None:
        if event.table.id != "ranks" or self.overview is None:
            return
        index = event.cursor_row
        if 0 <= index < len(self._shown_ranks):
            rank = self._shown_ranks[index]
            run_dir = self.overview.report.run_dirs.get(rank.node)
            from sddoctor.tui.screens import RankScreen  # imported when first opened, as HelpScreen

            self._rank_screen = RankScreen(rank, run_dir)
            self._update_rank_screen(self._rank_screen)
            self.push_screen(self._rank_screen)


class JointDelivery:
    """A rank report handed from the rank poller to the GPU sampler waiting for it, so that a
    sample and a report taken together reach the screen as one frame: each frame costs a pass of
    Textual's compositor. A report that comes too late (a slow endpoint) goes on its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._waiting = False
        self._report: RankReport | None = None

    def expect(self) -> None:
        """The sampler will wait for the next report."""
        with self._lock:
            self._waiting, self._report = True, None
            self._ready.clear()

    def give(self, report: RankReport) -> bool:
        """Hand `report` over; False when the sampler is not waiting (deliver it yourself)."""
        with self._lock:
            if not self._waiting:
                return False
            self._report = report
            self._ready.set()
            return True

    def take(self, timeout: float) -> RankReport | None:
        """The report, once given or after `timeout` seconds (None); stops waiting either way."""
        self._ready.wait(timeout)
        with self._lock:
            self._waiting = False
            report, self._report = self._report, None
            return report


def _set_title(widget: RowTable, title: str) -> None:
    if widget.border_title != title:  # assigning, even the same text, repaints the widget
        widget.border_title = title
