"""More ways of starting ranks, run unchanged under `sddoctor run` (2 ranks, CPU, gloo): workers
forked by start_processes from a parent that imported torch.distributed, mp.spawn(join=False) with
its join loop, ranks started by a shell script with an explicit tcp:// init_method, replicate()
on a DeviceMesh (under torchrun, and under mp.spawn where init_device_mesh starts the process
group), and Lightning's ddp_spawn.

The runs start side by side in one module-scoped fixture; each test reads one report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from client_fixtures import CLIENTS, assert_no_sddoctor_traceback
from supervise_fixtures import Supervised, run_side_by_side, run_supervised, script_line, torchrun

from conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FORK = CLIENTS / "notebook_fork.py"
ARGPARSE = CLIENTS / "argparse_ranks.py"
MESH = CLIENTS / "mesh_replicate.py"
LIGHTNING = CLIENTS / "lightning_spawn.py"
STEPS = {"STEPS": "12"}


def _python(script: Path) -> list[str]:
    return [sys.executable, str(script)]


def _cases() -> dict[str, tuple[list[str], str | None, dict[str, str]]]:
    """name -> (job command, fault, environment); ports are picked when the module's runs start."""
    spawn = {**STEPS, "MASTER_PORT": str(free_port())}
    return {
        "fork-healthy": (_python(FORK), None, {**STEPS, "MASTER_PORT": str(free_port())}),
        "nojoin-sleep": (
            _python(FORK),
            "sleep:rank=1,seconds=600,step=3",
            {**spawn, "MODE": "nojoin"},
        ),
        "script-kill": (
            ["bash", str(CLIENTS / "launch_ranks.sh"), f"tcp://127.0.0.1:{free_port()}"],
            "kill:rank=1,step=5",
            STEPS,
        ),
        "replicate-healthy": (torchrun(2, "--standalone", str(MESH)), None, STEPS),
        # gradient all-reduces are the default group's #1, #2, ...: #3 is step 3's
        "replicate-skip": (torchrun(2, "--standalone", str(MESH)), "skip:rank=1,seq=3", STEPS),
        # DTensor's gradient and optimizer collectives are functional collectives, not traced: the
        # waiting rank is seen in its stack only
        "dtensor-sleep": (
            torchrun(2, "--standalone", str(MESH)),
            "sleep:rank=1,seconds=600,step=3",
            {**STEPS, "MODE": "dtensor"},
        ),
        "mesh-spawn-sleep": (
            _python(MESH),
            "sleep:rank=1,seconds=600,step=3",
            {**STEPS, "MASTER_PORT": str(free_port())},
        ),
        # #35 is the all-reduce of the first validation's val_loss (sync_dist=True), which Lightning
        # issues as the validation loop stores its outputs
        "lightning-spawn-skip-val": (
            _python(LIGHTNING),
            "skip:rank=1,seq=35",
            {**STEPS, "MASTER_PORT": str(free_port())},
        ),
        "lightning-spawn-raise": (
            _python(LIGHTNING),
            "raise:rank=1,step=5",
            {**STEPS, "MASTER_PORT": str(free_port())},
        ),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Supervised]:
    root = tmp_path_factory.mktemp("launch-shapes")
    cases = _cases()

    def one(name: str, where: Path) -> Supervised:
        job, fault, env = cases[name]
        options = ("--hang-timeout", "5", "--on-hang", "kill")
        return run_supervised(where, job, options=options, fault=fault, env=env, timeout=150)

    # the longest first: Lightning's start, then the hangs (each waits out --hang-timeout)
    slow_first = sorted(
        cases, key=lambda name: ("lightning" not in name, "sleep" not in name and "skip" not in name)
    )
    return run_side_by_side(root, slow_first, one)


def _run(runs: dict[str, Supervised], name: str) -> Supervised:
    res = runs[name]
    assert_no_sddoctor_traceback(res)
    assert res.report["world_size"] == 2, res.report
    assert sorted(res.report["ranks"]) == ["0", "1"], list(res.report["ranks"])
    return res


def _timeline_calls(res: Supervised, rank: int) -> int:
    log = res.run_dir / "timeline" / f"rank-{rank:05d}.jsonl"
    return sum(len(json.loads(line)["calls"]) for line in log.read_text().splitlines())


def test_forked_workers_of_a_notebook_style_parent_run_healthy(runs: dict) -> None:
    """The parent imported torch.distributed before forking; each worker ends with os._exit, and
    its last collectives still reach its timeline, with the closing summary event."""
    res = _run(runs, "fork-healthy")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.report["outcome"] == "ok" and res.report["verdicts"] == [], res.report["verdicts"]
    for rank in (0, 1):
        steps = res.events(rank, "step")
        assert [s["step"] for s in steps] == list(range(1, 13))
        assert {s.get("samples") for s in steps} == {16}
        (summary,) = res.events(rank, "collective")
        assert summary["count"] == _timeline_calls(res, rank) == 12, summary


def test_a_worker_asleep_under_spawn_without_join_is_the_missing_rank(runs: dict) -> None:
    res = _run(runs, "nojoin-sleep")
    assert res.returncode == 124, res.stderr[-3000:]
    (v,) = res.verdicts("hang.")
    assert (v["kind"], v["culprit_rank"]) == ("hang.missing_rank", 1), v
    assert v["location"] == script_line("# FORWARD", FORK), v


def test_a_rank_killed_under_a_shell_script_that_exits_0_fails_the_run(runs: dict) -> None:
    """The script's bare `wait` ends 0 whatever its ranks did: the crash still fails the run."""
    res = _run(runs, "script-kill")
    assert res.returncode == 1, res.stderr[-3000:]
    report = res.report
    assert (report["outcome"], report["exit_code"], report["job_exit_code"]) == ("failed", 1, 0), report
    (v,) = res.verdicts("crash")
    assert (v["culprit_rank"], v["location"]) == (1, script_line("# FORWARD", ARGPARSE)), v


def test_replicate_on_a_device_mesh_has_its_steps_and_gradient_all_reduces(runs: dict) -> None:
    """replicate() drives its DDP without calling it: its steps and samples are still counted, and
    its gradient all-reduces traced (the weights agree on both ranks)."""
    res = _run(runs, "replicate-healthy")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.report["outcome"] == "ok" and res.report["verdicts"] == [], res.report["verdicts"]
    for rank in (0, 1):
        steps = res.events(rank, "step")
        assert [s["step"] for s in steps] == list(range(1, 13))
        assert {(s.get("source"), s.get("samples")) for s in steps} == {("ddp", 16)}
        assert res.events(rank, "collective")[-1]["ops"]["all_reduce"]["count"] == 12
    sums = {line.split("checksum ")[1] for line in res.stdout.splitlines() if "checksum" in line}
    assert len(sums) == 1, res.stdout


def test_a_skipped_gradient_all_reduce_of_replicate_names_the_rank(runs: dict) -> None:
    res = _run(runs, "replicate-skip")
    assert res.returncode == 124, res.stderr[-3000:]
    (v,) = res.verdicts("hang.")
    assert (v["kind"], v["culprit_rank"]) == ("hang.missing_rank", 1), v
    assert v["location"] == script_line("# BACKWARD", MESH), v
    assert "all_reduce #3" in v["summary"], v


def test_spawned_workers_whose_device_mesh_starts_the_group_are_ranks(runs: dict) -> None:
    """init_device_mesh calls init_process_group itself: the workers still become ranks 0 and 1."""
    res = _run(runs, "mesh-spawn-sleep")
    assert res.returncode == 124, res.stderr[-3000:]
    (v,) = res.verdicts("hang.")
    assert (v["kind"], v["culprit_rank"]) == ("hang.missing_rank", 1), v
    assert v["location"] == script_line("# FORWARD", MESH), v
    assert [s["step"] for s in res.events(0, "step")] == [1, 2]


def test_a_rank_asleep_while_the_other_waits_in_a_dtensor_collective_is_the_missing_rank(runs: dict) -> None:
    res = _run(runs, "dtensor-sleep")
    assert res.returncode == 124, res.stderr[-3000:]
    (v,) = res.verdicts("hang.")
    assert (v["kind"], v["culprit_rank"]) == ("hang.missing_rank", 1), v
    assert v["location"].startswith(f"{MESH}:"), v
    assert "_functional_collectives.py" in v["details"]["untraced_waits"]["0"], v
    assert v["details"]["waiting_ranks"] == [0] and "asleep in the injected fault" in v["summary"], v


def test_a_lightning_ddp_spawn_crash_is_at_the_users_fit_line(runs: dict) -> None:
    """No code of the user's is on a ddp_spawn worker's stack: the location is trainer.fit(...) in
    the parent; Lightning's SIGTERM handler failing in the surviving rank is not sddoctor's error."""
    res = _run(runs, "lightning-spawn-raise")
    assert res.returncode == 1, res.stderr[-3000:]
    (v,) = res.report["verdicts"]
    assert (v["kind"], v["culprit_rank"]) == ("crash", 1), v
    assert v["location"] == script_line("# FIT", LIGHTNING), v
    assert "instrument/api.py" not in v["summary"], v


def test_a_skipped_validation_metric_all_reduce_is_a_missing_rank_not_a_dataloader_hang(runs: dict) -> None:
    """Rank 1 is held in Lightning's `_store_dataloader_outputs`, which reduces the logged metrics:
    a function named after dataloaders is no DataLoader."""
    res = _run(runs, "lightning-spawn-skip-val")
    assert res.returncode == 124, res.stderr[-3000:]
    (v,) = res.verdicts("hang.")
    assert (v["kind"], v["culprit_rank"]) == ("hang.missing_rank", 1), v
    assert v["location"] == script_line("# FIT", LIGHTNING), v
    assert "all_reduce #35" in v["summary"], v
