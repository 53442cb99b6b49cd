"""`sddoctor run` on the ways users launch and dress up a DDP program: what the user adds around
their loop (their own sys.excepthook, torch.distributed.elastic's @record) must not hide the
verdict, the culprit rank or the user's line. 2 ranks on CPU with gloo under torchrun.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from supervise_fixtures import Supervised, run_nodes, run_supervised, script_line, torchrun

from conftest import free_port, subprocess_env

SCRIPT = Path(__file__).resolve().parent / "launch_script.py"
HANG = ("--hang-timeout", "8", "--on-hang", "kill")


def _run(tmp_path: Path, *args: str, **env: str) -> Supervised:
    # a restarted gloo rank can wait for a peer that never connects: the start-up allowance ends it
    options = (*HANG, "--startup-timeout", "30")
    return run_supervised(tmp_path, torchrun(2, *args, str(SCRIPT)), options=options, env=env, timeout=180)


def _crash_of_rank_1_at_boom(res: Supervised) -> None:
    assert res.returncode in (1, 124), res.stderr[-3000:]
    (v,) = res.verdicts("crash")
    assert v["culprit_rank"] == 1, v
    assert v["location"] == script_line("# BOOM", SCRIPT), v
    assert "boom in user code" in v["summary"], v


@pytest.mark.parametrize("hook", ["1", "exit"], ids=["logging-hook", "hook-ending-in-os-exit"])
def test_an_exception_is_named_under_the_users_own_excepthook(tmp_path: Path, hook: str) -> None:
    # the script's hook replaces sddoctor's and never calls it, and may end the process itself with
    # os._exit(1) (no interpreter exit follows): the exception still counts
    res = _run(tmp_path, BOOM="3", EXCEPTHOOK=hook)
    _crash_of_rank_1_at_boom(res)
    (exc,) = res.events(1, "exception")
    assert exc["type"] == "RuntimeError" and exc["caller"] == script_line("# BOOM", SCRIPT), exc


@pytest.mark.parametrize(
    "env", [{"RECORD": "1"}, {"PYTHONFAULTHANDLER": "1"}], ids=["elastic-record", "PYTHONFAULTHANDLER"]
)
def test_a_native_crash_is_located_under_elastic_record(tmp_path: Path, env: dict[str, str]) -> None:
    # @record enables faulthandler on stderr, PYTHONFAULTHANDLER=1 does so as the interpreter starts:
    # the rank's fatal-signal dump must still be its own
    res = _run(tmp_path, SEGV="3", **env)
    assert res.returncode in (1, 124), res.stderr[-3000:]
    (v,) = res.verdicts("crash")
    assert v["culprit_rank"] == 1, v
    assert v["location"] == script_line("# SEGV", SCRIPT), v
    assert v["details"]["fatal"]["error"] == "Segmentation fault", v


@pytest.mark.slow  # up to the start-up timeout when the restarted gloo ranks cannot connect
@pytest.mark.parametrize("helper", ["", "1"], ids=["plain", "with-a-child-that-outlives-the-rank"])
def test_a_restart_after_a_rank_was_killed_names_that_rank(tmp_path: Path, helper: str) -> None:
    # torchrun --max-restarts 1: rank 1 is killed hard on the first attempt, rank 0 then loses its
    # peer; the restart is blamed on rank 1, not on rank 0's "connection reset by peer". (Whether the
    # second attempt runs is torch's matter: on gloo its ranks at times cannot connect.) A child that
    # inherited RANK=1 and outlives rank 1 is not taken for rank 1.
    res = _run(tmp_path, "--max-restarts=1", KILL="3", HELPER=helper)
    (v,) = res.verdicts("restarted")
    assert v["culprit_rank"] == 1, v
    assert "killed" in v["summary"] and v["details"]["attempt"] == 1, v
    assert not any(v["culprit_rank"] == 0 for v in res.verdicts("crash") if "reset by peer" in v["summary"])


@pytest.mark.slow  # as above
def test_a_restart_after_an_injected_kill_says_it_was_injected(tmp_path: Path) -> None:
    # the kill fault fires in each attempt; the first attempt's rank 1 leaves no exit record, and
    # the restart names the signal the fault sent and the line it fired at, not "killed hard?"
    res = _run(tmp_path, "--max-restarts=1", SDDOCTOR_FAULT="kill:rank=1,seq=6")
    (v,) = res.verdicts("restarted")
    assert v["culprit_rank"] == 1 and v["details"]["attempt"] == 1, v
    assert "was killed by signal 9 (SIGKILL) (injected by SDDOCTOR_FAULT)" in v["summary"], v
    assert "OOM killer" not in v["summary"], v
    assert v["location"] and v["location"].startswith(str(SCRIPT)), v


@pytest.mark.slow
def test_a_restart_leaves_the_health_waits_of_each_attempt_apart(tmp_path: Path) -> None:
    # the restarted processes number their collectives from 1 again: the time between the attempts
    # is no rank's wait for another
    res = _run(tmp_path, "--max-restarts=1", BOOM="3")
    (v,) = res.verdicts("restarted")
    assert v["culprit_rank"] == 1 and v["location"] == script_line("# BOOM", SCRIPT), v
    # the restart takes seconds (the launcher notices, stops the others, meets again); the tiny
    # model's ranks wait milliseconds for each other within an attempt
    for rank, health in res.report["health"]["ranks"].items():
        assert (health["waited_seconds"] or 0.0) < 2.0, (rank, health)
    # steps are counted per attempt too: the figures are the last attempt's, the earlier ones apart
    last_steps = []
    for rank, health in res.report["health"]["ranks"].items():
        log = [e for e in res.events(int(rank), "start") + res.events(int(rank), "step")]
        starts = sorted(e["t"] for e in log if e["kind"] == "start")
        steps = [e for e in log if e["kind"] == "step"]
        later = [e for e in steps if e["t"] >= starts[-1]]
        assert len(starts) == health["attempts"] == 2, (rank, health)
        assert 0 < health["earlier_steps"] == len(steps) - len(later), (rank, health)
        assert health["steps"] == len(later), (rank, health)
        last_steps.append(len(later))
    assert res.report["health"]["throughput"]["steps"] == max(last_steps), res.report["health"]["throughput"]


def test_torchruns_options_from_pet_variables_give_the_world(tmp_path: Path) -> None:
    # two nodes on 127.0.0.1, one rank each, whose node count and rank come from PET_NNODES and
    # PET_NODE_RANK (as a cluster's job script sets them): the world is 2, so a fault for rank 1 is
    # valid on both nodes, and rank 1's crash is named on its node
    master = free_port()
    nodes = {}
    for node in (0, 1):
        env = subprocess_env(PET_NNODES="2", PET_NODE_RANK=str(node), SDDOCTOR_FAULT="raise:rank=1,step=3")
        nodes[node] = [
            sys.executable, "-m", "sddoctor", "run", "--quiet", *HANG, "--port", "0",
            "--run-dir", str(tmp_path / f"node{node}"), "--",
            *torchrun(1, "--master-addr", "127.0.0.1", "--master-port", str(master), str(SCRIPT)),
        ], env  # fmt: skip
    codes = run_nodes(tmp_path, nodes, timeout=150)
    assert 2 not in codes.values(), (tmp_path / "node1.log").read_text()[-3000:]
    for node in (0, 1):
        run = json.loads((tmp_path / f"node{node}" / "run.json").read_text())
        assert (run["world_size"], run["node_rank"]) == (2, node), run
    report = json.loads((tmp_path / "node1" / "report.json").read_text())
    assert [(v["kind"], v["culprit_rank"]) for v in report["verdicts"]] == [("crash", 1)], report["verdicts"]


FAULTHANDLER_CALLS = """
import faulthandler, pathlib, sys
from sddoctor.instrument import exit_hooks
d = pathlib.Path(sys.argv[1])
assert exit_hooks.enable_fatal_dump(d / "rank.fatal")
faulthandler.enable()  # for stderr, as @record does: the rank's file stays
assert faulthandler.is_enabled() and "fatal_file" in exit_hooks._installed
faulthandler.disable()
faulthandler.enable()  # disabled, then on again for stderr: into the rank's file again
assert faulthandler.is_enabled() and "fatal_file" in exit_hooks._installed
faulthandler.enable(file=open(d / "mine.log", "w"))  # a file of the program's own: as asked
assert faulthandler.is_enabled() and "fatal_file" not in exit_hooks._installed
"""


def test_the_programs_faulthandler_calls_and_the_ranks_dump_file(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", FAULTHANDLER_CALLS, str(tmp_path)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_a_healthy_run_reports_ok_with_steps_and_exports_its_trace(tmp_path: Path) -> None:
    # inferred DDP steps follow each other within microseconds: their slices must nest for Perfetto
    res = _run(tmp_path, "--no-python", sys.executable, STEPS="20")
    assert res.returncode == 0 and res.report["outcome"] == "ok", res.stderr[-3000:]
    assert res.report["verdicts"] == [], res.report["verdicts"]
    for rank in (0, 1):
        assert [s["step"] for s in res.events(rank, "step")] == list(range(1, 21))
    out = tmp_path / "trace.json"
    done = subprocess.run(
        [sys.executable, "-m", "sddoctor", "trace", str(res.run_dir), "-o", str(out)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["traceEvents"]
