"""Ranks started from Python rather than a CLI launcher, run unchanged under `sddoctor run` (2 ranks,
CPU, gloo): torch's programmatic `elastic_launch(LaunchConfig(...), train)(...)` (the agent runs in
the script's own process and spawns the workers, which get RANK only once they run), accelerate's
`notebook_launcher` on CPU (the same agent, forked workers), and an accelerate script with
gradient accumulation, a `gather_for_metrics` evaluation each epoch and `save_state`.

The launching process is never a rank, the workers are ranks 0 and 1 only, and every verdict names
rank 1 at the user's line. The runs start side by side in one module-scoped fixture; each test
reads one report."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from client_fixtures import CLIENTS, assert_no_sddoctor_traceback
from supervise_fixtures import Supervised, run_side_by_side, run_supervised, script_line

from conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ELASTIC = CLIENTS / "elastic_api.py"
NOTEBOOK = CLIENTS / "accelerate_notebook.py"
EPOCHS = CLIENTS / "accelerate_epochs.py"
STEPS = {"STEPS": "12"}


def _python(script: Path) -> list[str]:
    return [sys.executable, str(script)]


def _accelerate(script: Path) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), script.as_posix()]  # fmt: skip


def _cases() -> dict[str, tuple[list[str], str | None, dict[str, str]]]:
    """name -> (job command, fault, environment); ports are picked when the module's runs start.

    Gradient all-reduce numbers: elastic_api's DDP issues one a step from #1, so #3 is step 3's;
    accelerate's prepare() broadcasts first (#1), then one a step (#2, #3, ...)."""

    def port() -> dict[str, str]:
        return {**STEPS, "MASTER_PORT": str(free_port())}

    epochs = {"ACCELERATE_USE_CPU": "true", "SAVE_EVERY": "3"}  # 3 epochs of 4 steps, 2 micro-batches each
    return {
        "elastic-healthy": (_python(ELASTIC), None, port()),
        "elastic-kill": (_python(ELASTIC), "kill:rank=1,step=5", port()),
        "elastic-skip": (_python(ELASTIC), "skip:rank=1,seq=3", port()),
        # a straggler needs 5 steps and 10 collectives in its window and 10 s more evidence
        "elastic-straggler": (
            _python(ELASTIC),
            "sleep:rank=1,seconds=0.3,step=1,every=1",
            {**port(), "STEPS": "60"},
        ),
        "notebook-healthy": (_python(NOTEBOOK), None, port()),
        "notebook-raise": (_python(NOTEBOOK), "raise:rank=1,step=5", port()),
        "notebook-sleep": (_python(NOTEBOOK), "sleep:rank=1,seconds=600,step=3", port()),
        "epochs-healthy": (_accelerate(EPOCHS), None, epochs),
        "epochs-skip": (_accelerate(EPOCHS), "skip:rank=1,seq=3", epochs),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Supervised]:
    root = tmp_path_factory.mktemp("python-launchers")
    cases = _cases()

    def one(name: str, where: Path) -> Supervised:
        job, fault, env = cases[name]
        options = ("--hang-timeout", "5", "--on-hang", "kill")
        env = {**env, "OUT": str(where / "checkpoints")}
        return run_supervised(where, job, options=options, fault=fault, env=env, timeout=150)

    # the longest first: the straggler's 60 steps, then the hangs (each waits out --hang-timeout)
    slow_first = sorted(
        cases, key=lambda name: ("straggler" not in name, "sleep" not in name and "skip" not in name)
    )
    return run_side_by_side(root, slow_first, one)


def _run(runs: dict[str, Supervised], name: str) -> Supervised:
    """The run, checked for what every case shares: ranks 0 and 1 only (the process that launched
    the workers is no rank), and no traceback of sddoctor's own."""
    res = runs[name]
    assert_no_sddoctor_traceback(res)
    assert res.report["world_size"] == 2, res.report
    assert sorted(res.report["ranks"]) == ["0", "1"], list(res.report["ranks"])
    return res


def _assert_healthy(res: Supervised, steps: int, samples: int) -> None:
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.report["outcome"] == "ok" and res.report["verdicts"] == [], res.report["verdicts"]
    for rank in (0, 1):
        found = res.events(rank, "step")
        assert [s["step"] for s in found] == list(range(1, steps + 1)), found
        assert {(s.get("source"), s.get("samples")) for s in found} == {("ddp", samples)}, found


def _assert_crash(res: Supervised, script: Path) -> None:
    assert res.returncode == 1, res.stderr[-3000:]
    (v,) = res.verdicts("crash")
    assert (v["culprit_rank"], v["location"]) == (1, script_line("# FORWARD", script)), v


def _assert_missing_rank_1(res: Supervised, line: str) -> dict:
    assert res.returncode == 124, res.stderr[-3000:]
    (v,) = res.verdicts("hang.")
    assert (v["kind"], v["culprit_rank"], v["location"]) == ("hang.missing_rank", 1, line), v
    return v


def test_elastic_launch_workers_are_the_ranks_and_the_agent_is_not(runs: dict) -> None:
    res = _run(runs, "elastic-healthy")
    _assert_healthy(res, 12, 16)
    (line,) = [line for line in res.stdout.splitlines() if line.startswith("checksums")]
    assert len(set(line.split("[")[1].strip("]").split(", "))) == 1, line  # the weights agree


def test_a_worker_killed_under_elastic_launch_is_the_crash(runs: dict) -> None:
    _assert_crash(_run(runs, "elastic-kill"), ELASTIC)


def test_a_skipped_gradient_all_reduce_under_elastic_launch_names_rank_1(runs: dict) -> None:
    v = _assert_missing_rank_1(_run(runs, "elastic-skip"), script_line("# BACKWARD", ELASTIC))
    assert "all_reduce #3" in v["summary"], v


def test_a_slow_worker_under_elastic_launch_is_the_straggler(runs: dict) -> None:
    res = _run(runs, "elastic-straggler")
    assert res.returncode == 0, res.stderr[-3000:]
    (v,) = res.verdicts("straggler")
    assert v["culprit_rank"] == 1, v
    # the injected sleep fires at the forward; the worker's own code runs under torch's @record wrapper
    assert v["location"] == script_line("# FORWARD", ELASTIC), v
    assert v["details"]["cause"]["location"] == v["location"], v


def test_notebook_launcher_on_cpu_runs_healthy(runs: dict) -> None:
    _assert_healthy(_run(runs, "notebook-healthy"), 12, 8)


def test_a_raise_under_notebook_launcher_is_the_crash_at_the_forward(runs: dict) -> None:
    _assert_crash(_run(runs, "notebook-raise"), NOTEBOOK)


def test_a_worker_asleep_under_notebook_launcher_is_the_missing_rank(runs: dict) -> None:
    """run_supervised also fails the test if a worker or the agent outlives the stop."""
    v = _assert_missing_rank_1(_run(runs, "notebook-sleep"), script_line("# FORWARD", NOTEBOOK))
    assert "asleep in the injected fault" in v["summary"], v


def test_accelerate_epochs_with_accumulation_eval_gather_and_save_state(runs: dict) -> None:
    """Micro-batches under accelerator.accumulate are no steps; gather_for_metrics and
    save_state add no verdict; each save_state wrote its folder."""
    res = _run(runs, "epochs-healthy")
    _assert_healthy(res, 12, 16)
    saved = sorted(p.name for p in (res.run_dir.parent / "checkpoints").iterdir())
    assert saved == ["step-12", "step-3", "step-6", "step-9"], saved
    (summary,) = res.events(0, "collective")[-1:]
    assert summary["ops"]["all_gather"]["count"] == 12, summary  # 4 evaluation batches an epoch


def test_a_skipped_gradient_all_reduce_under_accumulate_names_rank_1(runs: dict) -> None:
    v = _assert_missing_rank_1(_run(runs, "epochs-skip"), script_line("# BACKWARD", EPOCHS))
    assert "all_reduce #3" in v["summary"], v
