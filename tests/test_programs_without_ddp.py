"""Real jobs whose shape the DDP-based step inference alone did not cover: no DDP model (gradients
averaged by hand, FSDP2), Lightning's validation loop, fork-started workers, and ranks that end
with os._exit or sys.exit inside mp.spawn."""

from __future__ import annotations

import pytest
from client_fixtures import CLIENTS_BY_NAME
from supervise_fixtures import run_supervised, script_line, torchrun

MANUAL_ALL_REDUCE_JOB = """
import os
import torch, torch.distributed as dist

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(int(os.environ.get("STEPS", "6"))):
    loss = model(torch.randn(8, 16)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)  # GRADIENTS
        p.grad /= dist.get_world_size()
    opt.step()  # OPTIMIZER
dist.destroy_process_group()
"""

FSDP2_JOB = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
fully_shard(model[0], mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(5):
    loss = model(torch.randn(8, 16)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
dist.destroy_process_group()
"""


def test_a_program_without_ddp_gets_one_step_per_optimizer_step(tmp_path):
    script = tmp_path / "manual.py"
    script.write_text(MANUAL_ALL_REDUCE_JOB)
    res = run_supervised(tmp_path, torchrun(2, str(script)))
    assert res.returncode == 0, res.stderr
    assert res.report["verdicts"] == []
    for rank in (0, 1):
        steps = res.events(rank, "step")
        assert [(s["step"], s["source"]) for s in steps] == [(n, "optimizer") for n in range(1, 7)]
        assert all(s["step_time"] > 0 for s in steps[1:])
    assert res.report["health"]["throughput"]["steps"] == 6
    assert "6 steps (step times below); no images/s" in (res.run_dir / "report.md").read_text()


def test_a_step_fault_fires_in_the_optimizer_step_of_a_program_without_ddp(tmp_path):
    """Step 3 starts as step 2's optimizer.step() returns: the kill names that line."""
    script = tmp_path / "manual.py"
    script.write_text(MANUAL_ALL_REDUCE_JOB)
    res = run_supervised(tmp_path, torchrun(2, str(script)), fault="kill:rank=1,step=3")
    verdicts = [(v["kind"], v["culprit_rank"], v["location"]) for v in res.report["verdicts"]]
    assert verdicts == [("crash", 1, script_line("# OPTIMIZER", script))], res.report["verdicts"]
    assert [s["step"] for s in res.events(1, "step")] == [1, 2]


def test_fsdp2_collectives_are_traced_and_its_steps_counted(tmp_path):
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs a torch with fully_shard")
    from torch.distributed import fsdp

    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no fully_shard (FSDP2)")
    script = tmp_path / "fsdp2.py"
    script.write_text(FSDP2_JOB)
    res = run_supervised(tmp_path, torchrun(2, str(script)), fault="skip:rank=1,seq=8")
    # FSDP2's all-gathers and reduce-scatters are collectives like any other: a skipped one hangs
    # (untraced, the fault would never fire and the run would end ok)
    verdicts = [(v["kind"], v["culprit_rank"]) for v in res.report["verdicts"]]
    assert verdicts == [("hang.missing_rank", 1)], res.report["verdicts"]
    rank0 = res.report["ranks"]["0"]
    assert rank0["collectives"]["totals"]["count"] >= 7  # done before the skipped #8
    assert len(res.events(0, "step")) >= 1


def test_lightning_steps_are_counted_through_its_validation_loop(tmp_path):
    """Lightning leaves the DDP wrapper in eval mode after validating (only the LightningModule goes
    back to training): every training step still counts."""
    client = CLIENTS_BY_NAME["lightning"]
    res = run_supervised(
        tmp_path, client.command(), env=client.environment(STEPS="12", VAL_EVERY="4"), timeout=180
    )
    assert res.returncode == 0, res.stderr
    assert res.report["verdicts"] == []
    for rank in (0, 1):
        assert [s["step"] for s in res.events(rank, "step")] == list(range(1, 13))


def test_fork_started_workers_that_finish_are_not_called_killed(tmp_path):
    """A forked worker ends with os._exit, which skips atexit: its exit and last events are still
    written, so a healthy run is ok with every step."""
    client = CLIENTS_BY_NAME["spawn"]
    res = run_supervised(tmp_path, client.command(), env=client.environment(STEPS="10", START_METHOD="fork"))
    assert res.returncode == 0, res.stderr
    assert res.report["verdicts"] == [], res.report["verdicts"]
    for rank in (0, 1):
        assert len(res.events(rank, "step")) == 10
        assert res.report["ranks"][str(rank)]["exit"]["code"] == 0


def test_sys_exit_in_an_mp_spawn_worker_names_the_users_line(tmp_path):
    """multiprocessing calls sys.exit again with the worker's status: the user's call is the one named."""
    client = CLIENTS_BY_NAME["spawn"]
    res = run_supervised(tmp_path, client.command(), env=client.environment(EXIT_RANK="1", EXIT_CODE="2"))
    verdicts = [(v["kind"], v["culprit_rank"], v["location"]) for v in res.report["verdicts"]]
    assert verdicts == [("crash", 1, client.line("# EXIT"))], res.report["verdicts"]
