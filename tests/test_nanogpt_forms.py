"""nanoGPT's train.py shape and the process-group start-up forms, run unchanged under `sddoctor run`
(2 ranks, CPU, gloo).

`nanogpt_style.py`: module-level code, DDP detected from RANK, gradient accumulation by setting
`model.require_backward_grad_sync` (no `no_sync()`), a GradScaler (off on CPU), gradient clipping,
`estimate_loss()` under `@torch.no_grad()` in eval mode every 4 iterations, the master process's
checkpoint, `while True` over `iter_num`. `init_forms.py`: `init_process_group()` with no backend
(torch names it "undefined" and picks one per device type) or with "cpu:gloo", launched by torchrun's
static rendezvous (`--nnodes 1 --node-rank 0 --master-addr --master-port`) or `--standalone`.

The runs start side by side in one module-scoped fixture; each test reads one report."""

from __future__ import annotations

from pathlib import Path

import pytest
from client_fixtures import CLIENTS, assert_no_sddoctor_traceback
from supervise_fixtures import Supervised, run_side_by_side, run_supervised, script_line, torchrun

from conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NANO = CLIENTS / "nanogpt_style.py"
INIT = CLIENTS / "init_forms.py"
HANG = ("--hang-timeout", "5", "--on-hang", "kill")
#: nanoGPT: iterations 0..11 (12 optimizer steps), 2 micro-steps a rank; one gradient bucket, so
#: collective #K is step K's gradient all-reduce (init_forms: the same)
NANO_ENV = {"MAX_ITERS": "11"}
STRAGGLER = "sleep:rank=1,seconds=0.3,step=1,every=1"
#: name -> (script, launcher form, fault, environment)
CASES: dict[str, tuple[Path, str, str | None, dict[str, str]]] = {
    "nano-healthy": (NANO, "standalone", None, NANO_ENV),
    "nano-kill": (NANO, "standalone", "kill:rank=1,step=5", NANO_ENV),
    "nano-raise": (NANO, "standalone", "raise:rank=1,step=5", NANO_ENV),
    "nano-skip": (NANO, "standalone", "skip:rank=1,seq=3", NANO_ENV),
    "nano-late": (NANO, "standalone", "sleep:rank=1,seconds=600,step=3", NANO_ENV),
    # nanoGPT's own form: only the master process evaluates; 55 steps of 0.3 s, about 17 s, past
    # the straggler verdict's 10 collectives, 5 steps and 10 s
    "nano-straggler": (NANO, "standalone", STRAGGLER, {"MAX_ITERS": "54", "EVAL_MASTER_ONLY": "1"}),
    "default-healthy": (INIT, "static", None, {"INIT": "default", "STEPS": "12", "ACCUM": "2"}),
    "cpu-gloo-skip": (INIT, "static", "skip:rank=1,seq=3", {"INIT": "cpu-gloo"}),
}


def _launcher(form: str, script: Path) -> list[str]:
    if form == "standalone":
        return torchrun(2, "--standalone", str(script))
    # torchrun's static rendezvous, as a one-node job script writes it
    rendezvous = ("--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1")
    return torchrun(2, *rendezvous, "--master-port", str(free_port()), str(script))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Supervised]:
    root = tmp_path_factory.mktemp("nanogpt-forms")

    def one(name: str, where: Path) -> Supervised:
        script, form, fault, extra = CASES[name]
        options = ("--hang-timeout", "30") if name == "nano-straggler" else HANG
        env = {"OMP_NUM_THREADS": "1", "OUT_DIR": str(where), **extra}
        return run_supervised(
            where, _launcher(form, script), options=options, fault=fault, env=env, timeout=150
        )

    return run_side_by_side(root, CASES, one)


def _run(runs: dict[str, Supervised], name: str) -> Supervised:
    res = runs[name]
    assert_no_sddoctor_traceback(res)
    return res


def _steps(res: Supervised, rank: int) -> list[dict]:
    return res.events(rank, "step")


def test_nanogpt_counts_one_step_per_optimizer_step(runs: dict) -> None:
    """require_backward_grad_sync=False on all but the last micro-step: DDP all-reduces only
    there, so 12 iterations are 12 steps of 2 micro-batches; estimate_loss()'s forwards (no_grad,
    eval mode) are not steps."""
    res = _run(runs, "nano-healthy")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.report["outcome"] == "ok" and res.report["verdicts"] == [], res.report["verdicts"]
    for rank in (0, 1):
        steps = _steps(res, rank)
        assert [s["step"] for s in steps] == list(range(1, 13)), steps
        assert {(s["source"], s["grad_accum"], s.get("samples")) for s in steps} == {("ddp", 2, 8)}, steps
    assert (res.run_dir.parent / "ckpt.pt").exists()  # the master process's checkpoint


@pytest.mark.parametrize("fault", ["kill", "raise"])
def test_a_nanogpt_rank_dying_at_a_step_is_named_at_its_training_forward(runs: dict, fault: str) -> None:
    """Step 5 is iteration 4, which starts with estimate_loss(): the fault fires at the training
    forward of the micro-step loop, in module-level code, not at the evaluation's forward."""
    res = _run(runs, f"nano-{fault}")
    assert res.returncode in (1, 124), res.stderr[-3000:]
    crashes = res.verdicts("crash")
    assert [(v["culprit_rank"], v["location"]) for v in crashes] == [(1, script_line("# FORWARD", NANO))], (
        crashes
    )
    assert [s["step"] for s in _steps(res, 1)] == [1, 2, 3, 4]


def test_a_nanogpt_rank_skipping_a_gradient_all_reduce_is_named(runs: dict) -> None:
    res = _run(runs, "nano-skip")
    assert res.returncode == 124, res.stderr[-3000:]
    (v,) = res.report["verdicts"]
    assert (v["kind"], v["culprit_rank"]) == ("hang.missing_rank", 1), v
    assert v["location"] == script_line("# BACKWARD", NANO), v
    assert (v["details"]["op"], v["details"]["seq"], v["details"]["waiting_ranks"]) == (
        "all_reduce",
        3,
        [0],
    ), v


def test_a_nanogpt_rank_asleep_before_a_step_is_named_at_its_forward(runs: dict) -> None:
    res = _run(runs, "nano-late")
    assert res.returncode == 124, res.stderr[-3000:]
    (v,) = res.report["verdicts"]
    assert (v["kind"], v["culprit_rank"]) == ("hang.missing_rank", 1), v
    assert v["location"] == script_line("# FORWARD", NANO), v
    assert "asleep in the injected fault" in v["summary"], v


def test_a_nanogpt_straggler_is_named_with_its_line_and_the_wait_site(runs: dict) -> None:
    """Here only the master process evaluates, as in nanoGPT itself: rank 0's DDP forwards in eval
    mode under no_grad are neither steps nor collectives, and rank 1 stays the straggler."""
    res = _run(runs, "nano-straggler")
    assert res.returncode == 0, res.stderr[-3000:]
    (v,) = res.report["verdicts"]
    assert (v["kind"], v["culprit_rank"]) == ("straggler", 1), v
    assert v["location"] == script_line("# FORWARD", NANO), v
    assert v["details"]["unit"] == "step" and v["details"]["wait_site"] == script_line("# BACKWARD", NANO), v
    for rank in (0, 1):
        assert [s["step"] for s in _steps(res, rank)] == list(range(1, 56))


def test_a_group_started_without_a_backend_reports_the_backends_torch_chose(runs: dict) -> None:
    """init_process_group() with no backend under torchrun's static rendezvous: healthy, its
    steps counted, and the report's backend is the device map ("cpu:gloo" on a CPU build; with
    CUDA "cpu:gloo,cuda:nccl"), not torch's "undefined"."""
    res = _run(runs, "default-healthy")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "backend undefined world 2" in res.stdout  # what torch itself calls it
    assert res.report["outcome"] == "ok" and res.report["verdicts"] == [], res.report["verdicts"]
    assert res.report["world_size"] == 2
    assert "cpu:gloo" in res.report["health"]["comm"]["backend"], res.report["health"]["comm"]
    assert "undefined" not in (res.run_dir / "report.md").read_text()
    for rank in (0, 1):
        steps = _steps(res, rank)
        assert [s["step"] for s in steps] == list(range(1, 13))
        assert {(s["grad_accum"], s.get("samples")) for s in steps} == {(2, 32)}, steps


def test_a_rank_skipping_a_gradient_all_reduce_in_a_cpu_gloo_group_is_named(runs: dict) -> None:
    """init_process_group("cpu:gloo") under torchrun's static rendezvous."""
    res = _run(runs, "cpu-gloo-skip")
    assert res.returncode == 124, res.stderr[-3000:]
    (v,) = res.report["verdicts"]
    assert (v["kind"], v["culprit_rank"], v["location"]) == (
        "hang.missing_rank",
        1,
        script_line("# BACKWARD", INIT),
    ), v
    assert res.report["health"]["comm"]["backend"] == "cpu:gloo"
