"""`sddoctor run` on the ways users launch and dress up a DDP program: what the user adds around
their loop (their own sys.excepthook, torch.distributed.elastic's @record) must not hide the
verdict, the culprit rank or the user's line. 2 ranks on CPU with gloo under torchrun.
"""

from __future__ import annotations

from pathlib import Path

from supervise_fixtures import Supervised, run_supervised, script_line, torchrun

SCRIPT = Path(__file__).resolve().parent / "launch_script.py"
HANG = ("--hang-timeout", "8", "--on-hang", "kill")


def _run(tmp_path: Path, *args: str, **env: str) -> Supervised:
    return run_supervised(tmp_path, torchrun(2, *args, str(SCRIPT)), options=HANG, env=env, timeout=180)


def _crash_of_rank_1_at_boom(res: Supervised) -> None:
    assert res.returncode in (1, 124), res.stderr[-3000:]
    (v,) = res.verdicts("crash")
    assert v["culprit_rank"] == 1, v
    assert v["location"] == script_line("# BOOM", SCRIPT), v
    assert "boom in user code" in v["summary"], v


def test_an_exception_is_named_under_the_users_own_excepthook(tmp_path: Path) -> None:
    # the script's hook replaces sddoctor's and never calls it: the exception still counts
    res = _run(tmp_path, BOOM="3", EXCEPTHOOK="1")
    _crash_of_rank_1_at_boom(res)
    (exc,) = res.events(1, "exception")
    assert exc["type"] == "RuntimeError" and exc["caller"] == script_line("# BOOM", SCRIPT), exc


def test_a_native_crash_is_located_under_elastic_record(tmp_path: Path) -> None:
    # @record enables faulthandler on stderr; the rank's fatal-signal dump must still be its own
    res = _run(tmp_path, SEGV="3", RECORD="1")
    assert res.returncode in (1, 124), res.stderr[-3000:]
    (v,) = res.verdicts("crash")
    assert v["culprit_rank"] == 1, v
    assert v["location"] == script_line("# SEGV", SCRIPT), v
    assert v["details"]["fatal"]["error"] == "Segmentation fault", v
