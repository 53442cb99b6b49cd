"""Every rank computing outside any collective (an evaluation pass, say) is progress, not a hang:
real 2-rank gloo runs under `sddoctor run --hang-timeout 4` that pause training for 10 s.
Blocked ranks (a read that waits) still make a stall, and one rank computing while the other
waits for it in a collective is still that rank's hang."""

from __future__ import annotations

import pytest
from client_fixtures import CLIENTS
from supervise_fixtures import run_supervised, script_line, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PAUSE = CLIENTS / "evaluation_pause.py"
WAIT = ("--hang-timeout", "4", "--on-hang", "dump")


def run_pause(tmp_path, **env: str):
    return run_supervised(
        tmp_path,
        torchrun(2, str(PAUSE)),
        options=WAIT,
        env={"OMP_NUM_THREADS": "1", "EVAL": "10", **env},
        timeout=120,
    )


def test_every_rank_evaluating_for_longer_than_the_hang_timeout_is_no_hang(tmp_path) -> None:
    run = run_pause(tmp_path, MODE="compute")
    assert run.returncode == 0, run.stderr[-3000:]
    report = run.report
    assert report["outcome"] == "ok"
    assert [v["kind"] for v in report["verdicts"]] == [], report["verdicts"]
    assert all(r["step"] == 12 for r in report["ranks"].values())


def test_every_rank_blocked_for_longer_than_the_hang_timeout_is_a_stall(tmp_path) -> None:
    run = run_pause(tmp_path, MODE="block")
    assert run.returncode == 0, run.stderr[-3000:]
    (stall,) = [v for v in run.report["verdicts"] if v["kind"].startswith("hang")]
    assert stall["kind"] == "hang.unknown" and stall["severity"] == "warning"
    assert stall["summary"].startswith("stall, resolved")


def test_one_rank_evaluating_while_the_other_waits_for_it_is_that_ranks_hang(tmp_path) -> None:
    run = run_pause(tmp_path, MODE="compute", ONLY="0")
    assert run.returncode == 0, run.stderr[-3000:]
    (hang,) = [v for v in run.report["verdicts"] if v["kind"].startswith("hang")]
    assert hang["kind"] == "hang.missing_rank" and hang["culprit_rank"] == 0
    evaluating = script_line("score += float(", PAUSE)
    assert hang["location"] == evaluating, hang
