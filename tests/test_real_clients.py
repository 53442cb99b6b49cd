"""`sddoctor run` on programs written the way users write them, unchanged (tests/clients/): the
PyTorch DDP tutorial under torchrun, its mp.spawn version (no launcher), an accelerate script under
`accelerate launch`, a Lightning model with strategy="ddp" under torchrun, a diffusers-style
text-to-image loop and a model trained by transformers' Trainer under torchrun. 2 ranks on CPU with gloo; faults injected with SDDOCTOR_FAULT.

Each case asserts the verdict, the culprit rank, the user's own line, sddoctor's exit code and that
no rank's output holds a traceback of an error raised by sddoctor itself. The runs start side by
side in one module-scoped fixture (two at a time) and the tests read their reports.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from client_fixtures import CLIENTS_BY_NAME, sddoctor_tracebacks
from supervise_fixtures import Supervised, run_side_by_side, run_supervised

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MISSING = [
    name
    for name in ("accelerate", "lightning", "diffusers", "transformers")
    if importlib.util.find_spec(name) is None
]
if MISSING:  # they come with the test extra: `pip install -e .[dev]`
    pytest.skip(
        f"the real-client suite needs {', '.join(MISSING)} (pip install -e '.[dev]')", allow_module_level=True
    )

HANG = ("--hang-timeout", "5", "--on-hang", "kill")

# name -> (fault, environment, sddoctor options); {grad} and {barrier} are the client's own numbers
FAULTS: dict[str, tuple[str | None, dict[str, str], tuple[str, ...]]] = {
    "healthy": (None, {"STEPS": "12", "ACCUM": "2"}, HANG),
    "kill": ("kill:rank=1,step=5", {"STEPS": "30"}, HANG),
    "raise": ("raise:rank=1,step=5", {"STEPS": "30"}, HANG),
    "skip-grad": ("skip:rank=1,seq={grad}", {"STEPS": "30"}, HANG),
    "skip-barrier": ("skip:rank=1,seq={barrier}", {"STEPS": "30", "BARRIER_EVERY": "2"}, HANG),
    "straggler": ("sleep:rank=1,seconds=0.3", {"STEPS": "65"}, ("--hang-timeout", "30")),
    # the gradient all-reduce of rank 1 gets another shape: gloo would abort on it, so the call is
    # held (NCCL hangs the same way)
    "shape-grad": ("shape:rank=1,seq={grad}", {"STEPS": "30"}, HANG),
    # an out-of-memory error as a rank meets it on a GPU without the trainer's guard
    "oom": (
        "raise:rank=1,step=5,message=CUDA out of memory. Tried to allocate 2.00 GiB",
        {"STEPS": "30"},
        HANG,
    ),
}
#: faults run for some clients only (the others share the code paths these check)
ONLY = {"shape-grad": ("ddp", "spawn"), "oom": ("spawn", "accelerate")}


@pytest.fixture(scope="module", params=list(CLIENTS_BY_NAME))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every fault of one client, run two at a time: {"client": Client, fault name: Supervised}."""
    client = CLIENTS_BY_NAME[request.param]
    root = tmp_path_factory.mktemp(client.name)

    def one(fault_name: str, where: Path) -> Supervised:
        fault, env, options = FAULTS[fault_name]
        spec = fault.format(grad=client.grad_seq, barrier=client.barrier_seq) if fault else None
        env = client.environment(**env)
        return run_supervised(where, client.command(), options=options, fault=spec, env=env, timeout=240)

    faults = [f for f in FAULTS if client.name in ONLY.get(f, (client.name,))]
    return {"client": client, **run_side_by_side(root, faults, one)}


def _verdicts(res: Supervised, kind: str) -> list[dict[str, Any]]:
    return [v for v in res.report["verdicts"] if v["kind"] == kind]


def _no_sddoctor_traceback(res: Supervised) -> None:
    logs = res.stderr + (
        (res.run_dir / "stderr.log").read_text() if (res.run_dir / "stderr.log").exists() else ""
    )
    bad = sddoctor_tracebacks(logs)
    assert not bad, "sddoctor raised inside a rank:\n" + "\n\n".join(bad)


def _steps(res: Supervised, rank: int) -> list[dict[str, Any]]:
    return res.events(rank, "step")


def test_healthy_run_with_gradient_accumulation(runs: dict) -> None:
    res, c = runs["healthy"], runs["client"]
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.report["verdicts"] == [], res.report["verdicts"]
    assert res.report["world_size"] == 2
    for rank in (0, 1):
        steps = _steps(res, rank)
        # one step per optimizer step, not per micro-batch: 12 steps of 2 micro-batches each
        assert [s["step"] for s in steps] == list(range(1, 13)), steps
        assert all(s["grad_accum"] == 2 and s["source"] == "ddp" for s in steps)
        assert {s.get("samples") for s in steps} == {2 * c.batch}, steps
    _no_sddoctor_traceback(res)


@pytest.mark.parametrize("fault", ["kill", "raise"])
def test_a_dying_rank_is_named_at_its_line(runs: dict, fault: str) -> None:
    res, c = runs[fault], runs["client"]
    # 1: the launcher saw the rank die and stopped the job. 124: the dying rank lingered in its
    # process group's teardown, the others waited in their collective, and sddoctor stopped a hang
    # (a loaded machine makes that race likelier); the crash verdict names the rank either way.
    assert res.returncode in (1, 124), res.stderr[-3000:]
    (v,) = _verdicts(res, "crash")
    assert v["culprit_rank"] == 1, v
    assert v["location"] == c.line(c.forward), v
    others = [(x["kind"], x["culprit_rank"]) for x in res.report["verdicts"] if x["kind"] != "crash"]
    assert others == ([] if res.returncode == 1 else [("hang.missing_rank", 1)]), res.report["verdicts"]
    _no_sddoctor_traceback(res)


@pytest.mark.parametrize("fault", ["skip-grad", "skip-barrier"])
def test_a_missing_rank_is_named_where_it_really_is(runs: dict, fault: str) -> None:
    res, c = runs[fault], runs["client"]
    assert res.returncode == 124, res.stderr[-3000:]
    (v,) = _verdicts(res, "hang.missing_rank")
    assert v["culprit_rank"] == 1, v
    # rank 1 skipped the collective and is held where it goes on to: a skipped gradient bucket
    # inside that backward; a skipped barrier at the DDP model's next forward (before DDP's own
    # untraced collectives there could meet the peer's pending barrier)
    assert v["location"] == c.line(c.forward if fault == "skip-barrier" else c.backward), v
    expected_op = "barrier" if fault == "skip-barrier" else "all_reduce"
    assert v["details"]["op"] == expected_op and v["details"]["waiting_ranks"] == [0], v
    waited_at = c.line(c.barrier if fault == "skip-barrier" else c.backward)
    assert f"called at {waited_at}" in v["summary"], v
    # declared within the hang timeout (5 s) + 10 s of the last progress
    assert 5 <= v["details"]["stalled_seconds"] <= 5 + 10, v
    (fired,) = [f for f in res.report["ranks"]["1"]["faults"] if f.get("fault", "").startswith("skip")]
    assert fired["op"] == expected_op  # the skipped call was the kind this case is about
    stacks = res.run_dir / "stacks"
    assert (stacks / "rank-00000.json").exists() and (stacks / "rank-00001.json").exists()
    _no_sddoctor_traceback(res)


def test_a_straggler_is_in_the_final_report_with_its_own_line(runs: dict) -> None:
    res, c = runs["straggler"], runs["client"]
    assert res.returncode == 0, res.stderr[-3000:]
    (v,) = _verdicts(res, "straggler")
    assert v["culprit_rank"] == 1, v
    # the injected sleep fires as the step starts, at the model's forward: that is where its time goes
    assert v["location"] == c.line(c.forward), v
    assert v["details"]["unit"] == "step" and v["details"]["seconds_per_unit"] >= 0.25, v
    assert v["details"]["others_wait_share"] >= 0.5, v
    assert v["details"]["wait_site"] == c.line(c.backward), v
    assert "straggler: rank 1" in res.stderr  # the live warning said the same
    assert [x["kind"] for x in res.report["verdicts"]] == ["straggler"]
    # inferred steps: as many as the program's optimizer steps, on both ranks
    assert [s["step"] for s in _steps(res, 0)] == list(range(1, 66))
    _no_sddoctor_traceback(res)


def test_the_report_is_the_same_when_diagnosed_again(runs: dict) -> None:
    """`sddoctor report --rediagnose` reaches the live verdict from the run directory alone."""
    import subprocess
    import sys

    from conftest import subprocess_env

    for case in ("skip-grad", "kill", "straggler"):
        res = runs[case]
        out = subprocess.run([sys.executable, "-m", "sddoctor", "report", "--rediagnose", "--json", str(res.run_dir)],
                             env=subprocess_env(), capture_output=True, text=True, timeout=60)  # fmt: skip
        again = json.loads(out.stdout)
        live = res.report
        assert (again["outcome"], again["exit_code"]) == (live["outcome"], live["exit_code"]), case
        key = [(v["kind"], v["culprit_rank"], v["location"]) for v in live["verdicts"]]
        assert [(v["kind"], v["culprit_rank"], v["location"]) for v in again["verdicts"]] == key, case


def test_clients_are_user_code() -> None:
    """The programs call no sddoctor API: what the suite checks comes from the bootstrap alone."""
    for client in CLIENTS_BY_NAME.values():
        assert "sddoctor" not in Path(client.script).read_text()


def test_a_changed_shape_is_a_mismatch_at_the_users_line(runs: dict) -> None:
    if "shape-grad" not in runs:
        pytest.skip(f"run for {', '.join(ONLY['shape-grad'])} only")
    res, c = runs["shape-grad"], runs["client"]
    assert res.returncode == 124, res.stderr[-3000:]
    (v,) = _verdicts(res, "hang.mismatch")
    assert v["culprit_rank"] == 1 and v["location"] == c.line(c.backward), v
    _no_sddoctor_traceback(res)


def test_an_out_of_memory_error_is_an_oom_verdict(runs: dict) -> None:
    if "oom" not in runs:
        pytest.skip(f"run for {', '.join(ONLY['oom'])} only")
    res, c = runs["oom"], runs["client"]
    assert res.returncode in (1, 124), res.stderr[-3000:]
    (v,) = _verdicts(res, "oom")
    assert v["culprit_rank"] == 1 and v["location"] == c.line(c.forward), v
    assert not _verdicts(res, "crash")  # the OOM verdict replaces the crash of that rank
    _no_sddoctor_traceback(res)
