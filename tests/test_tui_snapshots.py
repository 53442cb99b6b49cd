"""Snapshot tests of the screens (pytest-textual-snapshot) at 80x24 (a fresh terminal, many SSH
sessions) and 200x50, with 8 fake GPUs and 8 ranks, with and without NVML. Deterministic: fake
NVML, fixed host, a run directory with fixed timestamps and a frozen clock.
Update after an intended change with: pytest tests/test_tui_snapshots.py --snapshot-update,
then look at the SVGs in tests/__snapshots__/test_tui_snapshots/ before committing them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tui_fixtures import NOW, demo_collector, demo_feed, frozen_clock, isolate_registry, write_demo_run

from sddoctor.gpu.nvml import set_nvml_for_tests
from sddoctor.telemetry.registry import LiveRun
from sddoctor.tui.app import MonitorApp

SIZES = {"80x24": (80, 24), "200x50": (200, 50)}


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate_registry(tmp_path, monkeypatch)
    yield
    set_nvml_for_tests(None, None)


def _app(tmp_path, nvml=True, **kw):
    job = tmp_path / "job"
    run_dir = write_demo_run(job / "sddoctor-runs" / "run-demo", world=8, job_dir=job)
    return MonitorApp(
        demo_collector(nvml=nvml, n_gpus=8), demo_feed(run_dir), interval=3600, clock=frozen_clock, **kw
    )


async def _wait_ready(pilot):
    deadline = time.monotonic() + 10
    while not pilot.app.ready and time.monotonic() < deadline:
        await pilot.pause(0.02)
    await pilot.pause()


@pytest.mark.parametrize("size", SIZES)
def test_main_screen(snap_compare, tmp_path, size):
    assert snap_compare(_app(tmp_path), terminal_size=SIZES[size], run_before=_wait_ready)


@pytest.mark.parametrize("size", SIZES)
def test_without_nvml(snap_compare, tmp_path, size):
    assert snap_compare(_app(tmp_path, nvml=False), terminal_size=SIZES[size], run_before=_wait_ready)


def test_main_screen_scrolled_to_the_last_rank(snap_compare, tmp_path):
    async def before(pilot):
        await _wait_ready(pilot)
        await pilot.press("end")

    assert snap_compare(_app(tmp_path), terminal_size=SIZES["80x24"], run_before=before)


def test_help_screen(snap_compare, tmp_path):
    async def before(pilot):
        await _wait_ready(pilot)
        await pilot.press("question_mark")

    assert snap_compare(_app(tmp_path), terminal_size=SIZES["80x24"], run_before=before)


def test_rank_details_with_stack_dump(snap_compare, tmp_path):
    async def before(pilot):
        await _wait_ready(pilot)
        pilot.app.query_one("#ranks").move_cursor(row=1)
        await pilot.press("enter")
        for _ in range(100):
            if "save_checkpoint" in pilot.app.screen.stack_text:
                break
            await pilot.pause(0.02)
        await pilot.pause()

    assert snap_compare(_app(tmp_path), terminal_size=SIZES["80x24"], run_before=before)


def test_runs_picker(snap_compare, tmp_path):
    runs = [
        LiveRun(
            pid=52000 + i,
            run_dir=Path(f"/home/alice/{name}/sddoctor-runs/run-20261203-09{i}500"),
            endpoint=f"http://127.0.0.1:{8765 + i}",
            command=["torchrun", "--nproc-per-node", "8", "train.py", "--config", f"{name}.yaml"],
            cwd=f"/home/alice/{name}",
            started=NOW - 90 - 600 * i,
            host="node0",
        )
        for i, name in enumerate(("sd2-finetune", "sdxl-lora"))
    ]
    app = MonitorApp(demo_collector(n_gpus=8), None, interval=3600, clock=frozen_clock, pick_runs=runs)
    assert snap_compare(app, terminal_size=SIZES["80x24"], run_before=_wait_ready)
