"""Alerts and the --json document built from a snapshot and a rank report."""

from __future__ import annotations

import json

from sddoctor.gpu.samples import GpuSample, GpuSnapshot, HostSample, ProcessSample
from sddoctor.ranks.feeds import RankReport
from sddoctor.ranks.overview import Overview
from sddoctor.ranks.status import RankStatus

HOST = HostSample("h", 10.0, 8, 1 << 30, 4 << 30, (0.1, 0.2, 0.3))


def _gpu(index, mask=0, ecc_u=0, procs=()):
    return GpuSample(
        index=index,
        name="g",
        uuid=f"GPU-{index}",
        pci_bus_id="b",
        clock_event_mask=mask,
        clock_event_reasons=["x"] if mask else [],
        ecc_corrected=0,
        ecc_uncorrected=ecc_u,
        processes=[ProcessSample(pid, index, mem) for pid, mem in procs],
    )


def _kinds(ov):
    return [(a.severity, a.kind) for a in ov.alerts]


def test_gpu_alerts_by_severity():
    snap = GpuSnapshot(
        0.0, HOST, [_gpu(0, mask=0x4), _gpu(1, mask=0x40), _gpu(2, ecc_u=3), _gpu(3, mask=0x1)], True
    )
    assert _kinds(Overview.build(snap)) == [
        ("error", "gpu.ecc"),
        ("warning", "gpu.clocks"),
        ("info", "gpu.clocks"),
    ]


def test_verdicts_come_first_and_are_not_repeated_by_rank_states():
    ranks = [
        RankStatus(rank=0, node="n", state="hung", state_text="in all_reduce #5 for 300 s"),
        RankStatus(rank=1, node="n", state="crashed", state_text="killed by signal 9"),
        RankStatus(rank=2, node="n", state="silent", state_text="no heartbeat for 40 s"),
    ]
    verdict = {
        "kind": "hang.mismatch",
        "severity": "error",
        "culprit_rank": 0,
        "summary": "ranks disagree",
        "location": "t.py:3",
        "source": "n",
    }
    ov = Overview.build(GpuSnapshot(0.0, HOST, [], False, "no driver"), RankReport(["n"], ranks, [verdict]))
    assert _kinds(ov) == [
        ("error", "hang.mismatch"),
        ("error", "rank.crashed"),
        ("warning", "rank.silent"),
        ("info", "gpu.none"),
    ]
    assert ov.alerts[0].location == "t.py:3" and ov.alerts[0].culprit_rank == 0


def test_json_document_is_plain_json_with_rank_links():
    rank = RankStatus(
        rank=3, node="n", pid=77, host="h", device=1, local_rank=1, world_size=4, state="training"
    )
    snap = GpuSnapshot(
        5.0,
        HOST,
        [_gpu(0, procs=[(77, 1 << 20)]), _gpu(1, procs=[(77, 2 << 20)])],
        True,
        driver_version="570",
    )
    doc = json.loads(json.dumps(Overview.build(snap, RankReport(["n"], [rank])).to_dict()))
    assert doc["v"] == 1 and doc["host"]["load_average"] == [0.1, 0.2, 0.3]
    p0, p1 = doc["gpus"][0]["processes"][0], doc["gpus"][1]["processes"][0]
    assert p0["rank"]["rank"] == 3 and p0["flags"] == ["rank 3 belongs on GPU 1"] and p1["flags"] == []
    assert [a["kind"] for a in doc["alerts"]] == ["rank.wrong_gpu"]
