"""The app on a fresh 80x24 terminal with 8 GPUs and 8 ranks: every key column shown, every GPU
and rank reachable by scrolling, help that fits, call sites relative to the job's folder, rank
details that follow the data, one labelled meaning of img/s, and picking among live runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from test_tui_registry import write_entry
from tui_fixtures import NOW, demo_collector, demo_feed, frozen_clock, isolate_registry, write_demo_run

from sddoctor.gpu.nvml import set_nvml_for_tests
from sddoctor.ranks.feeds import RunDirFeed
from sddoctor.telemetry import registry
from sddoctor.tui import cli
from sddoctor.tui.app import MonitorApp
from sddoctor.tui.screens import HELP_TEXT, HelpScreen, RankScreen, RunsScreen

pytestmark = pytest.mark.asyncio

KEY_RANK_COLUMNS = ["Rank", "State", "Step", "img/s", "Collective", "Call site"]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    isolate_registry(tmp_path, monkeypatch)
    yield
    set_nvml_for_tests(None, None)


@pytest.fixture
def run_dir(tmp_path):
    """An 8-rank run under JOB/sddoctor-runs/, whose ranks report absolute call sites in JOB."""
    job_dir = tmp_path / "job"
    return write_demo_run(job_dir / "sddoctor-runs" / "run-demo", world=8, job_dir=job_dir)


def _app(run_dir, nvml=True, **kw):
    return MonitorApp(
        demo_collector(nvml=nvml, n_gpus=8),
        demo_feed(run_dir),
        interval=3600,
        clock=frozen_clock,
        **kw,
    )


async def _ready(app, pilot):
    deadline = time.monotonic() + 10
    while not app.ready and time.monotonic() < deadline:
        await pilot.pause(0.02)
    assert app.ready
    await pilot.pause(0.05)


def _visible(widget) -> list[str]:
    """The lines the widget draws now, as plain text."""
    return [widget.render_line(y).text for y in range(widget.scrollable_content_region.height)]


async def test_80x24_shows_the_key_columns_and_scrolls_to_every_rank_and_gpu(run_dir):
    app = _app(run_dir)
    async with app.run_test(size=(80, 24)) as pilot:
        await _ready(app, pilot)
        ranks, procs, gpus = app.query_one("#ranks"), app.query_one("#procs"), app.query_one("#gpus")
        assert app.focused is ranks  # a run is watched: its ranks have the focus
        for table, key in ((ranks, KEY_RANK_COLUMNS), (procs, ["GPU", "PID", "Rank", "GPU MiB", "Command"])):
            assert set(key) <= set(table.shown_columns), table.shown_columns
            # whole columns: the row fits the width, nothing is reached by scrolling sideways
            assert table.virtual_size.width <= table.scrollable_content_region.width
        header = _visible(ranks)[0]
        assert header.split() == ["Rank", "State", "Step", "img/s", "Collective", "Call", "site"]
        rows = _visible(ranks)[1:]
        assert rows[0].split()[:4] == ["0", "training", "809", "8.0"]
        assert rows[0].rstrip().endswith("all_reduce #811 4.2 ms train.py:212")
        assert "in all_reduce #812 95s" in rows[2]  # rank 2 waits: the collective it is in, and since when

        await pilot.press("end")
        assert ranks.cursor_row == 7 and ranks.scroll_y > 0
        last = _visible(ranks)
        assert any(line.split()[:2] == ["7", "training"] for line in last)
        five = next(line for line in last if line.split()[:1] == ["5"])
        assert five.rstrip().endswith("torch/…/distributed.py:1523")  # a library frame, cut in its middle

        assert len(gpus.plain.splitlines()) == 8  # one line per GPU at 80 columns
        assert [line.split()[:2] for line in gpus.plain.splitlines()][7] == ["7", "H200"]


async def test_a_short_terminal_scrolls_the_gpu_panel(run_dir):
    app = _app(run_dir)
    async with app.run_test(size=(80, 20)) as pilot:
        await _ready(app, pilot)
        gpus = app.query_one("#gpus")
        assert gpus.size.height == 6 and gpus.virtual_size.height == 8
        assert _visible(gpus)[-1].split()[:1] == ["5"]
        gpus.focus()
        await pilot.press("end")
        assert gpus.scroll_y == 2 and _visible(gpus)[-1].split()[:2] == ["7", "H200"]


async def test_wide_terminal_shows_every_column_and_two_lines_per_gpu(run_dir):
    app = _app(run_dir)
    async with app.run_test(size=(200, 50)) as pilot:
        await _ready(app, pilot)
        ranks = app.query_one("#ranks")
        assert ranks.shown_columns == [
            "Rank", "PID", "GPU", "State", "Step", "Loss", "it/s", "img/s", "Collective", "Call site", "Detail"
        ]  # fmt: skip
        rows = _visible(ranks)
        assert "torch/nn/parallel/distributed.py:1523" in rows[6]  # wide enough for the whole path
        lines = app.query_one("#gpus").plain.splitlines()
        assert len(lines) == 16 and lines[0].startswith("GPU 0 NVIDIA H200") and "PCIe rx" in lines[1]


async def test_img_s_means_per_rank_and_the_title_gives_the_sum(run_dir):
    app = _app(run_dir)
    async with app.run_test(size=(80, 24)) as pilot:
        await _ready(app, pilot)
        ranks = app.query_one("#ranks")
        column = ranks.column_index("img/s")
        assert {ranks.get_row_at(i)[column] for i in range(8)} == {"8.0"}  # 16 samples / 2 s step, each
        # rank 1 is hung (a verdict names it): its old rate is not part of the job's
        assert "img/s per rank · all ranks 56.0 img/s" in ranks.border_title


async def test_help_fits_80x24(run_dir):
    app = _app(run_dir)
    async with app.run_test(size=(80, 24)) as pilot:
        await _ready(app, pilot)
        await pilot.press("question_mark")
        await pilot.pause(0.05)
        assert isinstance(app.screen, HelpScreen)
        box = app.screen.query_one("VerticalScroll")
        assert box.region.right <= 80 and box.region.bottom <= 24
        assert box.max_scroll_y == 0 and box.max_scroll_x == 0  # all of it in view
        text = app.screen.query_one("#help-text")
        assert text.size.height == len(HELP_TEXT.splitlines())  # no line wrapped


async def test_rank_details_follow_the_rank_and_its_stack_dumps(run_dir):
    app = MonitorApp(
        demo_collector(n_gpus=8), demo_feed(run_dir), interval=3600, rank_interval=0.05, clock=frozen_clock
    )
    async with app.run_test(size=(80, 24)) as pilot:
        await _ready(app, pilot)
        ranks = app.query_one("#ranks")
        ranks.move_cursor(row=2)
        await pilot.press("enter")
        screen = app.screen
        assert isinstance(screen, RankScreen) and screen.rank.rank == 2
        assert screen.rank.state == "collective" and screen.rank.step == 809

        # rank 2 gets out of the all_reduce and finishes step 810; a stack dump of it appears
        state_file = run_dir / "ranks" / "rank-00002.state"
        state = json.loads(state_file.read_text())
        state["step"] = state["last_step"]["step"] = 810
        state["collectives"]["inflight"] = []
        state_file.write_text(json.dumps(state))
        (run_dir / "stacks" / "rank-00002.txt").write_text(
            f'Thread 1 (active): "MainThread"\n    backward ({run_dir.parents[1]}/train.py:230)\n'
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (
            screen.rank.step == 810 and "backward (train.py:230)" in screen.stack_text
        ):
            await pilot.pause(0.05)
        assert screen.rank.step == 810 and screen.rank.state == "training"
        assert "backward (train.py:230)" in screen.stack_text  # and the path relative to the job
        assert screen.updates >= 2 and app.screen is screen


async def test_several_live_runs_are_offered_and_the_picked_one_is_watched(tmp_path):
    runs = [write_demo_run(tmp_path / name / "sddoctor-runs" / name, world=2) for name in ("run-a", "run-b")]
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        entries = registry.registry_dir()
        write_entry(entries, os.getpid(), runs[0], started=NOW - 60)
        write_entry(entries, sleeper.pid, runs[1], started=NOW - 30)
        live = registry.live_runs()
        assert [r.label for r in live] == ["run-b", "run-a"]
        app = MonitorApp(demo_collector(n_gpus=2), None, interval=3600, clock=frozen_clock, pick_runs=live)
        async with app.run_test(size=(80, 24)) as pilot:
            await _ready(app, pilot)
            assert isinstance(app.screen, RunsScreen)
            await pilot.press("escape")  # nothing picked: the view says how to pick later
            assert app.feed is None and "r lists the 2 live runs" in app.query_one("#ranks").border_title
            await pilot.press("r")
            assert isinstance(app.screen, RunsScreen)
            await pilot.press("down", "enter")
            assert isinstance(app.feed, RunDirFeed) and app.feed.run_dir.path == runs[0].resolve()
            deadline = time.monotonic() + 10
            while app.query_one("#ranks").row_count != 2 and time.monotonic() < deadline:
                await pilot.pause(0.05)
            assert app.query_one("#ranks").row_count == 2 and "run: run-a" in app.query_one("#host").plain
    finally:
        sleeper.kill()
        sleeper.wait()


async def test_r_without_live_runs_says_so(run_dir):
    app = _app(run_dir)
    async with app.run_test(size=(80, 24)) as pilot:
        await _ready(app, pilot)
        await pilot.press("r")
        await pilot.pause(0.05)
        assert not isinstance(app.screen, RunsScreen)
        assert any("no running `sddoctor run`" in n.message for n in app._notifications)


async def test_json_with_several_live_runs_shows_them_all(tmp_path, capsys):
    runs = [write_demo_run(tmp_path / name, world=2) for name in ("run-a", "run-b")]
    write_entry(registry.registry_dir(), os.getpid(), runs[0])
    write_entry(registry.registry_dir(), os.getppid(), runs[1])
    set_nvml_for_tests(None, "no NVML in this test")
    assert cli.main(["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted(doc["run"]["sources"]) == ["run-a", "run-b"] and len(doc["ranks"]) == 4
