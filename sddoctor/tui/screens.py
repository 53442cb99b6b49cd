"""The modal screens of `sddoctor tui`: help, and one rank's details with its newest stack dump.

Kept apart from the main screen and imported when first opened: none of this is needed for
the first frame, and each module imported before it adds to the start-up.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from sddoctor.gpu.rankfeeds import latest_stack_dump
from sddoctor.gpu.ranks import RankStatus
from sddoctor.tui.app import STATE_STYLE
from sddoctor.tui.format import gib, loss, num

HELP_TEXT = """\
[b]sddoctor tui[/b]: local GPUs, their processes, and the ranks of a DDP run

[b]Keys[/b]
  ?        this help                    q        quit
  s        sort the focused table (processes: gpu memory, cpu, pid, rank, gpu;
           ranks: rank, step, it/s, state)
  /        filter rows of both tables by text (Esc clears)
  enter    on a rank: its details and last stack dump
  p        pause / resume sampling       tab      move between tables
  Mouse: click a row to select it, click a selected rank row to open it, scroll to scroll.

[b]GPU lines[/b]  util % with history, memory used/total GiB with history,
  temperature, power draw/limit, SM and memory clocks, P-state, PCIe rx/tx,
  ECC corrected/uncorrected, and clock-event reasons (why clocks are held back:
  idle, sw-power-cap, hw-slowdown, sw-thermal, hw-thermal, power-brake, ...).

[b]Processes[/b]  each GPU process, with the rank it is (matched by pid, else by the
  rank's device); "!!" marks a rank holding memory on a GPU that is not its own.

[b]Ranks[/b]  step, loss, it/s, images/s, state (training, in collective #k for N s,
  hung, silent, crashed, oom-fallback, exited), last collective and call site.

Press Esc or ? to close."""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "app.pop_screen", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 90; height: 80%; border: round $accent; background: $panel; padding: 0 1; }
    """

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(HELP_TEXT, id="help-text")


class RankScreen(ModalScreen[None]):
    """One rank: everything its telemetry says, and the newest stack dump in the run's stacks/."""

    BINDINGS = [Binding("escape,q,enter", "app.pop_screen", "Back")]
    DEFAULT_CSS = """
    RankScreen { align: center middle; }
    RankScreen > VerticalScroll { width: 95%; height: 90%; border: round $accent; background: $panel; padding: 0 1; }
    """

    def __init__(self, rank: RankStatus, run_dir: Any) -> None:
        super().__init__()
        self.rank = rank
        self.run_dir = run_dir

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(self._details(), id="rank-details")
            yield Static("stack dump: reading...", id="rank-stack")

    def on_mount(self) -> None:
        self.run_worker(self._load_stack, thread=True, group="stack")

    def _load_stack(self) -> None:
        text = latest_stack_dump(self.run_dir, self.rank.rank)
        body = (
            text
            if text
            else "no stack dump of this rank in the run's stacks/ (sddoctor run writes them on a hang)"
        )
        self.app.call_from_thread(self._show_stack, body)

    def _show_stack(self, body: str) -> None:
        self.query_one("#rank-stack", Static).update(Text("last stack dump: " + body))

    def _details(self) -> Text:
        r = self.rank
        rows = [
            ("rank", f"{r.rank} of {num(r.world_size)} (local rank {num(r.local_rank)})"),
            ("node", f"{r.node}  host {r.host or '-'}  pid {num(r.pid)}  GPU {num(r.device)}"),
            ("state", f"{r.state}: {r.state_text}"),
            (
                "step",
                f"{num(r.step)}  loss {loss(r.loss)}  it/s {num(r.it_s, '{:.2f}')}  images/s {num(r.images_s, '{:.1f}')}",
            ),
            (
                "batch",
                f"micro-batch {num(r.micro_batch)} x accumulation {num(r.grad_accum)}, peak memory {gib(r.mem_peak)} GiB",
            ),
            ("phase", r.phase or "-"),
            ("collective", f"last {r.last_collective or '-'} at {r.call_site or '-'}"),
            ("heartbeat", "-" if r.heartbeat_age is None else f"{r.heartbeat_age:.0f} s ago"),
        ]
        text = Text()
        for k, v in rows:
            text.append(f"{k:>11}  ", style="bold")
            text.append(v + "\n", style=STATE_STYLE.get(r.state, "") if k == "state" else "")
        for note in r.notes:
            text.append(f"{'note':>11}  ", style="bold")
            text.append(note + "\n")
        return text
