"""A rank whose process freezes, run for real under `sddoctor run` (`tests/clients/frozen_rank.py`,
2 ranks, CPU, gloo): stopped by SIGSTOP (as Ctrl-Z or a debugger would), or held in native code
that keeps the GIL. Neither can write another snapshot, so sddoctor must read the freeze from the
heartbeat and the peers, not from the frozen rank's own last word, and say which freeze it is.

A rank that freezes at step 3 froze before its first snapshot after start-up: that snapshot still
says "starting", and only the peers' completed all-reduces show that it got past its start-up (before,
the run waited out the 900 s start-up allowance with no verdict)."""

from __future__ import annotations

from pathlib import Path

import pytest
from client_fixtures import CLIENTS, assert_no_sddoctor_traceback
from supervise_fixtures import Supervised, run_side_by_side, run_supervised, script_line, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = CLIENTS / "frozen_rank.py"
CASES: dict[str, dict[str, str]] = {
    "stop-early": {"FREEZE": "stop", "FREEZE_AT": "3"},
    "gil-early": {"FREEZE": "gil", "FREEZE_AT": "3"},
    # after about 3 s of steps: the rank's snapshots have shown it training
    "gil-late": {"FREEZE": "gil", "FREEZE_AT": "120", "PAUSE": "0.03"},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Supervised]:
    root = tmp_path_factory.mktemp("frozen-rank")

    def one(name: str, where: Path) -> Supervised:
        job = torchrun(2, "--standalone", str(SCRIPT))
        options = ("--hang-timeout", "4", "--on-hang", "kill")
        return run_supervised(
            where, job, options=options, env={"OMP_NUM_THREADS": "1", **CASES[name]}, timeout=120
        )

    return run_side_by_side(root, CASES, one)


def _frozen_verdict(res: Supervised) -> dict:
    assert_no_sddoctor_traceback(res)
    assert res.returncode == 124, res.stderr[-3000:]
    (verdict,) = res.verdicts("hang")
    assert verdict["kind"] == "hang.missing_rank" and verdict["culprit_rank"] == 1, verdict
    assert verdict["details"]["frozen_ranks"] == [1], verdict["details"]
    assert "rank 0 waits in all_reduce" in verdict["summary"], verdict["summary"]
    assert verdict["details"]["stalled_seconds"] < 30, verdict["details"]  # not the start-up allowance
    return verdict


@pytest.mark.parametrize("name", ["stop-early"])
def test_a_stopped_rank_is_named_with_its_line_and_left_stopped_until_the_kill(runs: dict, name: str) -> None:
    verdict = _frozen_verdict(runs[name])
    assert verdict["location"] == script_line("# STOPPED", SCRIPT), verdict
    assert verdict["details"]["frozen_cause"] == "stopped"
    assert "its process is stopped (state T" in verdict["summary"], verdict["summary"]
    assert any("kill -CONT" in line for line in verdict["evidence"]), verdict["evidence"]
    stack = runs[name].report["ranks"]["1"]["stack"]
    assert stack["ok"] and stack["stopped"], stack  # read without attaching to it


@pytest.mark.parametrize("name", ["gil-early", "gil-late"])
def test_a_rank_held_in_native_code_with_the_gil_is_named_with_its_line(runs: dict, name: str) -> None:
    verdict = _frozen_verdict(runs[name])
    assert verdict["location"] == script_line("# GIL HELD", SCRIPT), verdict
    assert verdict["details"]["frozen_cause"] == "holds_gil"
    assert "holds the GIL in native code" in verdict["summary"], verdict["summary"]
    stack = runs[name].report["ranks"]["1"]["stack"]
    assert stack["main_holds_gil"] and not stack.get("stopped"), stack
