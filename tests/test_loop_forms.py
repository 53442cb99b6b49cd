"""`sddoctor run` on DDP training loops in the forms users write (tests/clients/loop_forms.py), under
torchrun with 2 gloo ranks: each form runs healthy and unchanged, the user's own comm hook still
runs, and the inferred steps and samples are the program's.

A program that all-reduces several times per optimizer step (gradient accumulation without
no_sync, the DCGAN example's discriminator) used to get a step per backward; its steps now end at
the optimizer step of the counted model.

Under compiled autograd with DDP's Python reducer, DDP calls comm hooks per parameter with
(grad, param): sddoctor's hook took that for a bucket and the backward raised.

A comm hook registered after the model's first forward (a sanity check under no_grad) used to meet
sddoctor's own hook, installed at that forward, and DDP refused the second one: the program died.
A built-in one registered then is done by sddoctor's hook, with DDP's arithmetic: the trained
parameters are bitwise those of the same program without sddoctor.

torch.compile(DDP(model)), whose DDPOptimizer splits the compiled graph at the buckets, trains
with its steps and every bucket counted, bitwise as without sddoctor.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from client_fixtures import CLIENTS, sddoctor_tracebacks
from supervise_fixtures import Supervised, run_side_by_side, run_supervised, torchrun

from conftest import run_to_end, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = CLIENTS / "loop_forms.py"
DCGAN = CLIENTS / "dcgan_style.py"
COMPILED_AUTOGRAD = CLIENTS / "compiled_autograd.py"
COMPILED_DDP = CLIENTS / "compiled_ddp.py"
OTHER_SCRIPTS = {"dcgan": DCGAN, "compiled-autograd": COMPILED_AUTOGRAD, "compiled-ddp": COMPILED_DDP}
STEPS, BATCH = 12, 8
#: form -> (steps of rank 0, steps of rank 1, hook calls a rank prints, fp16 gradients)
FORMS: dict[str, tuple[int, int, int, bool]] = {
    "accum-synced": (STEPS, STEPS, 0, False),
    "hook-after-eval": (STEPS, STEPS, STEPS, False),
    "builtin-after-eval": (STEPS, STEPS, 0, True),
    # a built-in C++ hook has no last bucket to watch: the optimizer's step ends each step
    "builtin": (STEPS, STEPS, 0, True),
    "fp16-hook": (STEPS, STEPS, 0, True),
    "unused": (STEPS, STEPS, 0, False),
    "static": (STEPS, STEPS, 0, False),
    "join": (STEPS, STEPS - 3, 0, False),  # rank 1 runs out of data 3 steps early
    "zero": (STEPS, STEPS, 0, False),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Supervised]:
    root = tmp_path_factory.mktemp("forms")
    job = torchrun(2, "--standalone", str(SCRIPT))

    def one(form: str, where: Path) -> Supervised:
        env = {"FORM": form, "STEPS": str(STEPS), "BATCH": str(BATCH), "OMP_NUM_THREADS": "1"}
        options = ("--hang-timeout", "60", "--port", "0")
        command = [*job[:-1], str(OTHER_SCRIPTS[form])] if form in OTHER_SCRIPTS else job
        return run_supervised(where, command, options=options, env=env, timeout=240)

    return run_side_by_side(root, [*FORMS, *OTHER_SCRIPTS], one)


@pytest.mark.parametrize("form", list(FORMS))
def test_a_loop_form_runs_unchanged_with_its_steps_counted(runs: dict[str, Any], form: str) -> None:
    res = runs[form]
    log_file = res.run_dir / "stderr.log"
    logs = res.stderr + (log_file.read_text() if log_file.exists() else "")
    assert res.returncode == 0, logs[-3000:]
    assert res.report["verdicts"] == [], res.report["verdicts"]
    assert "internal error" not in logs, logs[-3000:]
    assert not sddoctor_tracebacks(logs)
    steps0, steps1, calls, fp16 = FORMS[form]
    micro = 2 if form == "accum-synced" else 1
    for rank, expected in ((0, steps0), (1, steps1)):
        steps = res.events(rank, "step")
        assert [s["step"] for s in steps] == list(range(1, expected + 1)), steps
        assert all(s["source"] == "ddp" and s.get("samples") == micro * BATCH for s in steps), steps
        assert all(s["grad_accum"] == micro for s in steps), steps
        # the user's hook ran in every backward, and fp16 compression where the user asked for it
        assert f"rank {rank} hook calls {calls} fp16 gradients {fp16}" in res.stdout + logs


def test_a_gan_gets_one_step_per_iteration_of_its_discriminator(runs: dict[str, Any]) -> None:
    """The discriminator trains first and is counted: three backwards and one optimizer step an
    iteration. A step ends at its optimizer step, so the generator's pass through it (after that
    step) opens the next one: 2 forwards in the first step, 3 in every later one."""
    res = runs["dcgan"]
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.report["verdicts"] == [], res.report["verdicts"]
    for rank in (0, 1):
        steps = res.events(rank, "step")
        assert [s["step"] for s in steps] == list(range(1, STEPS + 1)), steps
        assert [s["grad_accum"] for s in steps] == [2] + [3] * (STEPS - 1), steps
        assert {s["samples"] for s in steps[1:]} == {3 * BATCH}, steps


def test_compiled_autograd_with_the_python_reducer_trains_and_counts_its_steps(runs: dict[str, Any]) -> None:
    """Its comm hook calls come per parameter: the gradients are still averaged (every rank, fed
    its own data, ends with the same gradients) and the steps end at the optimizer's step."""
    res = runs["compiled-autograd"]
    log_file = res.run_dir / "stderr.log"
    logs = res.stderr + (log_file.read_text() if log_file.exists() else "")
    assert res.returncode == 0, logs[-3000:]
    assert res.report["verdicts"] == [], res.report["verdicts"]
    assert "internal error" not in logs, logs[-3000:]
    sums = {line.split("checksum ")[1] for line in (res.stdout + logs).splitlines() if "checksum" in line}
    assert len(sums) == 1, sums
    for rank in (0, 1):
        steps = res.events(rank, "step")
        assert [(s["step"], s["samples"]) for s in steps] == [(n, 8) for n in range(1, STEPS + 1)], steps


def test_a_compiled_ddp_model_trains_with_its_steps_and_buckets_counted(runs: dict[str, Any]) -> None:
    """torch.compile(DDP(model)): Dynamo's DDPOptimizer splits the graph at the buckets. Each step
    is counted once, at the end of its backward, and every bucket goes through sddoctor's hook:
    one bucket in the first step, two in every later one (after DDP rebuilt them)."""
    res = runs["compiled-ddp"]
    log_file = res.run_dir / "stderr.log"
    logs = res.stderr + (log_file.read_text() if log_file.exists() else "")
    assert res.returncode == 0, logs[-3000:]
    assert res.report["verdicts"] == [], res.report["verdicts"]
    assert "internal error" not in logs and not sddoctor_tracebacks(logs), logs[-3000:]
    for rank in (0, 1):
        steps = res.events(rank, "step")
        assert [(s["step"], s["samples"]) for s in steps] == [(n, BATCH) for n in range(1, STEPS + 1)], steps
        summary = res.events(rank, "collective")[-1]
        assert summary["ddp_buckets"] == 1 + 2 * (STEPS - 1), summary


@pytest.mark.parametrize("form", ["builtin-after-eval", "accum-synced", "compiled-ddp"])
def test_sddoctors_hook_trains_bitwise_as_ddps_own(runs: dict[str, Any], form: str) -> None:
    """accum-synced and compiled-ddp: sddoctor's hook in place of DDP's C++ all-reduce;
    builtin-after-eval: its fp16 compression in place of DDP's built-in FP16_COMPRESS hook."""
    env = subprocess_env(FORM=form, STEPS=str(STEPS), BATCH=str(BATCH))
    script = OTHER_SCRIPTS.get(form, SCRIPT)
    code, plain = run_to_end(torchrun(2, "--standalone", str(script)), timeout=180, env=env)
    assert code == 0, plain[-3000:]
    res = runs[form]
    for rank in (0, 1):
        # the ranks share one pipe, unbuffered: a line's newline may come after the other's line
        expected = re.findall(rf"rank {rank} parameters ({_FLOAT})", plain)
        assert len(expected) == 1, plain[-3000:]
        assert re.findall(rf"rank {rank} parameters ({_FLOAT})", res.stdout + res.stderr) == expected, (
            expected,
            res.stdout[-2000:],
        )


_FLOAT = r"-?\d+\.\d+(?:e[-+]?\d+)?"
