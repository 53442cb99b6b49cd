"""A real run directory written by a 2-rank gloo job through sddoctor.instrument.api: the rank
feed, process-to-rank matching by real PIDs (GPUs faked at the NVML edge), the app, and --json."""

from __future__ import annotations

import json
import socket
import time

import pytest
from tui_fixtures import GlooRun

from sddoctor.gpu.collector import Collector
from sddoctor.gpu.host import PsutilHost
from sddoctor.gpu.nvml import set_nvml_for_tests
from sddoctor.gpu.source import NvmlSource
from sddoctor.ranks.feeds import RunDirFeed
from sddoctor.ranks.overview import Overview
from sddoctor.testing.fake_nvml import FakeNvml, demo_gpus
from sddoctor.tui import cli
from sddoctor.tui.app import MonitorApp

STEPS = 5


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    run = GlooRun(tmp_path_factory.mktemp("runs") / "run-gloo", steps=STEPS)
    yield run
    run.stop()


@pytest.fixture(autouse=True)
def _fake_gpus(gloo_run):
    r0, r1 = gloo_run.pids
    # each rank on its own GPU; rank 1 also left a context on GPU 0; one stranger on GPU 1
    set_nvml_for_tests(
        FakeNvml(demo_gpus(2, [[(r0, 3 << 30), (r1, 500 << 20)], [(r1, 3 << 30), (424242, 1 << 20)]]))
    )
    yield
    set_nvml_for_tests(None, None)


def test_feed_and_matching_on_a_real_run(gloo_run):
    report = RunDirFeed(gloo_run.run_dir).poll()
    assert report.errors == [] and [r.rank for r in report.ranks] == [0, 1]
    for r, pid in zip(report.ranks, gloo_run.pids, strict=True):
        assert (r.pid, r.host, r.world_size, r.device) == (pid, socket.gethostname(), 2, r.rank)
        assert r.step == STEPS - 1 and r.loss == pytest.approx(1.0 / STEPS)
        assert r.state == "training" and r.it_s and r.it_s > 0 and r.images_s == pytest.approx(4 * r.it_s)
    ov = Overview.build(Collector(NvmlSource(pcie_interval=0), PsutilHost()).sample(), report)
    r0, r1 = gloo_run.pids
    assert ov.matching.of(0, r0).rank.rank == 0 and ov.matching.of(1, r1).rank.rank == 1
    assert ov.matching.of(0, r1).how == "pid" and ov.matching.of(1, 424242) is None
    assert [a.kind for a in ov.alerts if a.kind == "rank.wrong_gpu"] == ["rank.wrong_gpu"]
    proc = ov.snapshot.gpus[0].processes[0]
    assert proc.pid == r0 and "-c" in (proc.command or "") and proc.rss and proc.user


def test_json_once_on_a_real_run(gloo_run, capsys):
    assert cli.main(["--json", "--run-dir", str(gloo_run.run_dir)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["v"] == 1 and doc["nvml"]["available"] and len(doc["gpus"]) == 2
    assert doc["run"]["sources"] == ["run-gloo"]
    g0 = doc["gpus"][0]
    assert {"utilization_gpu", "memory_used", "power_draw", "clock_event_reasons", "pcie_rx"} <= set(g0)
    by_pid = {p["pid"]: p for p in g0["processes"]}
    r0, r1 = gloo_run.pids
    assert by_pid[r0]["rank"] == {
        "rank": 0,
        "local_rank": 0,
        "world_size": 2,
        "node": "run-gloo",
        "matched_by": "pid",
    }
    assert by_pid[r1]["flags"] == ["rank 1 belongs on GPU 1"]
    assert [(r["rank"], r["state"], r["step"]) for r in doc["ranks"]] == [
        (0, "training", 4),
        (1, "training", 4),
    ]


def test_text_once_on_a_real_run(gloo_run, capsys):
    assert cli.main(["--once", "--run-dir", str(gloo_run.run_dir)]) == 0
    out = capsys.readouterr().out
    assert "rank 0/2 (l0)" in out and "no rank" in out and "!! rank 1 belongs on GPU 1" in out
    assert "WARNING rank 1" in out


@pytest.mark.asyncio
async def test_app_on_a_real_run_then_the_ranks_exit(gloo_run):
    app = MonitorApp(
        Collector(NvmlSource(pcie_interval=0), PsutilHost()),
        RunDirFeed(gloo_run.run_dir),
        interval=0.1,
        rank_interval=0.1,
    )
    async with app.run_test(size=(160, 50)) as pilot:
        while not app.ready:
            await pilot.pause(0.02)
        ranks = app.query_one("#ranks")
        state = ranks.column_index("State")
        assert [str(ranks.get_row_at(i)[state]) for i in range(2)] == ["training", "training"]
        procs = app.query_one("#procs")
        assert sorted(str(procs.get_row_at(i)[2]) for i in range(procs.row_count)) == [
            "-",
            "0/2 l0",
            "1/2 l1",
            "1/2 l1 !!",  # its process on GPU 0 as well: the wrong-GPU mark
        ]
        gloo_run.stop()  # the ranks finish: exit events, status "exited"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            await pilot.pause(0.1)
            if all(str(ranks.get_row_at(i)[state]) == "exited" for i in range(ranks.row_count)):
                break
        assert [str(ranks.get_row_at(i)[state]) for i in range(2)] == ["exited", "exited"]
