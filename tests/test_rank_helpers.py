"""Ranks with helpers, run unchanged under `sddoctor run` (`tests/clients/rank_helpers.py`, 2
ranks, CPU, gloo): forked multiprocessing workers, a background thread with collectives of its
own, a Work left pending on purpose, and a bug every rank shares. What sddoctor adds to a rank
must not end it, progress on a thread must not hide a stuck rank, and a verdict must not blame
one rank for what all ranks did.

The runs start side by side in one module-scoped fixture; each test reads one report."""

from __future__ import annotations

from pathlib import Path

import pytest
from client_fixtures import CLIENTS, assert_no_sddoctor_traceback
from supervise_fixtures import Supervised, run_side_by_side, run_supervised, script_line, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = CLIENTS / "rank_helpers.py"
KILL = ("--hang-timeout", "4", "--on-hang", "kill")
CASES: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "pool": ({"POOL": "1"}, KILL),
    # rank 1 stuck 60 s reading a batch; both meter threads go on all-reducing meanwhile
    "stuck-behind-thread": ({"METER": "1", "STALL": "60"}, KILL),
    # the same stall for 8 s, twice, with --on-hang dump: each diagnosed at 4 s, then the job goes on
    "stall-resolved": ({"METER": "1", "STALL": "8", "STALL_STEPS": "5,15"}, ("--hang-timeout", "4")),
    "exit0": ({"EXIT_AT": "5"}, KILL),
    "thread-dies": ({"METER": "1", "THREAD_DIES": "1", "STEPS": "120"}, KILL),
    "uploader-dies": ({"UPLOADER_DIES": "1"}, KILL),
    "prefetch-dies": ({"PREFETCH": "dies"}, KILL),
    "prefetch-stuck": ({"PREFETCH": "stuck"}, KILL),
    # rank 0's irecv stays pending for the whole loop (about 6 s, longer than the hang timeout)
    "pending-irecv": ({"PENDING": "1", "STEPS": "60"}, KILL),
    "unused": ({"UNUSED": "1"}, KILL),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Supervised]:
    root = tmp_path_factory.mktemp("rank-helpers")

    def one(name: str, where: Path) -> Supervised:
        env, options = CASES[name]
        job = torchrun(2, "--standalone", str(SCRIPT))
        return run_supervised(where, job, options=options, env={"OMP_NUM_THREADS": "1", **env}, timeout=150)

    return run_side_by_side(root, CASES, one)


def _run(runs: dict[str, Supervised], name: str, returncode: int) -> Supervised:
    res = runs[name]
    assert_no_sddoctor_traceback(res)
    assert res.returncode == returncode, res.stderr[-3000:]
    return res


def test_a_pool_that_terminates_its_forked_workers_leaves_the_ranks_alone(runs: dict) -> None:
    """`Pool.__exit__` sends SIGTERM to its workers, which inherited the rank's signal set-up:
    the rank must neither die of it nor have its workers' ends recorded as its own."""
    res = _run(runs, "pool", 0)
    assert res.report["outcome"] == "ok" and res.report["verdicts"] == [], res.report["verdicts"]
    assert res.stdout.count("done") == 2, res.stdout
    for rank in (0, 1):
        exits = res.events(rank, "exit")
        assert [(e["status"], e["code"]) for e in exits] == [("ok", 0)], exits


def test_a_rank_stuck_while_its_thread_keeps_collectives_going_is_a_hang(runs: dict) -> None:
    """The meter threads' all-reduces are progress of a kind, but rank 0 has waited in one
    all-reduce for the hang timeout: rank 1 is named, at the line where it is stuck."""
    res = _run(runs, "stuck-behind-thread", 124)
    (v,) = res.verdicts("hang")
    assert (v["kind"], v["culprit_rank"]) == ("hang.missing_rank", 1), v
    assert v["location"] == script_line("# marker: stuck read", SCRIPT), v
    assert v["details"]["waiting_ranks"] == [0], v
    assert "while other work went on" in res.stderr, res.stderr[-2000:]
    assert not res.verdicts("straggler"), res.report["verdicts"]


def test_stalls_that_resolve_are_warnings_each_kept_and_the_job_keeps_its_exit_code(runs: dict) -> None:
    res = _run(runs, "stall-resolved", 0)
    stalls = res.verdicts("hang")
    assert [v["details"]["seq"] for v in stalls] == [5, 15], stalls
    for v in stalls:
        assert v["severity"] == "warning" and v["details"]["resolved"] is True, v
        assert v["summary"].startswith("stall, resolved after more than"), v
        assert v["culprit_rank"] == 1 and v["location"] == script_line("# marker: stuck read", SCRIPT), v
    assert res.stdout.count("done") == 2, res.stdout
    assert not res.verdicts("straggler"), res.report["verdicts"]  # two stalls, not a straggler
    # each stall keeps its own stacks: the first's were set aside before the second's dump
    first, second = stalls
    assert first["details"]["stacks_dir"] == "stacks/stall-1", first
    assert "the stacks taken during this stall are in stacks/stall-1/" in first["evidence"], first
    assert "stacks_dir" not in second["details"], second  # the last dump stays in stacks/
    marker = script_line("# marker: stuck read", SCRIPT)
    for folder in (res.run_dir / "stacks" / "stall-1", res.run_dir / "stacks"):
        assert marker in (folder / "rank-00001.txt").read_text(), folder
    assert (res.run_dir / "stacks" / "stall-1" / "rank-00000.txt").stat().st_mtime < (
        res.run_dir / "stacks" / "rank-00000.txt"
    ).stat().st_mtime


def test_a_rank_that_leaves_by_os_exit_is_named_with_its_exit_line(runs: dict) -> None:
    res = _run(runs, "exit0", 1)
    (v,) = res.report["verdicts"]
    assert (v["kind"], v["culprit_rank"]) == ("exited_early", 1), v
    assert v["details"]["exit_call"] == script_line("# marker: os exit", SCRIPT), v
    assert f"Rank 1 ended itself at {v['details']['exit_call']}" in v["summary"], v


def test_a_thread_that_died_is_named_as_the_cause_of_its_peers_wait(runs: dict) -> None:
    """Rank 1's meter thread raised; rank 1 trains on, rank 0's meter waits for it forever."""
    res = _run(runs, "thread-dies", 124)
    (v,) = res.verdicts("hang")
    assert (v["kind"], v["culprit_rank"]) == ("hang.missing_rank", 1), v
    assert v["location"] == script_line("# marker: thread dies", SCRIPT), v
    assert v["details"]["thread_exception"]["type"] == "RuntimeError", v
    assert "metrics endpoint unreachable" in v["summary"], v
    (warning,) = [w for w in res.events(1, "warning") if w["code"] == "thread_exception"]
    assert warning["thread"] and warning["caller"] == v["location"], warning
    assert not res.verdicts("thread."), res.report["verdicts"]  # the hang names it: not said twice


def test_a_main_thread_waiting_for_its_dead_prefetch_thread_is_placed_at_the_threads_error(
    runs: dict,
) -> None:
    """Rank 1's prefetch thread raised; its main thread waits in Queue.get for a batch that never
    comes. The thread issued no collective (the main loop, in the same file, did), so the verdict
    says the main thread waits for it, not that the thread's calls stopped."""
    res = _run(runs, "prefetch-dies", 124)
    (v,) = res.verdicts("hang")
    assert (v["kind"], v["culprit_rank"]) == ("hang.missing_rank", 1), v
    assert v["location"] == script_line("# marker: prefetch raises", SCRIPT), v
    assert "waits in Queue.get() for another thread of its own" in v["summary"], v
    assert "shard 5 unreadable" in v["summary"] and "issued these calls" not in v["summary"], v


def test_a_main_thread_waiting_for_its_stuck_prefetch_thread_names_where_that_thread_is(runs: dict) -> None:
    res = _run(runs, "prefetch-stuck", 124)
    (v,) = res.verdicts("hang")
    assert (v["kind"], v["culprit_rank"]) == ("hang.missing_rank", 1), v
    assert v["location"] == script_line("# marker: queue get", SCRIPT), v
    stuck = script_line("# marker: prefetch stuck", SCRIPT)
    assert f"thread 'prefetch' is at {stuck} in prefetch()" in v["summary"], v
    assert v["details"]["awaited_threads"] == [
        {"name": "prefetch", "frame": stuck, "function": "prefetch"}
    ], v


def test_a_thread_that_died_while_its_rank_went_on_is_a_warning_of_its_own(runs: dict) -> None:
    """Rank 1's upload thread raised; nothing waited for it, so the job ends healthy, but what the
    thread did stopped, and only stderr said so."""
    res = _run(runs, "uploader-dies", 0)
    (v,) = res.report["verdicts"]
    assert (v["kind"], v["severity"], v["culprit_rank"]) == ("thread.died", "warning", 1), v
    assert v["location"] == script_line("# marker: upload raises", SCRIPT), v
    assert (v["details"]["thread"], v["details"]["type"]) == ("uploader", "OSError"), v
    assert "bucket 'runs' not found" in v["summary"], v
    assert res.report["outcome"] == "ok", res.report["outcome"]


def test_a_work_left_pending_on_purpose_is_not_a_hang(runs: dict) -> None:
    res = _run(runs, "pending-irecv", 0)
    assert res.report["outcome"] == "ok" and res.report["verdicts"] == [], res.report["verdicts"]


def test_an_error_every_rank_raises_is_not_blamed_on_one(runs: dict) -> None:
    """DDP's unused-parameter error comes out of every rank's second forward: the verdict says
    the other rank raised it too instead of calling it a consequence."""
    res = _run(runs, "unused", 1)
    (v,) = res.verdicts("crash")
    assert v["location"] == script_line("# marker: unused forward", SCRIPT), v
    other = 1 - v["culprit_rank"]
    assert v["details"]["same_error"] == [other] and v["details"]["consequences"] == [], v
    assert f"rank {other} raised the same RuntimeError itself" in v["summary"], v
    assert "consequence" not in v["summary"], v
