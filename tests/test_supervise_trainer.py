"""`sddoctor run` on the bundled trainer: real 2-rank gloo runs of the tiny preset, one per fault.

The trainer's import and start-up (torch, diffusers, models) dominate each run, so the runs start
side by side in one module-scoped fixture and the tests only read their reports. Every run goes
through `run_supervised`, which fails if any process outlives sddoctor.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from supervise_fixtures import Supervised, run_supervised, script_line

from conftest import REPO_ROOT, subprocess_env

pytestmark = pytest.mark.slow

TRAIN_PY = REPO_ROOT / "trainer" / "train.py"
OBJECTIVE_PY = REPO_ROOT / "trainer" / "objective.py"
PROGRESS_PY = REPO_ROOT / "trainer" / "progress.py"
TRAINER_DIR = str(REPO_ROOT / "trainer") + "/"
MAX_STEPS = 8
# Short and quiet: no VAE fit, no latent cache, no samples, checkpoint or export at the end; the
# trainer's own stop-signal agreement (two all_reduces) every step gives the tracer collectives.
SMALL = [
    "--set",
    f"train.max_steps={MAX_STEPS}",
    "train.log_every=1",
    "train.micro_batch=2",
    "model.vae_warmup_steps=0",
    "data.max_samples=32",
    "data.cache=false",
    "sample.at_end=false",
    "checkpoint.at_end=false",
    "output.export=false",
]
TRAINER = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
TRAINER += ["-m", "trainer", *SMALL]
PATIENT = ("--hang-timeout", "10", "--on-hang", "kill")

# name -> (SDDOCTOR_FAULT, sddoctor run options)
RUNS: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "healthy": (None, PATIENT),
    "kill": ("kill:rank=1,step=3", PATIENT),
    "raise": ("raise:rank=0,step=2", PATIENT),
    # seq 3 = the second all_reduce of step 1's stop-signal agreement (see the test below).
    "skip": ("skip:rank=1,seq=3", ("--hang-timeout", "4", "--on-hang", "kill")),
    # 1 s per step on rank 1 from step 2 on: well above twice the others' compute even on a busy
    # machine, for long enough (24 steps) that sddoctor declares it live and samples where it goes.
    "sleep": ("sleep:rank=1,seconds=1,step=2,every=1", PATIENT),
}
#: more trainer options per run (a later --set wins)
EXTRA = {"sleep": ["--set", "train.max_steps=24"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("trainer-runs")

    def supervised(name: str) -> Supervised:
        fault, options = RUNS[name]
        where = root / name
        where.mkdir()
        return run_supervised(
            where, TRAINER + EXTRA.get(name, []), options=options, fault=fault, env={"OMP_NUM_THREADS": "1"},
            timeout=240,
        )  # fmt: skip

    def own_run() -> tuple[subprocess.CompletedProcess[str], Path]:
        """The trainer alone (no sddoctor run): it writes its own run directory."""
        out = root / "own"
        proc = subprocess.run(
            [*TRAINER, "--output-dir", str(out)],
            cwd=root,
            env=subprocess_env(OMP_NUM_THREADS="1"),
            capture_output=True,
            text=True,
            timeout=240,
        )
        return proc, out

    with ThreadPoolExecutor(max_workers=len(RUNS) + 1) as pool:
        futures = {name: pool.submit(supervised, name) for name in RUNS}
        own = pool.submit(own_run)
        results: dict[str, Any] = {name: f.result() for name, f in futures.items()}
        results["own"] = own.result()
    return results


def _only(res: Supervised, kind_prefix: str) -> dict[str, Any]:
    found = res.verdicts(kind_prefix)
    assert len(found) == 1, json.dumps(res.report["verdicts"], indent=1)
    return found[0]


def test_healthy_trainer_run_has_no_verdict(runs):
    res = runs["healthy"]
    assert res.returncode == 0, res.stderr
    assert res.report["verdicts"] == [], res.report["verdicts"]
    assert res.report["outcome"] == "ok"
    assert set(res.report["ranks"]) == {"0", "1"}
    assert all(r["step"] == MAX_STEPS for r in res.report["ranks"].values())
    events = [
        json.loads(line) for line in (res.run_dir / "ranks" / "rank-00000.jsonl").read_text().splitlines()
    ]
    (replicas,) = [e for e in events if e["kind"] == "replicas"]
    assert replicas["step"] == MAX_STEPS and len(replicas["params_sha256"]) == 64
    assert "no problem found" in res.stderr


def test_killed_trainer_rank_is_a_crash_of_that_rank(runs):
    res = runs["kill"]
    assert res.returncode != 0
    v = _only(res, "crash")
    assert v["culprit_rank"] == 1
    assert v["details"]["exit"]["signal"] == 9 and "SIGKILL" in v["summary"]
    assert v["location"].startswith(TRAINER_DIR), v["location"]
    assert v["details"]["consequences"] == [0]  # rank 0 stopped because rank 1 died: not blamed
    assert res.verdicts("hang") == []


def test_trainer_exception_is_a_crash_with_traceback(runs):
    res = runs["raise"]
    assert res.returncode != 0
    v = _only(res, "crash")
    assert v["culprit_rank"] == 0
    assert "InjectedFault" in v["summary"]
    assert v["location"].startswith(TRAINER_DIR), v["location"]
    frames = v["details"]["traceback"]
    assert any(str(TRAIN_PY) in f for f in frames), frames  # through the training loop
    assert any(v["location"] in f for f in frames)


def test_trainer_rank_that_skips_a_collective_is_a_missing_rank_hang(runs):
    res = runs["skip"]
    assert res.returncode == 124, res.stderr
    v = _only(res, "hang.")
    assert v["kind"] == "hang.missing_rank"
    assert v["culprit_rank"] == 1
    assert v["details"]["seq"] == 3 and v["details"]["waiting_ranks"] == [0]
    # Collective #3 on the default group is the second all_reduce of step 1's logging interval (one
    # collective of the set-up comes before, then two per step with log_every=1): rank 0 waits in
    # it. Rank 1 went on and blocks in the next training step: its location comes from its stack.
    assert f"(called at {script_line('dist.all_reduce(flag', TRAIN_PY)})" in v["summary"], v["summary"]
    assert v["location"].startswith(str(OBJECTIVE_PY) + ":"), v["location"]
    assert res.verdicts("crash") == []  # the ranks sddoctor killed are not crashes
    assert (res.run_dir / "stacks" / "rank-00001.json").exists()


def test_slow_trainer_rank_is_a_straggler(runs):
    res = runs["sleep"]
    assert res.returncode == 0, res.stderr
    v = _only(res, "straggler")
    assert v["culprit_rank"] == 1
    assert v["details"]["ratio"] >= 2.0
    # Where its time goes: the injected sleep fires inside sdi.step, which the trainer's step
    # reporter calls; py-spy's samples of rank 1 land on that line.
    assert v["location"] == script_line("sdi.step(step, loss=float(loss)", PROGRESS_PY), v
    # Where the others wait for it: the first collective after the sleep, the logging interval's
    # all-reduce of the mean loss (log_every=1).
    assert v["details"]["wait_site"] == script_line("dist.all_reduce(mean)", TRAIN_PY), v
    assert "straggler: rank 1" in res.stderr  # declared live
    assert [x["kind"] for x in res.report["verdicts"]] == ["straggler"]


def test_report_on_the_trainers_own_run_dir(runs):
    proc, out = runs["own"]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "run.json").exists() and not (out / "report.json").exists()
    report = subprocess.run(
        [sys.executable, "-m", "sddoctor", "report", str(out)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert report.returncode == 0, report.stdout + report.stderr
    assert "no problem found" in report.stdout and "diagnosed from the run directory" in report.stdout
    as_json = subprocess.run(
        [sys.executable, "-m", "sddoctor", "report", "--json", str(out)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    data = json.loads(as_json.stdout)
    assert data["outcome"] == "ok" and data["verdicts"] == []
    assert set(data["ranks"]) == {"0", "1"} and data["diagnosed_offline"] is True
    assert data["ranks"]["0"]["step"] == MAX_STEPS
