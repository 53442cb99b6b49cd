"""Hangs whose shape is more than "one rank is missing from the collective everyone waits in":
a collective skipped on a subgroup, point-to-point deadlocks, and a collective only some ranks
call. Real gloo jobs on CPU under `sddoctor run`, each written to tmp_path."""

from __future__ import annotations

from pathlib import Path

from supervise_fixtures import run_supervised, script_line, torchrun

JOB = """
import os
import torch
import torch.distributed as dist

FAULT = os.environ["FAULT"]


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    evens = dist.new_group([r for r in range(world) if r % 2 == 0])
    odds = dist.new_group([r for r in range(world) if r % 2 == 1])
    mine = evens if rank % 2 == 0 else odds
    for it in range(50):
        t = torch.ones(4)
        dist.all_reduce(t)  # WORLD
        if FAULT == "subgroup" and rank == 2 and it == 3:
            pass
        else:
            dist.all_reduce(t, group=mine)  # SUBGROUP
        if FAULT == "main_only" and rank == 0 and it == 3:
            dist.barrier()  # MAIN ONLY
        if FAULT == "other_line" and rank == 1 and it == 3:
            dist.all_reduce(torch.ones(3))  # OTHER LINE
        else:
            dist.all_reduce(t)  # USUAL LINE
        buf = torch.zeros(2)
        for micro in range(3):  # a two-stage pipeline between ranks 0 and 1
            if rank == 0:
                dist.send(buf, dst=1)  # SEND ACT
                dist.recv(buf, src=1)  # RECV GRAD
            elif rank == 1:
                dist.recv(buf, src=0)  # RECV ACT
                if it == 3 and f"{FAULT}:{micro}" in ("skip_send:1", "skip_last_send:2"):
                    continue
                dist.send(buf, dst=0)  # SEND GRAD
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


def _job(tmp_path: Path) -> tuple[Path, list[str]]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    return script, [str(script)]


def test_skip_on_a_subgroup_names_the_member_that_skipped(tmp_path):
    script, args = _job(tmp_path)
    res = run_supervised(tmp_path, torchrun(3, *args), env={"FAULT": "subgroup"})
    assert res.returncode == 124, res.stderr
    (v,) = res.verdicts("hang.")
    # rank 0 waits in the evens' all_reduce; rank 1 (not a member) is not out of step
    assert (v["kind"], v["culprit_rank"]) == ("hang.missing_rank", 2), v
    assert v["details"]["waiting_ranks"] == [0]
    assert v["details"]["group_members"] == [0, 2]
    assert v["location"] == script_line("# USUAL LINE", script)
    assert "skipped that call" in v["summary"] and script_line("# SUBGROUP", script) in v["summary"]


def test_skipped_send_is_a_p2p_deadlock_naming_both_ranks(tmp_path):
    script, args = _job(tmp_path)
    res = run_supervised(tmp_path, torchrun(2, *args), env={"FAULT": "skip_send"})
    assert res.returncode == 124, res.stderr
    (v,) = res.verdicts("hang.")
    assert (v["kind"], v["culprit_rank"]) == ("hang.p2p_deadlock", 1), v
    assert v["details"]["deadlock_ranks"] == [0, 1]
    assert v["location"] == script_line("# RECV ACT", script)
    for marker in ("# RECV GRAD", "# RECV ACT", "# SEND GRAD"):
        assert script_line(marker, script) in v["summary"]
    assert "check-nccl" not in v["summary"]


def test_recv_from_a_rank_gone_to_a_collective_names_that_rank(tmp_path):
    script, args = _job(tmp_path)
    res = run_supervised(tmp_path, torchrun(2, *args), env={"FAULT": "skip_last_send"})
    assert res.returncode == 124, res.stderr
    (v,) = res.verdicts("hang.")
    # rank 0 waits in recv from rank 1, which went on to the next iteration's all_reduce
    assert (v["kind"], v["culprit_rank"]) == ("hang.missing_rank", 1), v
    assert v["location"] == script_line("# WORLD", script)
    assert script_line("# RECV GRAD", script) in v["summary"]


def test_collective_called_by_rank_0_only_names_its_line(tmp_path):
    script, args = _job(tmp_path)
    res = run_supervised(tmp_path, torchrun(2, *args), env={"FAULT": "main_only"})
    assert res.returncode != 0, res.stderr
    (v,) = res.verdicts("hang.")
    assert (v["kind"], v["culprit_rank"]) == ("hang.mismatch", 0), v
    assert v["location"] == script_line("# MAIN ONLY", script)
    assert script_line("# USUAL LINE", script) in v["summary"]  # where rank 1 is
    assert "must be called by every rank" in v["summary"]


def test_collective_at_a_line_one_rank_never_used_names_that_rank(tmp_path):
    script, args = _job(tmp_path)
    res = run_supervised(tmp_path, torchrun(2, *args), env={"FAULT": "other_line"})
    assert res.returncode != 0, res.stderr
    (v,) = res.verdicts("hang.")
    assert (v["kind"], v["culprit_rank"]) == ("hang.mismatch", 1), v
    assert v["location"] == script_line("# OTHER LINE", script)


BATCHNORM_JOB = """
import os
import torch
import torch.distributed as dist
from torch import nn


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    # DDP's reducer then issues collectives of its own: the buffer broadcast before each forward
    # and, with find_unused_parameters, the all-reduce of the map of used parameters
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=os.environ["UNUSED"] == "1")
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(40):
        loss = ddp(torch.randn(4, 8)).pow(2).mean()  # FORWARD
        loss.backward()  # BACKWARD
        optimizer.step()
        optimizer.zero_grad()
        if os.environ.get("BROADCAST") == "1":  # a broadcast of the user's own, as Lightning issues
            dist.broadcast(torch.zeros(3), src=0)  # BROADCAST
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


def test_a_skipped_gradient_all_reduce_beside_ddps_own_collectives_is_a_missing_rank(tmp_path):
    """The skipped bucket is not met by one of the reducer's untraced calls (gloo would abort on the
    size mismatch): the rank stops in that backward and is named there."""
    script = tmp_path / "bn.py"
    script.write_text(BATCHNORM_JOB)
    for unused in ("0", "1"):
        where = tmp_path / f"unused-{unused}"
        where.mkdir()
        res = run_supervised(
            where, torchrun(2, str(script)), env={"UNUSED": unused}, fault="skip:rank=1,seq=4"
        )
        assert res.returncode == 124, res.stderr[-3000:]
        (v,) = res.verdicts("hang.")
        assert (v["kind"], v["culprit_rank"]) == ("hang.missing_rank", 1), v
        assert v["details"]["op"] == "all_reduce" and v["details"]["waiting_ranks"] == [0], v
        assert v["location"] == script_line("# BACKWARD", script), v
        assert "Received data size doesn't match" not in res.stderr


def test_a_skip_just_before_ddps_own_collectives_holds_the_rank_at_its_next_forward(tmp_path):
    """Skipped: a broadcast after the first step (#3, after DDP's buffer broadcast #1 and the
    gradient bucket #2). Held only at the next traced call, the rank would first run the next
    forward's bucket rebuild, whose broadcast is not traced and meets the peer's pending broadcast:
    gloo aborts both ranks on the size ("hang.mismatch" of the wrong collective). It stops at the
    DDP model's forward instead."""
    script = tmp_path / "bn.py"
    script.write_text(BATCHNORM_JOB)
    res = run_supervised(
        tmp_path, torchrun(2, str(script)), env={"UNUSED": "0", "BROADCAST": "1"}, fault="skip:rank=1,seq=3"
    )
    assert res.returncode == 124, res.stderr[-3000:]
    (v,) = res.verdicts("hang.")
    assert (v["kind"], v["culprit_rank"]) == ("hang.missing_rank", 1), v
    assert v["details"]["op"] == "broadcast" and v["details"]["waiting_ranks"] == [0], v
    assert v["location"] == script_line("# FORWARD", script), v
    assert f"called at {script_line('# BROADCAST', script)}" in v["summary"], v
    assert "Received data size doesn't match" not in res.stderr


UNEVEN_JOB = """
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(10, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # each rank reads its own shard, and rank 1's is shorter: 6 batches against 8
    n = 64 if dist.get_rank() == 0 else 48
    loader = DataLoader(TensorDataset(torch.randn(n, 10), torch.randn(n, 1)), batch_size=8)
    for epoch in range(2):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # BACKWARD
            optimizer.step()
        dist.barrier()  # EPOCH END
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


def test_uneven_inputs_are_named_as_such(tmp_path):
    """Rank 1's data runs out first: it waits at the epoch's barrier while rank 0 waits in its
    next step's gradient all-reduce. The verdict says which rank left the loop, and why that happens."""
    script = tmp_path / "uneven.py"
    script.write_text(UNEVEN_JOB)
    res = run_supervised(tmp_path, torchrun(2, str(script)))
    assert res.returncode == 124, res.stderr[-3000:]
    (v,) = res.verdicts("hang.")
    assert (v["kind"], v["culprit_rank"]) == ("hang.mismatch", 1), v
    assert v["location"] == script_line("# EPOCH END", script), v
    assert (
        "Rank 0 is in a training step (DDP's gradient all-reduce in the backward) and rank 1 is not"
        in v["summary"]
    ), v
    assert "uneven inputs" in v["summary"] and "join() context" in v["summary"], v
    assert v["details"]["calls"]["0"]["ddp"] == "bucket" and "ddp" not in v["details"]["calls"]["1"], v
