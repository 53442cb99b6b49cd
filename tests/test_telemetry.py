import json
import threading

from sddoctor.telemetry import (
    EventTail,
    RunDir,
    RunView,
    TelemetryWriter,
    find_latest_run,
    new_run_dir,
    read_events,
)


def test_writer_events_and_state_roundtrip(tmp_path):
    rd = new_run_dir(tmp_path, prefix="t")
    rd.write_run_info(world_size=2, command=["x"])
    w = TelemetryWriter(rd, rank=1, flush_interval=0.05)
    w.add_state_provider(lambda: {"inflight": [{"seq": 3, "op": "all_reduce"}]})
    w.emit("start", pid=1, world_size=2)
    w.emit("step", step=0, loss=1.5)
    w.update_state(step=0)
    w.close()
    view = RunView.load(rd)
    assert list(view.ranks) == [1]
    assert [e["kind"] for e in view.ranks[1].events] == ["start", "step"]
    assert view.ranks[1].state["inflight"][0]["seq"] == 3
    assert view.ranks[1].state["step"] == 0
    assert view.world_size == 2


def test_reader_tolerates_torn_and_garbage_lines(tmp_path):
    rd = RunDir(tmp_path).ensure()
    path = rd.events_file(0)
    path.write_text('{"kind": "start", "rank": 0}\nnot json\n{"kind": "step", "st')
    assert [e["kind"] for e in read_events(path)] == ["start"]
    view = RunView.load(rd)
    assert view.ranks[0].state is None  # missing state file is fine
    assert RunView.load(tmp_path / "missing").ranks == {}


def test_event_tail_returns_only_new_complete_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    tail = EventTail(path)
    assert tail.poll() == []
    with open(path, "w") as fh:
        fh.write(json.dumps({"kind": "a"}) + "\n" + '{"kind": "b"')
    assert [e["kind"] for e in tail.poll()] == ["a"]
    with open(path, "a") as fh:
        fh.write("}\n")
    assert [e["kind"] for e in tail.poll()] == ["b"]
    assert tail.poll() == []


def test_emit_from_many_threads_loses_nothing(tmp_path):
    w = TelemetryWriter(tmp_path, rank=0, flush_interval=0.01)

    def work(i):
        for j in range(500):
            w.emit("step", step=j, thread=i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.close()
    assert len(read_events(RunDir(tmp_path).events_file(0))) == 2000


def test_find_latest_run(tmp_path):
    assert find_latest_run(tmp_path) is None
    a = new_run_dir(tmp_path, prefix="a")
    b = new_run_dir(tmp_path, prefix="b")
    (b.ranks_dir / "rank-00000.jsonl").write_text("")
    assert find_latest_run(tmp_path, tmp_path / "nope").path in (a.path, b.path)
