"""Silent collective mismatches: what a rank records of each call's arguments (real gloo calls),
and how the ranks' records are compared. The end-to-end runs are in tests/test_user_bugs.py."""

from __future__ import annotations

import inspect
import os

import torch
import torch.distributed as dist

from conftest import spawn_collecting
from sddoctor.instrument import tracing
from sddoctor.instrument.timeline import payload_signature
from sddoctor.supervise.payloads import diagnose_payload_mismatch, find_mismatches, signatures
from sddoctor.supervise.state import RunState


def test_reduce_op_positions_are_torchs() -> None:
    for name, position in tracing.REDUCE_OP_POSITION.items():
        fn = getattr(dist, name)
        assert list(inspect.signature(fn).parameters)[position] == "op", name


def test_root_positions_match_torchs_signatures() -> None:
    rooted = [spec for spec in tracing._SPECS if spec.root is not None]
    assert {spec.name for spec in rooted} >= {"broadcast", "reduce", "gather", "scatter"}
    for spec in rooted:
        name, position = spec.root
        assert list(inspect.signature(getattr(dist, spec.name)).parameters)[position] == name, spec.name


def _record_calls(_index: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    tracer = tracing.install(0)
    try:
        t = torch.ones(4, 3)
        dist.all_reduce(t)
        dist.all_reduce(t, dist.ReduceOp.MAX)
        dist.all_reduce(t.to(torch.int32), op=dist.ReduceOp.MIN)
        dist.all_reduce(
            t, op=dist.ReduceOp(dist.ReduceOp.AVG) if hasattr(dist.ReduceOp, "AVG") else dist.ReduceOp.SUM
        )
        dist.broadcast(torch.zeros(6, dtype=torch.float64), src=0)
        dist.broadcast(torch.zeros(2), 0)
        dist.gather(torch.zeros(2), [torch.zeros(2)], dst=0)
        dist.broadcast_object_list([1], src=0)
        dist.all_gather([torch.zeros(2)], torch.ones(2))
        dist.all_gather_into_tensor(torch.zeros(5), torch.ones(5))
        dist.reduce_scatter_tensor(torch.zeros(3), torch.ones(3), op=dist.ReduceOp.MAX)
        dist.all_to_all_single(torch.zeros(2), torch.ones(2))
        dist.barrier()
        dist.all_gather_object([None], {"a": 1})
        out["rows"] = [(rec.op, payload_signature(rec)) for rec in tracer.take_recent()]
    finally:
        tracing.uninstall()
        dist.destroy_process_group()


def test_each_call_records_what_every_rank_must_pass_alike() -> None:
    rows = spawn_collecting(_record_calls, 1)["rows"]
    assert rows == [
        ("all_reduce", "float32[12] SUM"),  # op left out: torch's default
        ("all_reduce", "float32[12] MAX"),  # op passed by position
        ("all_reduce", "int32[12] MIN"),
        ("all_reduce", "float32[12] AVG"),  # a ReduceOp instance
        ("broadcast", "float64[6] root 0"),
        ("broadcast", "float32[2] root 0"),  # src passed by position
        ("gather", "root 0"),  # the root's list, the others' none: only the root compared
        ("broadcast_object_list", "root 0"),
        ("all_gather", "float32"),  # sizes may differ (uneven all_gather): dtype only
        ("all_gather_into_tensor", "float32[5]"),
        ("reduce_scatter_tensor", "float32[3] MAX"),
        ("all_to_all_single", None),  # splits may differ between ranks: not compared
        ("barrier", None),
        ("all_gather_object", None),
    ]


def _call(pg: str, seq: int, op: str, sig: str | None, caller: str = "train.py:9") -> dict:
    return {"pg": pg, "seq": seq, "op": op, "sig": sig, "caller": caller, "t0": float(seq), "duration": 0.0}


def test_ranks_are_compared_call_by_call() -> None:
    agreed = [_call("0", 1, "all_reduce", "float32[8] SUM"), _call("0:p2p", 1, "send", None)]
    rank0 = [*agreed, _call("0", 2, "all_reduce", "float32[2] SUM", "train.py:40")]
    rank1 = [*agreed, _call("0", 2, "all_reduce", "float32[2] MAX", "train.py:44")]
    found = find_mismatches({0: signatures(rank0), 1: signatures(rank1)})
    assert found == [
        {
            "pg": "0",
            "seq": 2,
            "passed": {
                0: {"op": "all_reduce", "sig": "float32[2] SUM", "caller": "train.py:40"},
                1: {"op": "all_reduce", "sig": "float32[2] MAX", "caller": "train.py:44"},
            },
            "odd_rank": None,  # two ranks: either may be the one that is wrong
        }
    ]
    state = RunState(now=0.0, started=0.0, payload_mismatches=found)
    (verdict,) = diagnose_payload_mismatch(state)
    assert (verdict.kind, verdict.severity, verdict.culprit_rank, verdict.location) == (
        "collective.mismatch",
        "error",
        None,
        None,
    )
    assert "rank 0 float32[2] SUM at train.py:40, rank 1 float32[2] MAX at train.py:44" in verdict.summary


def test_a_lone_rank_against_an_agreeing_majority_is_named() -> None:
    tables = {
        rank: signatures(
            [_call("1", 7, "all_reduce", "float32[4] SUM" if rank != 2 else "int32[4] SUM", f"t.py:{rank}")]
        )
        for rank in range(4)
    }
    (found,) = find_mismatches(tables)
    assert found["odd_rank"] == 2
    (verdict,) = diagnose_payload_mismatch(RunState(now=0.0, started=0.0, payload_mismatches=[found]))
    assert (verdict.culprit_rank, verdict.location) == (2, "t.py:2")


def test_what_cannot_be_compared_is_left_alone() -> None:
    # a restarted rank numbers its calls from 1 again: a (group, seq) it recorded twice is skipped
    restarted = [_call("0", 1, "all_reduce", "float32[2] SUM"), _call("0", 1, "all_reduce", "float32[2] MAX")]
    other = [_call("0", 1, "all_reduce", "float32[2] MAX")]
    assert find_mismatches({0: signatures(restarted), 1: signatures(other)}) == []
    # calls without a signature (older timelines, gather/scatter) and calls only one rank recorded
    assert find_mismatches({0: signatures([_call("0", 3, "gather", None)]), 1: signatures([])}) == []
    assert diagnose_payload_mismatch(RunState(now=0.0, started=0.0)) == []
