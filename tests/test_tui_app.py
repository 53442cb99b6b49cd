"""The app driven headless with App.run_test and Pilot, on the deterministic demo
(fake NVML, fixed host, a run directory with fixed timestamps) and without NVML."""

from __future__ import annotations

import io
import time

import pytest
from rich.console import Console
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.widgets import Static
from textual.widgets._footer import FooterKey
from tui_fixtures import DEMO_PIDS, demo_collector, demo_feed, frozen_clock, write_demo_run

from sddoctor.gpu.collector import Collector
from sddoctor.gpu.host import FixedHost
from sddoctor.gpu.nvml import set_nvml_for_tests
from sddoctor.gpu.source import NvmlSource
from sddoctor.testing.fake_nvml import FakeGpu, FakeNvml
from sddoctor.tui.app import MonitorApp
from sddoctor.tui.footer import SteadyFooter
from sddoctor.tui.screens import HelpScreen, RankScreen

pytestmark = pytest.mark.asyncio


@pytest.fixture(autouse=True)
def _reset_nvml():
    yield
    set_nvml_for_tests(None, None)


@pytest.fixture
def demo_run(tmp_path):
    return write_demo_run(tmp_path / "run-demo")


def _text(app, selector):
    widget = app.query_one(selector)
    if hasattr(widget, "plain"):
        return widget.plain
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(widget.content)  # a Text or a Rich table, as drawn at 200 columns
    return console.export_text()


def _column(table, index):
    return [str(table.get_row_at(i)[index]) for i in range(table.row_count)]


async def _ready(app, pilot):
    deadline = time.monotonic() + 10
    while not app.ready and time.monotonic() < deadline:
        await pilot.pause(0.02)
    assert app.ready


async def test_sort_filter_select_help_quit(demo_run):
    app = MonitorApp(demo_collector(), demo_feed(demo_run), interval=3600, clock=frozen_clock)
    async with app.run_test(size=(160, 50)) as pilot:
        await _ready(app, pilot)
        procs, ranks = app.query_one("#procs"), app.query_one("#ranks")
        assert procs.row_count == 6 and ranks.row_count == 4
        assert _column(procs, 1)[0] == str(DEMO_PIDS[2])  # biggest GPU memory first
        assert "GPU 3" in _text(app, "#gpus") and "sw-power-cap" in _text(app, "#gpus")
        assert "node0" in _text(app, "#host")

        procs.focus()
        await pilot.press("s")  # processes by CPU
        assert "sort: cpu" in procs.border_title and _column(procs, 1)[0] == str(DEMO_PIDS[3])
        await pilot.press("s", "s")  # ... pid, rank
        assert "sort: rank" in procs.border_title and _column(procs, 2)[0].startswith("0/4")
        ranks.focus()
        await pilot.press("s")  # ranks by step
        assert "sort: step" in ranks.border_title and app.proc_sort == 3

        await pilot.press("slash", *"41003")
        assert app.filter_text == "41003"
        assert _column(procs, 1) == ["41003"] and _column(ranks, 2) == ["41003"]
        await pilot.press("enter")  # keep the filter, back to the tables
        assert "filter: '41003'" in _text(app, "#host")
        await pilot.press("escape")
        assert app.filter_text == "" and procs.row_count == 6 and ranks.row_count == 4

        ranks.focus()
        ranks.move_cursor(row=_column(ranks, 0).index("1"))
        await pilot.press("enter")
        assert isinstance(app.screen, RankScreen) and app.screen.rank.rank == 1
        for _ in range(50):
            if "save_checkpoint" in _text(app.screen, "#rank-stack"):
                break
            await pilot.pause(0.02)
        assert "save_checkpoint (train.py:188)" in _text(app.screen, "#rank-stack")
        assert "hung: rank 1 never reached all_reduce #812" in _text(app.screen, "#rank-details")
        await pilot.press("escape")
        assert not isinstance(app.screen, RankScreen)

        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)

        alerts = _text(app, "#alerts")
        assert "never reached all_reduce #812" in alerts and "holds 0.6 GiB on GPU 0" in alerts
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0


async def test_pause_stops_updates(demo_run):
    app = MonitorApp(demo_collector(warm=0), demo_feed(demo_run), interval=0.02, clock=frozen_clock)
    async with app.run_test(size=(160, 50)) as pilot:
        await _ready(app, pilot)
        deadline = time.monotonic() + 10
        while app.gpu_updates < 3 and time.monotonic() < deadline:
            await pilot.pause(0.05)
        assert app.gpu_updates >= 3
        await pilot.press("p")
        assert app.paused and "PAUSED" in _text(app, "#host")
        await pilot.pause(0.1)  # a sample in flight may still land
        frozen = app.gpu_updates
        await pilot.pause(0.3)
        assert app.gpu_updates == frozen
        await pilot.press("p")
        deadline = time.monotonic() + 10
        while app.gpu_updates == frozen and time.monotonic() < deadline:
            await pilot.pause(0.05)
        assert app.gpu_updates > frozen


async def test_without_nvml_host_and_ranks_still_show(demo_run):
    app = MonitorApp(demo_collector(nvml=False), demo_feed(demo_run), interval=3600, clock=frozen_clock)
    async with app.run_test(size=(160, 50)) as pilot:
        await _ready(app, pilot)
        assert "No GPU data: NVML could not start" in _text(app, "#gpus")
        assert app.query_one("#procs").row_count == 0 and app.query_one("#ranks").row_count == 4
        assert "no GPU data" in _text(app, "#alerts")


async def test_no_run_says_how_to_get_one():
    app = MonitorApp(demo_collector(), None, interval=3600, clock=frozen_clock)
    async with app.run_test(size=(160, 50)) as pilot:
        await _ready(app, pilot)
        assert "no run found" in app.query_one("#ranks").border_title
        assert _column(app.query_one("#procs"), 3) == ["-"] * 6


async def test_mouse_click_selects_then_opens_a_rank(demo_run):
    app = MonitorApp(demo_collector(), demo_feed(demo_run), interval=3600, clock=frozen_clock)
    async with app.run_test(size=(160, 50)) as pilot:
        await _ready(app, pilot)
        await pilot.pause(0.1)  # let the layout settle after the first data
        ranks = app.query_one("#ranks")
        # the border-top takes one line and the header another: the third line is row 1
        await pilot.click("#ranks", offset=(3, 3))
        assert ranks.cursor_row == 1 and not isinstance(app.screen, RankScreen)
        await pilot.click("#ranks", offset=(3, 3))
        assert isinstance(app.screen, RankScreen) and app.screen.rank.rank == 1


async def test_pcie_reader_starts_after_the_first_sample_is_shown():
    fake = FakeNvml([FakeGpu(pcie_kb=(2000, 500))])
    set_nvml_for_tests(fake)
    collector = Collector(NvmlSource(pcie_interval=0.02, open_in_background=True), FixedHost())
    app = MonitorApp(collector, None, interval=0.02)
    pcie_calls_at_first_frame = []
    show = app._on_data

    def on_data(snap, report):
        if not pcie_calls_at_first_frame:
            pcie_calls_at_first_frame.append(fake.calls.get("pcie", 0))
        show(snap, report)

    app._on_data = on_data
    async with app.run_test(size=(160, 50)) as pilot:
        await _ready(app, pilot)
        deadline = time.monotonic() + 10
        while "PCIe rx 2.0 MB/s" not in _text(app, "#gpus") and time.monotonic() < deadline:
            await pilot.pause(0.05)
        assert "PCIe rx 2.0 MB/s" in _text(app, "#gpus")
    assert pcie_calls_at_first_frame == [0]
    assert collector.source._pcie is None  # stopped with the app


def _footer_keys(app):
    return [(k.key, k.description) for k in app.query(FooterKey)]


async def test_footer_is_built_once_and_kept_while_its_keys_stay_the_same():
    app = MonitorApp(demo_collector(), None, interval=3600, clock=frozen_clock)
    async with app.run_test(size=(160, 50)) as pilot:
        await _ready(app, pilot)
        await pilot.pause(0.1)
        keys = list(app.query(FooterKey))
        assert _footer_keys(app) == [
            ("question_mark", "Help"),
            ("s", "Sort"),
            ("slash", "Filter"),
            ("p", "Pause"),
            ("r", "Runs"),
            ("q", "Quit"),
            ("ctrl+p", "palette"),
        ]
        assert app.focused is app.query_one("#procs")  # no run: the processes have the focus
        await pilot.press("tab")  # focus moves to the rank table: the same keys are shown
        await pilot.pause(0.1)
        assert app.focused is app.query_one("#ranks")
        assert list(app.query(FooterKey)) == keys  # the very same widgets: not rebuilt
        await pilot.press("question_mark")  # help over the main screen, and back
        await pilot.press("escape")
        await pilot.pause(0.1)
        assert list(app.query(FooterKey)) == keys
        await pilot.click(FooterKey, offset=(1, 0))  # its first key, "?": still clickable
        assert isinstance(app.screen, HelpScreen)


class _Extra(Static, can_focus=True):
    BINDINGS = [Binding("x", "app.bell", "Extra")]


class _FooterApp(App[None]):
    BINDINGS = [Binding("q", "quit", "Quit")]

    def compose(self) -> ComposeResult:
        yield Static("plain")
        yield _Extra("extra", id="extra")
        yield SteadyFooter()


async def test_footer_is_rebuilt_when_the_shown_keys_change():
    app = _FooterApp()
    async with app.run_test(size=(80, 10)) as pilot:
        await pilot.pause(0.1)
        assert _footer_keys(app) == [("x", "Extra"), ("q", "Quit"), ("ctrl+p", "palette")]
        app.set_focus(None)
        await pilot.pause(0.1)
        assert _footer_keys(app) == [("q", "Quit"), ("ctrl+p", "palette")]
        app.query_one("#extra").focus()
        await pilot.pause(0.1)
        assert _footer_keys(app) == [("x", "Extra"), ("q", "Quit"), ("ctrl+p", "palette")]
