"""DDP programs of shapes the other client suites do not cover, run unchanged under `sddoctor run`
(2 ranks, CPU, gloo): a torchvision-style classifier whose BatchNorm buffers DDP broadcasts before
every forward, and a script that trains in two phases, each with a process group of its own.

The two runs start side by side in one module-scoped fixture; each test reads its report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from client_fixtures import CLIENTS, assert_no_sddoctor_traceback
from supervise_fixtures import Supervised, run_side_by_side, run_supervised, script_line, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TORCHVISION = CLIENTS / "torchvision_style.py"
TWO_PHASES = CLIENTS / "two_phases.py"
HANG = ("--hang-timeout", "5", "--on-hang", "kill")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Supervised]:
    root = tmp_path_factory.mktemp("ddp-variants")
    # rank 1 stops before its third forward (as a stuck data loader would): rank 0 goes on into
    # that forward, where DDP broadcasts the BatchNorm buffers from C++, and waits there
    cases: dict[str, tuple[Path, str | None]] = {
        "late-forward": (TORCHVISION, "sleep:rank=1,seconds=60,step=3"),
        "two-phases": (TWO_PHASES, "kill:rank=1,step=9"),
    }

    def one(name: str, where: Path) -> Supervised:
        script, fault = cases[name]
        env = {"OMP_NUM_THREADS": "1", "CKPT_DIR": str(where)}
        return run_supervised(
            where, torchrun(2, str(script)), options=HANG, fault=fault, env=env, timeout=150
        )

    return run_side_by_side(root, cases, one)


def test_a_rank_late_to_a_forward_with_buffers_is_named(runs: dict[str, Any]) -> None:
    """The peers wait in DDP's buffer broadcast, which is traced: not 'no rank is in a collective'."""
    res = runs["late-forward"]
    assert res.returncode == 124, res.stderr[-3000:]
    (v,) = res.verdicts("hang.")
    assert (v["kind"], v["culprit_rank"]) == ("hang.missing_rank", 1), v
    assert v["details"]["op"] == "broadcast" and v["details"]["waiting_ranks"] == [0], v
    assert v["location"] == script_line("# FORWARD", TORCHVISION), v
    # two steps of 6 buffer broadcasts and gradient all-reduces came before
    assert v["details"]["seq"] == 5, v
    assert_no_sddoctor_traceback(res)


def test_the_second_phases_model_has_its_steps_counted(runs: dict[str, Any]) -> None:
    """After destroy_process_group and a new group, the new DDP model's steps are numbered on, so
    a fault at step 9 (the third step of phase 2) fires there."""
    res = runs["two-phases"]
    assert res.returncode in (1, 124), res.stderr[-3000:]
    (v,) = res.verdicts("crash")
    assert v["culprit_rank"] == 1 and v["location"] == script_line("# FORWARD", TWO_PHASES), v
    steps = [s["step"] for s in res.events(0, "step")]
    assert steps == list(range(1, 9)), steps
    assert "never fired" not in res.stderr
    assert_no_sddoctor_traceback(res)


def _straggling(tmp_path: Path, script: Path, fault: str) -> tuple[Supervised, dict]:
    """4 ranks of `script`, 50 steps, under `fault`: the run (ended 0) and its one verdict."""
    res = run_supervised(
        tmp_path,
        torchrun(4, str(script)),
        options=("--hang-timeout", "30"),
        fault=fault,
        env={"OMP_NUM_THREADS": "1", "STEPS": "50"},
        timeout=150,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    (v,) = res.report["verdicts"]
    return res, v


def test_a_straggler_behind_its_data_parallel_pair_is_named(tmp_path: Path) -> None:
    """4 ranks as 2 pipeline stages x 2 replicas: rank 2 is slow before each forward. Its replica
    partner waits for it in their group's gradient all-reduce and so reaches the world's collectives
    as late as rank 2 does; the subgroup's collectives tell the two apart."""
    script = CLIENTS / "dp_pp_groups.py"
    res, v = _straggling(tmp_path, script, "sleep:rank=2,seconds=0.3")
    assert (v["kind"], v["culprit_rank"]) == ("straggler", 2), v
    assert v["location"] == script_line("# FORWARD", script), v
    for rank in range(4):
        assert [s["step"] for s in res.events(rank, "step")] == list(range(1, 51))
    assert_no_sddoctor_traceback(res)


def test_two_equally_slow_ranks_of_four_are_named_together(tmp_path: Path) -> None:
    """Ranks 1 and 3 of 4 sleep 0.3 s before each forward (two GPUs of four throttling): neither
    alone is most of the others' wait, since they take turns being last by a hair; together they
    are one straggler finding that names both."""
    res, v = _straggling(tmp_path, CLIENTS / "ddp_tutorial.py", "sleep:rank=1|3,seconds=0.3,step=2,every=1")
    assert v["kind"] == "straggler" and sorted(v["details"]["ranks"]) == [1, 3], v
    assert v["culprit_rank"] in (1, 3) and v["summary"].startswith("stragglers: ranks 1, 3"), v
    assert_no_sddoctor_traceback(res)


def test_a_skipped_async_all_reduce_is_named_before_the_later_blocking_call(tmp_path: Path) -> None:
    """Rank 0 issues its gradient all-reduces with async_op=True and then blocks in an all_gather;
    rank 1 never issued the first of the async ones, which the verdict names too."""
    script = CLIENTS / "async_collectives.py"
    # 4 broadcasts, then per step an all_to_all, 4 async all-reduces and an all_gather: #18 is the
    # first async all-reduce of step 3
    res = run_supervised(
        tmp_path,
        torchrun(2, str(script)),
        options=HANG,
        fault="skip:rank=1,seq=18",
        env={"OMP_NUM_THREADS": "1", "STEPS": "30"},
    )
    assert res.returncode == 124, res.stderr[-3000:]
    (v,) = res.verdicts("hang.")
    assert (v["kind"], v["culprit_rank"]) == ("hang.missing_rank", 1), v
    assert v["location"] == script_line("# ASYNC", script), v
    assert v["details"]["first_missed"] == {
        "seq": 18,
        "op": "all_reduce",
        "caller": script_line("# ASYNC", script),
    }, v
    assert f"all_reduce #18 on pg 0 (called at {script_line('# ASYNC', script)})" in v["summary"], v
    assert_no_sddoctor_traceback(res)
