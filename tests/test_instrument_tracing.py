"""Collective tracing in real gloo ranks started with the bootstrap on PYTHONPATH."""

from __future__ import annotations

from pathlib import Path

from instrument_fixtures import events, line_of, reap, records, start_ranks, state


def test_trace_records_seq_op_shapes_and_caller(tmp_path: Path) -> None:
    procs = start_ranks(tmp_path, 2, "trace")
    try:
        for p in procs:
            p.wait(timeout=90)
    finally:
        outs = reap(procs)
    assert [p.returncode for p in procs] == [0, 1], outs
    recs = [records(out) for out in outs]
    for rank in (0, 1):
        r = recs[rank]
        ar = r["all_reduce"]["rec"]
        # `from torch.distributed import all_reduce` ran after the bootstrap patched the module
        assert (ar["pg"], ar["seq"], ar["op"]) == ("0", 1, "all_reduce")
        assert ar["shapes"] == [[4, 3]] and ar["dtypes"] == ["float32"]
        assert ar["caller"] == line_of("trace-all-reduce")
        assert ar["async"] is False and ar["duration"] >= 0
        bc = r["broadcast"]["rec"]
        assert (bc["seq"], bc["op"], bc["dtypes"], bc["caller"]) == (
            2,
            "broadcast",
            ["int64"],
            line_of("trace-broadcast"),
        )
        # all_gather_object issues all_gather twice inside: counted once
        obj = r["all_gather_object"]
        assert (obj["rec"]["seq"], obj["rec"]["op"]) == (3, "all_gather_object")
        assert obj["rec"]["caller"] == line_of("trace-object")
        assert obj["issued"]["0"] == 3
        # async work: completed by the heartbeat's poll, not by blocking
        asy = r["async"]["rec"]
        assert (asy["seq"], asy["op"], asy["async"], asy["shapes"]) == (4, "all_reduce", True, [[5]])
        # p2p has its own numbering, so the group's collective numbering stays equal on all ranks
        p2p = r["p2p"]
        assert p2p["rec"]["pg"] == "0:p2p" and p2p["rec"]["seq"] == 1
        assert p2p["rec"]["op"] == ("send" if rank == 0 else "recv")
        assert p2p["rec"]["peer"] == (1 if rank == 0 else 0)
        assert p2p["rec"]["caller"] == line_of("trace-send" if rank == 0 else "trace-recv")
        assert p2p["issued"] == {"0": 4, "0:p2p": 1}
        batch = r["batch"]["rec"]  # P2POp built with the traced isend/irecv still works
        assert (batch["pg"], batch["seq"], batch["op"], batch["async"]) == (
            "0:p2p",
            2,
            "batch_isend_irecv",
            True,
        )
        assert batch["shapes"] == [[2], [2]] and batch["caller"] == line_of("trace-batch")
        sub = r["subgroup"]["rec"]
        assert sub["pg"] != "0" and sub["seq"] == 1 and sub["caller"] == line_of("trace-subgroup")
        bar = r["barrier"]
        assert (bar["rec"]["op"], bar["rec"]["seq"]) == ("barrier", 5)
        assert bar["main"] is None  # the main thread's call is the last one: not written twice
        # a helper thread's call completes last: the main thread's own last call is kept beside it
        thread = r["thread"]
        assert (thread["rec"]["caller"], thread["rec"]["off_main"]) == (line_of("trace-thread"), True)
        assert (thread["main"]["op"], thread["main"]["caller"]) == ("barrier", line_of("trace-barrier"))
        # the state snapshot and the summary event reached the run directory
        snap = state(tmp_path, rank)
        assert snap["status"] == "exited" and snap["backend"] == "gloo"
        assert snap["collectives"]["issued"]["0"] == 5 and snap["collectives"]["inflight"] == []
        assert isinstance(snap["heartbeat"], float)
        summary = events(tmp_path, rank, "collective")[-1]
        assert summary["ops"]["all_reduce"]["count"] == 4 and summary["count"] == 9
        assert [e["kind"] for e in events(tmp_path, rank)][-1] == "exit"
    # rank 1 ends with an uncaught exception: recorded with its caller, flushed before it died
    assert events(tmp_path, 0, "exit")[-1]["status"] == "ok" and not events(tmp_path, 0, "exception")
    (exc,) = events(tmp_path, 1, "exception")
    assert exc["type"] == "ValueError" and exc["message"] == "bad batch on rank 1"
    assert exc["caller"] == line_of("crash-raise")
    assert exc["traceback"][-1].startswith(line_of("crash-raise"))
    assert events(tmp_path, 1, "exit")[-1]["status"] == "error"
