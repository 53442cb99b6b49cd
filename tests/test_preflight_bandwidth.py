"""The collective test for real: 2 gloo ranks on CPU, a rank that never joins, a rank that dies."""

from __future__ import annotations

import time

import psutil
import pytest
from preflight_fixtures import snapshot

from sddoctor.preflight import bandwidth as bw
from sddoctor.preflight.api import bandwidth_findings
from sddoctor.preflight.findings import exit_code

TINY = bw.SweepPlan(
    ops={"all_reduce": [4096, 256 * 1024], "all_gather": [64 * 1024], "broadcast": [64 * 1024]},
    warmup=2,
    max_iters=5,
)


def assert_reaped(result: bw.BandwidthResult) -> None:
    assert len(result.pids) == result.local_ranks
    for pid in result.pids:
        assert not psutil.pid_exists(pid), f"worker {pid} left behind"


def test_parse_sizes_and_bus_factors():
    assert bw.parse_sizes("1M,64M,1G") == [1024**2, 64 * 1024**2, 1024**3]
    assert bw.parse_sizes("4096, 8K,2MiB,1.5M") == [4096, 8192, 2 * 1024**2, int(1.5 * 1024**2)]
    for bad in ("", "1M,,2M", "lots", "2", "100G"):
        with pytest.raises(bw.SizeSpecError):
            bw.parse_sizes(bad)
    assert bw.bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bw.bus_factor("all_gather", 8) == pytest.approx(0.875)
    assert bw.bus_factor("broadcast", 8) == 1.0
    assert bw.bus_factor("all_reduce", 1) == 0.0
    assert bw.algbw_busbw("all_reduce", 10**9, 0.01, 4) == pytest.approx((100.0, 150.0))


def test_gloo_sweep_two_ranks_checks_results_and_busbw_arithmetic(monkeypatch):
    monkeypatch.delenv(bw.FAULT_ENV, raising=False)
    result = bw.run_bandwidth_test(2, TINY, backend="gloo", timeout=90)
    assert result.ok, result
    assert_reaped(result)
    assert [(r.op, r.size) for r in result.rows] == [
        ("all_reduce", 4096),
        ("all_reduce", 256 * 1024),
        ("all_gather", 64 * 1024),
        ("broadcast", 64 * 1024),
    ]
    for r in result.rows:
        assert r.correct and r.wrong_ranks == [] and r.time_us > 0 and 3 <= r.iters <= 5
        algbw = r.size / (r.time_us * 1e-6) / 1e9
        assert r.algbw == pytest.approx(algbw, rel=1e-9)
        factor = {"all_reduce": 1.0, "all_gather": 0.5, "broadcast": 1.0}[r.op]  # 2(n-1)/n, (n-1)/n, 1 at n=2
        assert r.busbw == pytest.approx(algbw * factor, rel=1e-9)
    gather = result.rows[2]
    assert gather.count * 2 * 4 == gather.size  # size counts the gathered output, as nccl-tests does
    assert {i["rank"] for i in result.ranks_info} == {0, 1}
    found = bandwidth_findings(result, snapshot())
    assert [f.id for f in found] == ["nodes.versions", "bw.result"] and exit_code(found) == 0
    table = bw.format_bandwidth(result)
    assert "busbw(GB/s)" in table and table.count(" ok") == 4


def test_rank_that_dies_is_reported_without_waiting_for_the_timeout(monkeypatch):
    monkeypatch.setenv(bw.FAULT_ENV, "exit:1")
    started = time.monotonic()
    result = bw.run_bandwidth_test(2, bw.SweepPlan(ops={"all_reduce": [4096]}), backend="gloo", timeout=60)
    assert time.monotonic() - started < 30
    assert not result.timed_out and list(result.crashed) == [1] and "exit code 3" in result.crashed[1]
    assert_reaped(result)
    assert "bw.crash" in {f.id for f in bandwidth_findings(result, snapshot())}


def test_findings_for_low_busbw_wrong_data_single_rank_and_version_mismatch():
    snap = snapshot()  # 8 x H100 NVSwitch: ~360 GB/s expected
    row = bw.Row("all_reduce", 512 * 1024**2, 128 * 1024**2, 10, 20000.0, 26.8, 47.0, True)
    slow = bw.BandwidthResult("nccl", 8, 8, "cuda", rows=[row])
    (low,) = [f for f in bandwidth_findings(slow, snap) if f.id.startswith("bw.")]
    assert low.id == "bw.low" and low.severity == "warn"
    fast = bw.BandwidthResult(
        "nccl", 8, 8, "cuda", rows=[bw.Row("all_reduce", 512 * 1024**2, 1, 10, 1.0, 250, 437, True)]
    )
    assert [f.id for f in bandwidth_findings(fast, snap)] == ["bw.result"]
    wrong = bw.BandwidthResult(
        "nccl", 8, 8, "cuda", rows=[bw.Row("all_reduce", 1024, 256, 5, 1.0, 1, 1, False, [3])]
    )
    assert "bw.wrong_result" in {f.id for f in bandwidth_findings(wrong, snap)}
    one = bw.BandwidthResult(
        "nccl",
        1,
        1,
        "cuda",
        rows=[bw.Row("all_reduce", 1024, 256, 5, 1.0, 1, 0.0, True)],
        local_copy_gbps=2000.0,
    )
    (single,) = bandwidth_findings(one, snap)
    assert single.id == "bw.single_rank" and "2000" in single.title
    infos = [
        {"rank": 0, "host": "a", "torch": "2.11.0", "nccl": "2.27.5", "cuda": "12.8"},
        {"rank": 1, "host": "b", "torch": "2.11.0", "nccl": "2.21.5", "cuda": "12.8"},
    ]
    mixed = bw.BandwidthResult("nccl", 2, 1, "cuda", ranks_info=infos)
    (mismatch,) = bandwidth_findings(mixed, snap)
    assert mismatch.id == "nodes.version_mismatch" and mismatch.severity == "fail"
