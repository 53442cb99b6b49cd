"""Rank states from telemetry, process-to-rank matching, stack dumps, and the HTTP feed
against a local http.server serving a recorded /api/state payload."""

from __future__ import annotations

import json

import pytest
from tui_fixtures import serve_state

from conftest import free_port
from sddoctor.gpu.samples import GpuSample, ProcessSample
from sddoctor.ranks.feeds import HttpFeed, MultiFeed, latest_stack_dump
from sddoctor.ranks.matching import match_processes
from sddoctor.ranks.status import RankInputs, RankStatus, RateTracker, derive, parse_device

NOW = 1_000_000.0


def _state(**extra):
    base = {
        "rank": 0,
        "pid": 100,
        "host": "h",
        "local_rank": 0,
        "world_size": 2,
        "heartbeat": NOW - 1,
        "step": 7,
        "last_step": {"step": 7, "loss": 0.5, "step_time": 0.5, "samples": 8, "t": NOW - 1},
    }
    base.update(extra)
    return base


def _coll(since):
    return {
        "inflight": [{"pg": "default", "seq": 42, "op": "all_reduce", "caller": "train.py:9", "since": since}]
    }


CASES = [
    # (name, inputs kwargs, verdicts, expected state, words in the text)
    ("training", {"state": _state(phase="forward")}, [], "training", "step 7, forward"),
    ("starting", {"state": {"rank": 0, "heartbeat": NOW}}, [], "starting", "no step"),
    (
        "short collective is training",
        {"state": _state(collectives=_coll(NOW - 0.2))},
        [],
        "training",
        "step 7",
    ),
    (
        "in collective",
        {"state": _state(collectives=_coll(NOW - 12))},
        [],
        "collective",
        "in all_reduce #42 for 12 s",
    ),
    ("stuck collective", {"state": _state(collectives=_coll(NOW - 500))}, [], "hung", "for 500 s"),
    ("silent", {"state": _state(heartbeat=NOW - 45)}, [], "silent", "no heartbeat for 45 s"),
    (
        "exited",
        {"state": _state(status="exited"), "exit": {"status": "ok", "code": 0}},
        [],
        "exited",
        "normally",
    ),
    (
        "crash exc",
        {
            "state": _state(),
            "exit": {"status": "error", "code": 1},
            "exception": {"type": "ValueError", "message": "bad"},
        },
        [],
        "crashed",
        "ValueError: bad",
    ),
    ("signal", {"state": _state(), "exit": {"status": "signal", "code": 9}}, [], "crashed", "signal 9"),
    ("gone", {"state": _state(), "pid_alive": False}, [], "crashed", "gone without an exit record"),
    (
        "hang verdict",
        {"state": _state()},
        [{"kind": "hang.missing_rank", "culprit_rank": 0, "summary": "rank 0 x"}],
        "hung",
        "rank 0 x",
    ),
    (
        "verdict for another rank",
        {"state": _state()},
        [{"kind": "hang.comm", "culprit_rank": 1}],
        "training",
        "",
    ),
    (
        "fallback",
        {
            "state": _state(),
            "fallback": {
                "t": NOW - 5,
                "step": 6,
                "old_micro_batch": 8,
                "new_micro_batch": 4,
                "old_grad_accum": 1,
                "new_grad_accum": 2,
            },
        },
        [],
        "oom-fallback",
        "micro-batch 8->4",
    ),
    ("old fallback", {"state": _state(), "fallback": {"t": NOW - 500, "step": 6}}, [], "training", "step 7"),
]


@pytest.mark.parametrize("name,kwargs,verdicts,state,words", CASES, ids=[c[0] for c in CASES])
def test_derive_state(name, kwargs, verdicts, state, words):
    status = derive(RankInputs(rank=0, node="n", **kwargs), RateTracker(), verdicts, NOW)
    assert status.state == state
    assert words in status.state_text


def test_fields_and_rates():
    rates = RateTracker()
    for k in range(6):  # 2 steps per second, 8 samples a step
        rates.add(NOW - 3 + 0.5 * k, 10 + k, 8)
    st = _state(
        device="cuda:1",
        collectives={"last_done": {"op": "broadcast", "seq": 3, "duration": 0.002, "caller": "x.py:1"}},
    )
    s = derive(RankInputs(rank=0, node="n", state=st), rates, [], NOW)
    assert (s.pid, s.host, s.device, s.world_size, s.loss) == (100, "h", 1, 2, 0.5)
    assert s.it_s == pytest.approx(2.0) and s.images_s == pytest.approx(16.0)
    assert s.last_collective == "broadcast #3 2.0 ms" and s.call_site == "x.py:1"
    # one observation only: the rank's own step_time
    s = derive(RankInputs(rank=0, node="n", state=_state()), RateTracker(), [], NOW)
    assert s.it_s == pytest.approx(2.0) and s.images_s == pytest.approx(16.0)
    assert s.device == 0  # no device reported: its local rank


def test_cuda_visible_devices_maps_the_rank_to_its_physical_gpu():
    def dev(**extra):
        s = derive(RankInputs(rank=0, node="n", state=_state(**extra)), RateTracker(), [], NOW)
        return s.device, s.device_uuid

    assert dev(device="cuda:1", cuda_visible_devices="4,5,6") == (5, None)
    assert dev(local_rank=0, cuda_visible_devices="GPU-abc,GPU-def") == (0, "GPU-abc")
    assert dev(device="cuda:3", cuda_visible_devices="4,5") == (3, None)  # out of range: left as reported


def test_parse_device():
    assert [parse_device(v) for v in (3, "3", "cuda:3", "cpu", None, True)] == [3, 3, 3, None, None, None]


def _gpu(index, *procs):
    return GpuSample(
        index=index,
        name="g",
        uuid=f"GPU-{index}",
        pci_bus_id="b",
        processes=[ProcessSample(pid, index, mem) for pid, mem in procs],
    )


def _rank(rank, pid, device, host="h", **kw):
    return RankStatus(rank=rank, node="n", pid=pid, device=device, host=host, state="training", **kw)


def test_match_by_pid_and_flag_wrong_gpu():
    gpus = [_gpu(0, (100, 10), (101, 1 << 29)), _gpu(1, (101, 10), (999, 5))]
    r0, r1 = _rank(0, 100, 0), _rank(1, 101, 1)
    m = match_processes(gpus, [r0, r1], "h")
    assert m.of(0, 100).rank is r0 and m.of(0, 100).how == "pid"
    assert m.of(1, 101).rank is r1 and m.of(0, 101).rank is r1
    assert m.of(1, 999) is None  # shown plainly as unmatched
    assert [(r.rank, g.index) for r, g, _ in m.wrong_gpu] == [(1, 0)]
    assert m.flags(0, 101) == ["rank 1 belongs on GPU 1"] and m.flags(1, 101) == []


def test_container_pids_match_by_device():
    # NVML sees host PIDs 5001/5002; ranks report container PIDs 7 and 8 and a container hostname.
    gpus = [_gpu(0, (5001, 10)), _gpu(1, (5002, 10), (5003, 10)), _gpu(2, (5004, 10))]
    ranks = [
        _rank(0, 7, 0, host="ctr"),
        _rank(1, 8, 1, host="ctr"),
        _rank(2, 9, 2, host="ctr", device_uuid="GPU-2"),
    ]
    m = match_processes(gpus, ranks, "bare-metal")
    assert m.of(0, 5001).rank.rank == 0 and m.of(0, 5001).how == "device"
    assert m.of(1, 5002) is None and m.of(1, 5003) is None  # two candidates: ambiguous, nothing claimed
    assert m.of(2, 5004).rank.rank == 2  # by its device UUID
    assert m.wrong_gpu == []


def test_remote_and_finished_ranks_claim_nothing():
    gpus = [_gpu(0, (5001, 10))]
    remote = _rank(0, 7, 0, host="other")
    local = _rank(1, 8, 0, host="h")
    assert match_processes(gpus, [remote, local], "h").of(0, 5001).rank is local
    done = _rank(0, 5001, 0)
    done.state = "exited"
    assert match_processes(gpus, [done], "h").of(0, 5001) is None


def test_latest_stack_dump_formats(tmp_path):
    stacks = tmp_path / "stacks"
    stacks.mkdir()
    assert latest_stack_dump(tmp_path, 0) is None
    (stacks / "rank-00001.txt").write_text("Thread 1\n    f (a.py:3)\n")
    assert "f (a.py:3)" in latest_stack_dump(tmp_path, 1)
    pyspy = [
        {
            "thread_id": 5,
            "thread_name": "MainThread",
            "active": True,
            "frames": [{"name": "wait", "filename": "dist.py", "line": 77}],
        }
    ]
    (stacks / "dump-2.json").write_text(json.dumps({"ranks": {"0": pyspy}}))
    text = latest_stack_dump(tmp_path, 0)
    assert "MainThread (active)" in text and "wait (dist.py:77)" in text
    assert latest_stack_dump(tmp_path, 3) is None


PAYLOAD = {
    "v": 1,
    "run": {"command": ["torchrun", "train.py"], "world_size": 4},
    "node": {"host": "node1", "node_rank": 1},
    "ranks": {
        "2": {
            "v": 1,
            "t": 1.0,
            "rank": 2,
            "pid": 300,
            "host": "node1",
            "local_rank": 0,
            "world_size": 4,
            "step": 50,
            "last_step": {"step": 50, "loss": 0.25, "step_time": 0.25, "samples": 4, "t": 1.0},
            "collectives": {"inflight": [{"seq": 9, "op": "all_gather", "since": 0.0, "caller": "t.py:5"}]},
        },
        "3": {
            "v": 1,
            "t": 1.0,
            "rank": 3,
            "pid": 301,
            "host": "node1",
            "local_rank": 1,
            "world_size": 4,
            "status": "exited",
            "exit": {"status": "signal", "code": 9},
        },
    },
    "verdicts": [
        {
            "kind": "crash",
            "severity": "error",
            "culprit_rank": 3,
            "location": None,
            "summary": "rank 3 was killed by signal 9",
            "details": {},
            "evidence": [],
        }
    ],
}


@pytest.fixture
def endpoint():
    with serve_state(PAYLOAD) as ep:
        yield ep


def test_http_feed_reads_ranks_and_verdicts(endpoint):
    report = HttpFeed(endpoint, clock=lambda: 30.0).poll()
    assert report.errors == [] and report.sources == [endpoint]
    r2, r3 = report.ranks
    assert (r2.rank, r2.node, r2.pid, r2.step, r2.loss, r2.it_s) == (2, endpoint, 300, 50, 0.25, 4.0)
    assert r2.state == "collective" and r2.state_text == "in all_gather #9 for 30 s"
    assert r3.state == "crashed" and "signal 9" in r3.state_text
    assert report.verdicts[0]["source"] == endpoint and report.verdicts[0]["culprit_rank"] == 3


def test_unreachable_endpoint_is_an_error_line_and_others_still_show(endpoint):
    dead = f"127.0.0.1:{free_port()}"
    report = MultiFeed([HttpFeed(dead, timeout=1.0), HttpFeed(endpoint)]).poll()
    assert len(report.errors) == 1 and dead in report.errors[0]
    assert [r.rank for r in report.ranks] == [2, 3]


def test_a_rank_that_issues_collectives_without_steps_is_running_never_starting():
    """An unchanged program without DDP reports no step; its collectives say it is at work."""
    rates = RateTracker()
    for k in range(5):  # one snapshot a second, 40 collectives a second
        state = {"t": NOW - 4 + k, "heartbeat": NOW - 4 + k, "collectives": {
            "issued": {"0": 40 * (k + 1)}, "totals": {"count": 40 * (k + 1)},
            "last_done": {"op": "all_reduce", "seq": 40 * (k + 1), "duration": 0.002}}}  # fmt: skip
        status = derive(RankInputs(rank=0, node="n", state=state), rates, [], NOW - 4 + k)
    assert status.state == "running"
    assert "all_reduce #200" in status.state_text and "40.0 collectives/s" in status.state_text


def test_a_rank_with_neither_step_nor_collective_after_the_allowance_is_stuck_at_start():
    inputs = RankInputs(rank=1, node="n", state={"t": NOW, "heartbeat": NOW, "waiting": {"what": "init_process_group"}},
                        start={"t": NOW - 30})  # fmt: skip
    assert derive(inputs, RateTracker(), [], NOW, startup_allowance=60).state == "starting"
    stuck = derive(inputs, RateTracker(), [], NOW, startup_allowance=20)
    assert stuck.state == "stuck" and "waiting in init_process_group" in stuck.state_text
    # no start event of its own: the run's start counts
    bare = RankInputs(rank=1, node="n", state={"t": NOW, "heartbeat": NOW})
    assert derive(bare, RateTracker(), [], NOW, startup_allowance=20, run_started=NOW - 30).state == "stuck"


def test_the_call_site_is_the_call_in_flight_else_where_the_main_thread_is() -> None:
    done = {"op": "all_reduce", "seq": 4, "caller": "t.py:42"}
    at = {"at": "t.py:40", "function": "main"}
    st = _state(collectives={"last_done": done}, main_at=at)
    assert derive(RankInputs(rank=0, node="n", state=st), RateTracker(), [], NOW).call_site == "t.py:40"
    inflight = [{"pg": "0", "op": "all_reduce", "seq": 5, "caller": "t.py:42", "since": NOW - 1}]
    st = _state(collectives={"last_done": done, "inflight": inflight}, main_at=at)
    assert derive(RankInputs(rank=0, node="n", state=st), RateTracker(), [], NOW).call_site == "t.py:42"
    st = _state(collectives={"last_done": done})  # an older rank: no main_at
    assert derive(RankInputs(rank=0, node="n", state=st), RateTracker(), [], NOW).call_site == "t.py:42"
