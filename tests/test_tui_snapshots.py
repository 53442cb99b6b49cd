"""Snapshot tests of the main screens (pytest-textual-snapshot). Deterministic: fake NVML,
fixed host, a run directory with fixed timestamps and a frozen clock.
Update after an intended change with: pytest tests/test_tui_snapshots.py --snapshot-update"""

from __future__ import annotations

import time

import pytest
from tui_fixtures import demo_collector, demo_feed, frozen_clock, write_demo_run

from sddoctor.gpu.nvml import set_nvml_for_tests
from sddoctor.tui.app import MonitorApp

SIZE = (160, 48)


@pytest.fixture(autouse=True)
def _reset_nvml():
    yield
    set_nvml_for_tests(None, None)


def _app(tmp_path, nvml=True):
    return MonitorApp(
        demo_collector(nvml=nvml),
        demo_feed(write_demo_run(tmp_path / "run-demo")),
        interval=3600,
        clock=frozen_clock,
    )


async def _wait_ready(pilot):
    deadline = time.monotonic() + 10
    while not pilot.app.ready and time.monotonic() < deadline:
        await pilot.pause(0.02)
    await pilot.pause()


def test_main_screen(snap_compare, tmp_path):
    assert snap_compare(_app(tmp_path), terminal_size=SIZE, run_before=_wait_ready)


def test_help_screen(snap_compare, tmp_path):
    async def before(pilot):
        await _wait_ready(pilot)
        await pilot.press("question_mark")

    assert snap_compare(_app(tmp_path), terminal_size=SIZE, run_before=before)


def test_rank_details_with_stack_dump(snap_compare, tmp_path):
    async def before(pilot):
        await _wait_ready(pilot)
        ranks = pilot.app.query_one("#ranks")
        ranks.focus()
        ranks.move_cursor(row=1)
        await pilot.press("enter")
        for _ in range(100):
            if "save_checkpoint" in str(pilot.app.screen.query_one("#rank-stack").content):
                break
            await pilot.pause(0.02)
        await pilot.pause()

    assert snap_compare(_app(tmp_path), terminal_size=SIZE, run_before=before)


def test_without_nvml(snap_compare, tmp_path):
    assert snap_compare(_app(tmp_path, nvml=False), terminal_size=SIZE, run_before=_wait_ready)
