"""The report views' parts on small, hand-made run directories: the timeline file (writer, rotation,
reader), the rank-side recorder, matching collectives across ranks, the health summary, the trace
check, the GPU log (with the fake NVML) and the HTML page's self-containment.

Real multi-rank runs rendered end to end are in test_report_views.py and test_report_browser.py.
"""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import pytest

from sddoctor.gpu.nvml import set_nvml_for_tests
from sddoctor.gpu.source import NvmlSource
from sddoctor.instrument import tracing
from sddoctor.instrument.timeline import TimelineRecorder
from sddoctor.supervise.gpulog import GpuLog, read_gpu_log
from sddoctor.supervise.health import health_summary, percentile, render_health_markdown
from sddoctor.supervise.report import render_markdown, write_report
from sddoctor.supervise.rundata import RunData
from sddoctor.supervise.svgplot import reduce_points
from sddoctor.supervise.timeline import build_timeline, lane_stats, window
from sddoctor.supervise.trace import build_trace, check_trace
from sddoctor.telemetry import RunDir, RunView, TelemetryWriter
from sddoctor.telemetry.environment import comm_env
from sddoctor.telemetry.layout import rotated_path
from sddoctor.telemetry.timeline import TimelineWriter, read_timeline, timeline_file
from sddoctor.testing.fake_nvml import FakeGpu, FakeNvml

T0 = 1_796_000_000.0


def _row(seq: int, t0: float, duration: float, pg: str = "0", op: str = "all_reduce") -> list:
    return [pg, seq, op, t0, duration, "/src/train.py:57", False, None, None]


def test_timeline_file_roundtrip_rotation_and_torn_line(tmp_path):
    rd = RunDir(tmp_path).ensure()
    writer = TimelineWriter(max_bytes=600)
    for i in range(6):  # each line is about 250 bytes: the file rotates along the way
        writer.write(rd, 3, T0 + i, [_row(i + 1, T0 + i, 0.01)])
    path = timeline_file(rd, 3)
    assert rotated_path(path).name == "rank-00003.1.jsonl" and rotated_path(path).exists()
    assert path.stat().st_size <= 600 and rotated_path(path).stat().st_size <= 600
    with open(path, "a") as fh:
        fh.write('{"v": 1, "calls": [["0", 99')  # a rank killed mid-write
    calls, dropped = read_timeline(rd, 3)
    seqs = [c["seq"] for c in calls]
    assert seqs == sorted(seqs) and seqs[-1] == 6 and 99 not in seqs
    assert len(seqs) < 6  # the oldest fell out with the rotation: bounded
    assert calls[-1]["caller"] == "/src/train.py:57" and dropped == 0
    assert RunView.load(rd).ranks == {}  # timeline files are not taken for ranks' event logs


def _rec(seq: int, t0: float, t1: float) -> tracing._Rec:
    rec = tracing._Rec()
    rec.op, rec.key, rec.seq, rec.shapes, rec.dtypes = "all_reduce", "0", seq, [], []
    rec.file, rec.line, rec.t0, rec.t1, rec.handle, rec.deferred, rec.peer = (
        "/x.py",
        3,
        t0,
        None,
        None,
        False,
        None,
    )
    rec.exact_end = False
    return rec


def test_time_in_collectives_counts_overlapping_calls_once():
    tracer = tracing.Tracer(rank=0)
    # three gradient buckets in flight together, then one call on its own
    for seq, (t0, t1) in enumerate([(10.0, 12.0), (10.5, 12.5), (11.0, 11.5), (20.0, 21.0)], start=1):
        tracer._finish(_rec(seq, t0, t1), t1)
    assert tracer.summary()["seconds"] == 3.5  # 10-12.5 and 20-21, not 2 + 2 + 0.5 + 1
    assert tracer.summary()["ops"]["all_reduce"] == {"count": 4, "seconds": 5.5}
    assert tracer.snapshot()["totals"] == {"count": 4, "seconds": 3.5}


def test_tracer_buffers_completed_calls_and_the_recorder_counts_what_did_not_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(tracing, "RECENT_MAX", 4)
    tracer = tracing.Tracer(0)
    writer = SimpleNamespace(run_dir=RunDir(tmp_path).ensure(), rank=0)
    recorder = TimelineRecorder(tracer)
    for i in range(10):  # more than the buffer holds between two flushes
        tracer._finish(_rec(i + 1, T0 + i, 0), T0 + i + 0.5)
    assert tracer.completed() == 10 and len(tracer.recent) == 4
    assert recorder.flush(writer) == 4 and recorder.dropped == 6
    assert tracer.recent == type(tracer.recent)()  # drained
    tracer._finish(_rec(11, T0 + 11, 0), T0 + 11.25)
    assert recorder.flush(writer) == 1 and recorder.dropped == 6
    assert recorder.flush(writer) == 0  # nothing new: no line
    calls, dropped = read_timeline(writer.run_dir, 0)
    assert [c["seq"] for c in calls] == [7, 8, 9, 10, 11] and dropped == 6
    assert calls[-1]["duration"] == 0.25 and calls[-1]["caller"] == "/x.py:3"


def test_recorder_writes_nothing_under_a_provisional_rank(tmp_path):
    tracer = tracing.Tracer(0, session=SimpleNamespace(rank_known=False))
    tracer._finish(_rec(1, T0, 0), T0 + 1)
    writer = SimpleNamespace(run_dir=RunDir(tmp_path).ensure(), rank=0)
    assert TimelineRecorder(tracer).flush(writer) == 0
    assert not timeline_file(writer.run_dir, 0).exists() and len(tracer.recent) == 1  # kept for later


def _calls(rank: int, arrivals: list[float], duration_after_last: float = 0.01) -> list[dict]:
    return [
        {
            "pg": "0",
            "seq": i + 1,
            "op": "all_reduce",
            "t0": t,
            "duration": duration_after_last,
            "caller": "a.py:1",
        }
        for i, t in enumerate(arrivals)
    ]


def test_matching_names_the_last_arrival_and_each_ranks_wait():
    # rank 2 arrives 0.3 s after rank 0 and 0.1 s after rank 1, at each of three collectives
    base = [T0 + i for i in range(3)]
    raw = {
        0: {"events": [{"kind": "start", "t": T0 - 1}], "calls": _calls(0, base)},
        1: {"events": [], "calls": _calls(1, [t + 0.2 for t in base])},
        2: {"events": [], "calls": _calls(2, [t + 0.3 for t in base])},
    }
    straggler = {"kind": "straggler", "severity": "warning", "culprit_rank": 2, "summary": "rank 2 is slow"}
    tl = build_timeline(raw, [straggler])
    assert tl.matched == 3
    assert [c.late_rank for c in tl.lanes[0].calls] == [2, 2, 2]
    assert [round(c.wait, 6) for c in tl.lanes[0].calls] == [0.3] * 3
    assert [round(c.wait, 6) for c in tl.lanes[1].calls] == [0.1] * 3
    assert all(c.last and c.wait == 0 for c in tl.lanes[2].calls)
    assert tl.lanes[2].role == "straggler" and tl.lanes[0].role == ""
    assert lane_stats(tl.lanes[2])["arrived_last"] == 3 and lane_stats(tl.lanes[0])[
        "waited_seconds"
    ] == pytest.approx(0.9)
    # the start-up before the first collective is left out, but for a margin of 5% of the rest
    assert tl.start == T0 - 1 and window(tl) == (pytest.approx(T0 - 0.05 * (tl.end - T0)), tl.end)


def test_collectives_of_a_restarted_process_match_only_their_own_attempt():
    # torchrun --max-restarts: both ranks restart 10 s in and number their collectives from 1 again;
    # seq 1 of the first processes is not seq 1 of the new ones (no 10 s wait between them)
    starts = [{"kind": "start", "t": T0 - 1}, {"kind": "start", "t": T0 + 10}]
    raw = {
        0: {"events": starts, "calls": _calls(0, [T0, T0 + 1]) + _calls(0, [T0 + 11, T0 + 12])},
        1: {"events": starts, "calls": _calls(1, [T0 + 0.1, T0 + 1.1]) + _calls(1, [T0 + 11.2])},
    }
    tl = build_timeline(raw, [])
    assert tl.matched == 3
    assert [c.attempt for c in tl.lanes[0].calls] == [0, 0, 1, 1]
    assert lane_stats(tl.lanes[0])["waited_seconds"] == pytest.approx(0.1 + 0.1 + 0.2)
    assert lane_stats(tl.lanes[1])["waited_seconds"] == pytest.approx(0.0)


def test_a_rank_that_never_arrived_is_marked_and_the_others_wait_to_their_end():
    snapshot = {
        "collectives": {"inflight": [{"pg": "0", "seq": 3, "op": "all_reduce", "since": T0 + 2.0}]},
        "t": T0 + 9,
    }
    raw = {
        0: {"events": [], "calls": _calls(0, [T0, T0 + 1]), "snapshot": snapshot},
        1: {"events": [], "calls": _calls(1, [T0 + 0.01, T0 + 1.01]), "snapshot": {"t": T0 + 9}},
    }
    verdict = {
        "kind": "hang.missing_rank",
        "severity": "error",
        "culprit_rank": 1,
        "details": {"pg": "0", "seq": 3, "op": "all_reduce", "missing_ranks": [1], "stalled_seconds": 5.0},
    }
    tl = build_timeline(raw, [verdict])
    stuck = tl.lanes[0].calls[-1]
    assert (stuck.seq, stuck.t1, stuck.wait) == (3, None, pytest.approx(7.0))
    assert tl.lanes[1].role == "missing" and "never reached all_reduce #3" in tl.lanes[1].note
    (never,) = [m for m in tl.lanes[1].marks if "never reached" in m.label]
    assert never.t == T0 + 2.0 and never.severity == "error"
    assert any(m.label.startswith("hang declared") and m.t == T0 + 7.0 for m in tl.lanes[0].marks)
    trace = build_trace(SimpleNamespace(timeline=tl, gpu_samples=[], report={}, run_dir=RunDir("/x")))
    assert check_trace(trace) == []
    names = {e["name"] for e in trace["traceEvents"]}
    assert "all_reduce #3 (still inside at the end)" in names and "wait for the other ranks" in names
    assert any(e["ph"] == "i" and e["s"] == "g" for e in trace["traceEvents"])
    # --last 3: what reaches into the last 3 s of the record (it ends at T0 + 9): the stuck call
    recent = build_trace(
        SimpleNamespace(timeline=tl, gpu_samples=[], report={}, run_dir=RunDir("/x")), last=3
    )
    assert {e["name"] for e in recent["traceEvents"] if e["ph"] == "X"} == {
        "all_reduce #3 (still inside at the end)",
        "wait for the other ranks",
    }
    assert check_trace(recent) == [] and any(e["ph"] == "M" for e in recent["traceEvents"])


def test_overlapping_async_calls_go_to_separate_trace_tracks():
    calls = [
        {"pg": "0", "seq": 1, "op": "all_reduce", "t0": T0, "duration": 1.0, "async": True},
        {"pg": "0", "seq": 2, "op": "all_reduce", "t0": T0 + 0.1, "duration": 1.0, "async": True},
        {"pg": "0", "seq": 3, "op": "all_reduce", "t0": T0 + 2.0, "duration": 0.1, "async": True},
    ]
    tl = build_timeline({0: {"events": [], "calls": calls}}, [])
    trace = build_trace(SimpleNamespace(timeline=tl, gpu_samples=[], report={}, run_dir=RunDir("/x")))
    assert check_trace(trace) == []
    tids = [e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert tids == [10, 11, 10]


def test_check_trace_finds_what_perfetto_would_reject():
    good = {"ph": "X", "name": "a", "pid": 0, "tid": 1, "ts": 0, "dur": 10, "args": {}}
    assert check_trace({"traceEvents": [good]}) == []
    overlapping = dict(good, name="b", ts=5, dur=10)
    bad = [
        overlapping,
        {"ph": "Q", "name": "x", "pid": 0, "tid": 0, "ts": 0},
        {"ph": "C", "name": "c", "pid": 0, "tid": 0, "ts": 0, "args": {"v": math.nan}},
        {"ph": "i", "s": "x", "name": "i", "pid": 0, "tid": 0, "ts": 0},
        {"ph": "M", "name": "nonsense", "pid": 0, "tid": 0, "args": {}},
        {"ph": "X", "name": "d", "pid": "0", "tid": 1, "ts": 0, "dur": -1},
    ]
    problems = check_trace({"traceEvents": [good, *bad]})
    text = "\n".join(problems)
    for needle in (
        "overlaps the end of 'a'",
        "unknown ph",
        "finite",
        "instant scope",
        "bad metadata",
        "pid is not",
    ):
        assert needle in text, text


def test_percentile_and_point_reduction_keep_the_spike():
    assert percentile([], 50) is None and percentile([3.0], 95) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile(list(range(101)), 95) == 95
    points = [(float(i), 1.0) for i in range(5000)]
    points[3333] = (3333.0, 40.0)
    reduced = reduce_points(points, 200)
    assert len(reduced) <= 200 and (3333.0, 40.0) in reduced


def test_comm_env_keeps_only_communication_settings():
    env = {
        "NCCL_P2P_DISABLE": "1",
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "HOME": "/root",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    assert comm_env(env) == {
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_P2P_DISABLE": "1",
        "TORCH_NCCL_BLOCKING_WAIT": "1",
    }


def _emit(w: TelemetryWriter, t: float, kind: str, **fields) -> None:
    w.emit(kind, **fields)
    w._events[-1]["t"] = t


def _healthy_run(tmp_path) -> RunDir:
    """Two ranks written through the real TelemetryWriter: steps, an OOM fallback, settings, timeline.

    Steps 1-20 end every 0.5 s from T0 + 0.5; rank 1 arrives 0.1 s after rank 0 at each collective.
    """
    rd = RunDir(tmp_path / "run").ensure()
    rd.write_run_info(world_size=2, command=["torchrun", "train.py"])
    for rank in (0, 1):
        w = TelemetryWriter(rd, rank, start_thread=False)
        env = {"NCCL_P2P_DISABLE": "1", "NCCL_DEBUG": "INFO" if rank == 0 else "WARN"}
        _emit(w, T0, "start", pid=100 + rank, host="node0", world_size=2, comm_env=env)
        for step in range(1, 21):
            step_time = 0.5 if step != 20 else 1.5
            end = T0 + step * 0.5
            fields = dict(
                loss=1.0 / step, samples=8, step_time=step_time, mem_peak=(3 + rank) << 30, t_end=end
            )
            _emit(w, end, "step", step=step, images_per_s=32.0, **fields)
        fallback = dict(old_micro_batch=8, new_micro_batch=4, old_grad_accum=1, new_grad_accum=2)
        _emit(
            w,
            T0 + 3.6,
            "fallback",
            step=7,
            reason="oom in backward",
            failed_ranks=[1],
            step_applied=True,
            **fallback,
        )
        _emit(w, T0 + 10.0, "collective", count=20, seconds=2.0 + 3.0 * (1 - rank))
        _emit(w, T0 + 10.0, "exit", status="ok", code=0)
        w.update_state(backend="nccl")
        w.close()
        state = json.loads(rd.state_file(rank).read_text())
        rd.state_file(rank).write_text(json.dumps(dict(state, t=T0 + 10.0)))  # as if written at the end
        arrivals = [T0 + s * 0.5 - 0.2 + (0.1 if rank == 1 else 0.0) for s in range(1, 21)]
        TimelineWriter().write(
            rd, rank, T0 + 11, [_row(i + 1, t, 0.12 - 0.1 * rank) for i, t in enumerate(arrivals)]
        )
    return rd


def test_health_summary_of_a_good_run(tmp_path):
    rd = _healthy_run(tmp_path)
    data = RunData.load(rd, {"verdicts": [], "outcome": "ok"})
    health = health_summary(data.view, data.timeline, data.gpu_samples)
    r0, r1 = health["ranks"]["0"], health["ranks"]["1"]
    assert r0["steps"] == 20 and r0["step_time_p50"] == 0.5 and r0["step_time_p95"] == pytest.approx(0.55)
    assert r0["mem_peak"] == 3 << 30 and r1["mem_peak"] == 4 << 30
    assert r0["collective_seconds"] == 5.0 and r1["collective_seconds"] == 2.0
    assert (r0["collective_share"], r1["collective_share"]) == (
        0.5,
        0.2,
    )  # of 10 s between first and last event
    assert (
        r1["arrived_last"] == 20
        and r0["arrived_last"] == 0
        and r0["waited_seconds"] == pytest.approx(2.0, abs=1e-4)
    )
    assert health["throughput"]["samples"] == 320 and health["throughput"]["images_per_s_median"] == 32.0
    assert health["throughput"]["images_per_s"] == pytest.approx(320 / 10.0)  # steps from T0 to T0 + 10
    assert health["oom"]["events"] == 0 and len(health["oom"]["fallbacks"]) == 1  # one per step, not per rank
    assert health["comm"]["env"] == {"NCCL_P2P_DISABLE": "1"} and health["comm"]["backend"] == "nccl"
    assert health["comm"]["differ"] == {"NCCL_DEBUG": {"0": "INFO", "1": "WARN"}}
    text = "\n".join(render_health_markdown(health))
    assert "## Health" in text and "NCCL_P2P_DISABLE=1" in text and "`NCCL_DEBUG` differs" in text
    assert "| 1 | node0 | 20 | 500.0 ms | 550.0 ms |" in text and "20 of 20" in text
    assert "| 7 | 8 -> 4 | 1 -> 2 | [1] | True | oom in backward |" in text


def test_write_report_adds_health_and_a_self_contained_page(tmp_path):
    rd = _healthy_run(tmp_path)
    report = {"run": rd.run_info(), "outcome": "ok", "exit_code": 0, "verdicts": [], "ranks": {}}
    write_report(rd, report)
    stored = json.loads(rd.report_json.read_text())
    assert stored["health"]["ranks"]["0"]["steps"] == 20
    assert "## Health" in rd.report_md.read_text() and "## Health" in render_markdown(stored)
    page = rd.report_html.read_text()
    assert "sddoctor: ok" in page and 'id="timeline-plot"' in page and 'class="c wait"' in page
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    # nothing to fetch: every src/href is inline (data:) or an anchor
    assert re.findall(r'(?:src|href)="(?!data:|#)[^"]*"', page) == []
    assert 'id="loss"' in page and 'id="step-time"' in page and 'id="memory"' in page


def test_a_broken_run_dir_keeps_report_json(tmp_path, monkeypatch):
    rd = RunDir(tmp_path).ensure()
    import sddoctor.supervise.rundata as rundata

    def boom(*_a, **_k):
        raise RuntimeError("unreadable")

    monkeypatch.setattr(rundata.RunData, "load", classmethod(lambda cls, *a, **k: boom()))
    write_report(rd, {"outcome": "ok", "verdicts": []})
    assert json.loads(rd.report_json.read_text())["health"] == {"error": "RuntimeError: unreadable"}
    assert rd.report_md.exists() and not rd.report_html.exists()


@pytest.fixture
def _fake_nvml():
    set_nvml_for_tests(
        FakeNvml(
            [
                FakeGpu(util_series=[10, 90, 95], memory_used=20 << 30, processes=[(4711, 1 << 30)]),
                FakeGpu(util_series=[0]),
            ]
        )
    )
    yield
    set_nvml_for_tests(None, None)


def test_gpu_log_samples_into_the_run_dir_and_shows_in_the_report(tmp_path, _fake_nvml):
    rd = _healthy_run(tmp_path)
    log = GpuLog(rd, interval=0.01, source_factory=lambda: NvmlSource(pcie_interval=0)).start()
    deadline = 200
    while log.samples < 3 and deadline:
        deadline -= 1
        log._stop.wait(0.05)
    log.stop()
    samples = read_gpu_log(rd)
    assert len(samples) >= 3 and [g["index"] for g in samples[0]["gpus"]] == [0, 1]
    assert samples[0]["gpus"][0]["pids"] == [4711] and samples[0]["gpus"][0]["mem_used"] == 20 << 30
    data = RunData.load(rd, {"verdicts": []})
    gpus = health_summary(data.view, data.timeline, data.gpu_samples)["gpus"]
    first = next(iter(gpus.values()))
    assert first["util_max"] == 95.0 and first["mem_peak"] == 20 << 30 and first["name"] == "NVIDIA H200"
    write_report(rd, {"outcome": "ok", "verdicts": []})
    page = rd.report_html.read_text()
    assert 'id="gpu-util"' in page and 'id="gpu-memory"' in page


def test_gpu_log_without_nvml_writes_nothing(tmp_path):
    set_nvml_for_tests(None, "no NVIDIA driver here")
    try:
        log = GpuLog(RunDir(tmp_path)).start()
        log.stop()
    finally:
        set_nvml_for_tests(None, None)
    assert read_gpu_log(RunDir(tmp_path)) == [] and "no NVIDIA driver" in (log.note or "")


def test_bounded_reading_keeps_every_rare_event_and_only_the_last_steps(tmp_path):
    rd = RunDir(tmp_path).ensure()
    w = TelemetryWriter(rd, 0, start_thread=False)
    w.emit("start", pid=1)
    for step in range(1, 2001):
        w.emit("step", step=step, loss=1.0)
        if step == 10:
            w.emit("fallback", step=10, new_micro_batch=2)
    w.close()
    with open(rd.events_file(0), "a") as fh:
        fh.write('{"kind": "step", "st')  # torn
    view = RunView.load(rd, step_bytes=20_000)
    events = view.ranks[0].events
    steps = [e["step"] for e in events if e["kind"] == "step"]
    assert [e["kind"] for e in events[:2]] == ["start", "fallback"]
    assert steps == list(range(steps[0], 2001)) and 200 < len(steps) < 600
    assert len(RunView.load(rd).ranks[0].of_kind("step")) == 2000
