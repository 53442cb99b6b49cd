"""The modal screens of `sddoctor tui`: help, one rank's details with its newest stack dump,
and the list of live runs to pick from.

Kept apart from the main screen and imported when first opened: none of this is needed for
the first frame, and each module imported before it adds to the start-up. Each screen fits a
fresh 80x24 terminal.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from sddoctor.gpu.samples import GpuSample
from sddoctor.ranks.feeds import latest_stack_dump
from sddoctor.ranks.status import RankStatus
from sddoctor.telemetry.registry import LiveRun
from sddoctor.tui.format import age, gib, loss, num, pct
from sddoctor.tui.paths import short_path, short_site, shorten_paths_in
from sddoctor.tui.rowtable import Cell, Column, RowTable
from sddoctor.tui.views import STATE_STYLE, collective_cell

HELP_TEXT = """\
[b]sddoctor tui[/b]: local GPUs, their processes and the ranks of a DDP run
 [b]?[/b] help     [b]s[/b] sort the focused table   [b]/[/b] filter rows (Esc clears)
 [b]p[/b] pause    [b]r[/b] pick a live run          [b]enter[/b] a rank's details
 [b]q[/b] quit     [b]tab[/b] next panel   arrows PgUp PgDn Home End   mouse
[b]GPUs[/b]    util % and history, memory used/total, °C, power/limit W,
        P-state; why clocks are held back (sw-power-cap, hw-slowdown...)
[b]Procs[/b]   each GPU process and the rank it is (by pid, else by device);
        [b red]!![/b red] a rank holding memory on a GPU that is not its own
[b]Ranks[/b]   img/s: images per second of that rank alone; the title adds
        them up for all ranks. Collective: the one the rank waits in
        ("in all_reduce #812 95s"), else the last it finished.
        Call site: file:line from the job's folder (libraries from
        their package: torch/...).
 states [green]training[/green] [yellow]collective[/yellow] (1 s+ in one) [b red]hung[/b red] (120 s, or a verdict)
        [b yellow]silent[/b yellow] (no heartbeat 30 s) [yellow]oom-fallback[/yellow] [b red]crashed[/b red] exited starting
[b]Alerts[/b]  verdicts of sddoctor run, then what the monitor sees itself.
Narrow terminals leave less important columns out; enter shows all.
                                                   [dim]Esc or ? closes[/dim]"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "app.pop_screen", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll {
        width: 78; max-width: 100%; height: auto; max-height: 100%;
        border: round $accent; background: $panel; padding: 0 1;
    }
    """

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(HELP_TEXT, id="help-text")


class RankScreen(ModalScreen[None]):
    """One rank: everything its telemetry says, and the newest stack dump in the run's stacks/.
    The app hands it the rank's fresh status with every update (`update_rank`), and the stack
    dump is read again (in a thread) after each, so the screen stays live while open."""

    BINDINGS = [Binding("escape,q,enter", "app.pop_screen", "Back")]
    DEFAULT_CSS = """
    RankScreen { align: center middle; }
    RankScreen > VerticalScroll {
        width: 100%; max-width: 120; height: 100%; max-height: 40;
        border: round $accent; background: $panel; padding: 0 1;
    }
    """

    def __init__(self, rank: RankStatus, run_dir: Path | None) -> None:
        super().__init__()
        self.rank = rank
        self.run_dir = run_dir
        self.gone = False  # the rank is no longer reported by its source
        self.gpu: GpuSample | None = None
        self.job_dir: str | None = None
        self.stack_text = "stack dump: reading..."
        self.updates = 0
        self._reading = False

    def compose(self) -> ComposeResult:
        with VerticalScroll() as box:
            box.border_title = f"rank {self.rank.rank} · {self.rank.node}"
            box.border_subtitle = "live · Esc closes"
            yield Static(self._details(), id="rank-details")
            yield Static(Text(self.stack_text), id="rank-stack")

    def update_rank(self, rank: RankStatus | None, gpu: GpuSample | None, job_dir: str | None) -> None:
        """The rank's newest status (None: its source no longer reports it)."""
        self.gone = rank is None
        if rank is not None:
            self.rank = rank
        self.gpu, self.job_dir = gpu, job_dir
        self.updates += 1
        if not self.is_mounted:
            return  # compose draws it
        self.query_one("#rank-details", Static).update(self._details())
        self._read_stack()

    def on_mount(self) -> None:
        self._read_stack()

    def _read_stack(self) -> None:
        if not self._reading:
            self._reading = True
            self.run_worker(self._load_stack, thread=True, group="stack")

    def _load_stack(self) -> None:
        try:
            text = latest_stack_dump(self.run_dir, self.rank.rank)
        finally:
            self._reading = False
        body = (
            "last stack dump: " + shorten_paths_in(text, self.job_dir)
            if text
            else "no stack dump of this rank in the run's stacks/ (sddoctor run writes them on a hang)"
        )
        if body != self.stack_text:
            self.app.call_from_thread(self._show_stack, body)

    def _show_stack(self, body: str) -> None:
        self.stack_text = body
        if self.is_attached:
            self.query_one("#rank-stack", Static).update(Text(body))

    def _details(self) -> Table:
        r, g = self.rank, self.gpu
        state = Text(
            f"{r.state}: {shorten_paths_in(r.state_text, self.job_dir)}", style=STATE_STYLE.get(r.state, "")
        )
        if self.gone:
            state = Text(
                "no longer reported by its source (the values below are the last known)", style="dim"
            )
        rows: list[tuple[str, Any]] = [
            ("state", state),
            (
                "rank",
                f"{r.rank} of {num(r.world_size)} (local rank {num(r.local_rank)}) · node {r.node} · "
                f"host {r.host or '-'} · pid {num(r.pid)} · GPU {num(r.device)}",
            ),
            (
                "step",
                f"{num(r.step)} · loss {loss(r.loss)} · {num(r.it_s, '{:.2f}')} it/s · "
                f"{num(r.images_s, '{:.1f}')} img/s (this rank)",
            ),
            (
                "batch",
                f"micro-batch {num(r.micro_batch)} x accumulation {num(r.grad_accum)} · "
                f"peak memory {gib(r.mem_peak)} GiB",
            ),
        ]
        if g is not None:
            rows.append(
                (
                    "GPU",
                    f"{g.index} {g.name}: util {pct(g.utilization_gpu)} · memory {gib(g.memory_used)}/"
                    f"{gib(g.memory_total)} GiB · {num(g.temperature)}°C · {num(g.power_draw)}/"
                    f"{num(g.power_limit)} W",
                )
            )
        where = short_site(r.call_site, self.job_dir) or "-"
        coll = collective_cell(r)
        if r.inflight:
            coll.append(f" · last done {r.last_collective or '-'}", style="")
        coll.append(f" · at {where}", style="")
        rows += [
            ("collective", coll),
            ("phase", r.phase or "-"),
            ("heartbeat", "-" if r.heartbeat_age is None else f"{r.heartbeat_age:.0f} s ago"),
        ]
        rows += [("note", shorten_paths_in(n, self.job_dir)) for n in r.notes]
        table = Table.grid(padding=(0, 1))
        table.add_column(style="bold", justify="right", no_wrap=True)
        table.add_column(overflow="fold")
        for key, value in rows:
            table.add_row(key, value)
        return table


RUN_COLUMNS = [
    Column("Run", max_width=28),
    Column("PID", align="right"),
    Column("Started", align="right"),
    Column("Folder", priority=2, max_width=30),
    Column("Endpoint", priority=3, max_width=28),
    Column("Command", flex=True, min_width=10, max_width=400),
]


class RunsScreen(ModalScreen["LiveRun | None"]):
    """The live `sddoctor run` supervisors of this user on this host: enter watches one."""

    BINDINGS = [Binding("escape,q", "dismiss(None)", "Cancel")]
    DEFAULT_CSS = """
    RunsScreen { align: center middle; }
    RunsScreen > Vertical {
        width: 100%; max-width: 140; height: auto; max-height: 100%;
        border: round $accent; background: $panel;
    }
    RunsScreen RowTable { height: auto; max-height: 20; overflow-x: hidden; scrollbar-gutter: auto; }
    RunsScreen #runs-hint { padding: 0 1; color: $text-muted; }
    """

    def __init__(self, runs: list[LiveRun], now: float | None = None) -> None:
        super().__init__()
        self.runs = runs
        self.now = now

    def compose(self) -> ComposeResult:
        with Vertical() as box:
            box.border_title = f"{len(self.runs)} live sddoctor runs on this host"
            yield RowTable(RUN_COLUMNS, id="runs")
            yield Static("enter watches the run under the cursor · Esc cancels", id="runs-hint")

    def on_mount(self) -> None:
        now = time.time() if self.now is None else self.now
        home = os.path.expanduser("~")
        rows: list[tuple[str, list[Cell]]] = []
        for i, run in enumerate(self.runs):
            cells = [
                run.label,
                str(run.pid),
                age(max(0.0, now - run.started)) + " ago",
                short_path(run.cwd or "-", None) if run.cwd != home else "~",
                run.endpoint or "-",
                " ".join(run.command) or "-",
            ]
            rows.append((str(i), [Text(c) for c in cells]))
        table = self.query_one("#runs", RowTable)
        table.set_rows(rows)
        table.focus()

    def on_row_table_row_selected(self, event: RowTable.RowSelected) -> None:
        event.stop()
        self.dismiss(self.runs[event.cursor_row])
