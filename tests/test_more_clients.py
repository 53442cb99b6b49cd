"""More DDP program shapes run unchanged under `sddoctor run` (2 ranks, CPU, gloo): DDP with
static_graph and an unused branch, torchelastic's @record with object collectives and a
monitored_barrier, ZeroRedundancyOptimizer, and a Lightning Fabric loop.

The runs start side by side in one module-scoped fixture (with the ZeRO program once more
without sddoctor, to compare its results); each test reads one report."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from client_fixtures import CLIENTS, assert_no_sddoctor_traceback
from supervise_fixtures import Supervised, run_side_by_side, run_supervised, script_line, torchrun

from conftest import subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STATIC = CLIENTS / "static_unused.py"
RECORD = CLIENTS / "record_metrics.py"
ZERO = CLIENTS / "zero_optimizer.py"
FABRIC = CLIENTS / "fabric_script.py"
SHORT_TIMEOUT = CLIENTS / "short_pg_timeout.py"
SLOW_LOADER = CLIENTS / "slow_loader.py"
HANG = ("--hang-timeout", "5", "--on-hang", "kill")
#: record_metrics with 10 steps: per 5 steps 5 gradient all-reduces, an all_gather_object (#6)
#: and a broadcast_object_list (#7); the monitored_barrier at the end is #15
RECORD_ENV = {"STEPS": "10", "METRICS_EVERY": "5"}
CASES: dict[str, tuple[Path, str | None, dict[str, str]]] = {
    # rank 1 stops before its third forward, where static_graph DDP rebuilds its buckets: rank 0
    # waits in the rebuild's broadcast, which DDP issues from C++
    "static-late": (STATIC, "sleep:rank=1,seconds=600,step=3", {"STEPS": "12"}),
    "decide-skip": (RECORD, "skip:rank=1,seq=7", RECORD_ENV),
    "monitored-skip": (RECORD, "skip:rank=1,seq=15", RECORD_ENV),
    # rank 1 sleeps before the monitored_barrier, whose 3 s timeout ends rank 0's wait (and the
    # job) before --hang-timeout (30 s here) does
    "monitored-timeout": (RECORD, "sleep:rank=1,seconds=600,seq=15", {**RECORD_ENV, "MONITOR_TIMEOUT": "3"}),
    # rank 1 stops at step 6 while rank 0's gradient all-reduce waits; gloo's 10 s timeout ends
    # rank 0 first: rank 1, in a sleep of its own, is stopped by torchrun's SIGTERM; rank 1, in an
    # all-reduce on a second group, fails there as rank 0's end closes the connection
    "stopped-in-sleep": (SHORT_TIMEOUT, None, {"STALL": "sleep"}),
    "held-in-other-group": (SHORT_TIMEOUT, None, {"STALL": "side"}),
    # rank 1's DataLoader workers read each sample 0.04 s: it waits for them every step
    "slow-loader": (SLOW_LOADER, None, {"STEPS": "200"}),
    "zero-healthy": (ZERO, None, {"STEPS": "12"}),
    "fabric-healthy": (FABRIC, None, {"STEPS": "12"}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Supervised | str]:
    root = tmp_path_factory.mktemp("more-clients")

    def one(name: str, where: Path) -> Supervised | str:
        if name == "zero-plain":  # the same program without sddoctor: its results to compare
            env = subprocess_env(OMP_NUM_THREADS="1", STEPS="12")
            cmd = [*torchrun(2, "--standalone", str(ZERO))]
            done = subprocess.run(cmd, env=env, cwd=where, capture_output=True, text=True, timeout=120)
            return done.stdout
        script, fault, extra = CASES[name]
        env = {"OMP_NUM_THREADS": "1", **extra}
        patient = name in ("monitored-timeout", "stopped-in-sleep", "held-in-other-group")
        options = ("--hang-timeout", "30") if patient else HANG
        return run_supervised(
            where,
            torchrun(2, "--standalone", str(script)),
            options=options,
            fault=fault,
            env=env,
            timeout=150,
        )

    return run_side_by_side(root, [*CASES, "zero-plain"], one)


def _run(runs: dict[str, Supervised | str], name: str) -> Supervised:
    res = runs[name]
    assert isinstance(res, Supervised)
    assert_no_sddoctor_traceback(res)
    return res


def test_a_rank_late_to_the_forward_that_rebuilds_ddps_buckets_is_named(runs: dict) -> None:
    """DDP rebuilds its buckets once, broadcasting their order from rank 0 in C++ (with
    static_graph at the third forward): rank 0 waits there, which is a collective, not 'no rank
    is in a collective'."""
    res = _run(runs, "static-late")
    assert res.returncode == 124, res.stderr[-3000:]
    (v,) = res.verdicts("hang.")
    assert (v["kind"], v["culprit_rank"]) == ("hang.missing_rank", 1), v
    assert v["location"] == script_line("# FORWARD", STATIC), v
    details = v["details"]
    assert (details["op"], details["pg"], details["seq"], details["waiting_ranks"]) == (
        "broadcast",
        "0:ddp",
        1,
        [0],
    )
    assert "DDP's bucket rebuild" in v["summary"] and "asleep in the injected fault" in v["summary"], v


def test_a_skipped_object_collective_holds_the_rank_in_it(runs: dict) -> None:
    """Skipped, broadcast_object_list would leave rank 1's list as it was and the program would
    fail reading it: a crash of the fault's own making. The rank stops in the call instead."""
    res = _run(runs, "decide-skip")
    assert res.returncode == 124, res.stderr[-3000:]
    (v,) = res.report["verdicts"]
    assert (v["kind"], v["culprit_rank"]) == ("hang.missing_rank", 1), v
    assert v["location"] == script_line("# DECIDE", RECORD), v
    assert "broadcast_object_list #7" in v["summary"], v
    assert "TypeError" not in (res.run_dir / "stderr.log").read_text()


def test_a_rank_held_at_exit_is_located_at_its_skipped_call(runs: dict) -> None:
    """Rank 1 skipped the final monitored_barrier and is held at exit, in sddoctor's atexit
    callback with no frame of the program's own: the location is the skipped call's line."""
    res = _run(runs, "monitored-skip")
    assert res.returncode == 124, res.stderr[-3000:]
    (v,) = res.verdicts("hang.")
    assert (v["kind"], v["culprit_rank"]) == ("hang.missing_rank", 1), v
    assert v["location"] == script_line("# MONITORED", RECORD), v
    assert "sddoctor" not in v["summary"].replace(str(CLIENTS), ""), v


def test_a_rank_asleep_when_monitored_barrier_gives_up_is_located_at_its_sleep(runs: dict) -> None:
    """monitored_barrier names rank 1 and ends the job; no stack was taken, so the line comes
    from the sleep rank 1 was in, not from its last completed collective."""
    res = _run(runs, "monitored-timeout")
    assert res.returncode == 1, res.stderr[-3000:]
    (v,) = res.report["verdicts"]
    assert (v["kind"], v["culprit_rank"], v["details"]["ended"]) == ("hang.missing_rank", 1, "timeout"), v
    assert v["location"] == script_line("# MONITORED", RECORD), v
    assert "monitoredBarrier" in v["summary"] and "asleep in the injected fault" in v["summary"], v


def test_a_rank_stopped_by_sigterm_is_located_where_it_was_stuck(runs: dict) -> None:
    """The process group's timeout ends rank 0 before any stack is taken, and torchrun stops rank 1
    with SIGTERM: rank 1's exit event says where its main thread was, and the verdict places it
    there, not at its last completed collective (the backward of step 5)."""
    res = _run(runs, "stopped-in-sleep")
    assert res.returncode == 1, res.stderr[-3000:]
    (v,) = res.verdicts("hang.")
    assert (v["kind"], v["culprit_rank"], v["details"]["ended"]) == ("hang.missing_rank", 1, "timeout"), v
    stuck = script_line("# STALL_SLEEP", SHORT_TIMEOUT)
    assert v["location"] == stuck, v
    assert f"it was at {stuck} in main() when SIGTERM stopped it" in v["summary"], v
    (exit_event,) = res.events(1, "exit")
    assert (exit_event["status"], exit_event["at"]) == ("signal", stuck), exit_event
    assert exit_event["stack"][-1] == f"{stuck} in main", exit_event


def test_a_rank_held_in_another_groups_call_is_located_there(runs: dict) -> None:
    """Rank 1 waits in an all-reduce on a second group that rank 0 never joins; rank 0's own
    timeout ends it, and rank 1's call fails as the connection closes: rank 1 is placed at that
    call, not at its last completed collective."""
    res = _run(runs, "held-in-other-group")
    assert res.returncode == 1, res.stderr[-3000:]
    (v,) = res.verdicts("hang.")
    assert (v["kind"], v["culprit_rank"], v["details"]["ended"]) == ("hang.missing_rank", 1, "timeout"), v
    stuck = script_line("# STALL_SIDE", SHORT_TIMEOUT)
    assert v["location"] == stuck, v
    assert f"it was in all_reduce #1 on group 1 at {stuck} until that call failed" in v["summary"], v


def test_a_straggler_that_waits_for_its_dataloader_is_placed_where_its_workers_spend_their_time(
    runs: dict,
) -> None:
    """Rank 1's main thread spends its time at `for ... in loader`, waiting; py-spy samples its
    worker processes too, and their busiest line, the slow read in `__getitem__`, is the verdict's."""
    res = _run(runs, "slow-loader")
    assert res.returncode == 0, res.stderr[-3000:]
    (v,) = res.verdicts("straggler")
    assert v["culprit_rank"] == 1, v
    assert v["location"] == script_line("# SLOW_READ", SLOW_LOADER), v
    loader = script_line("# LOADER", SLOW_LOADER)
    assert f"its time goes at {loader} in main()" in v["summary"], v
    assert "waiting for its DataLoader workers, whose time goes at" in v["summary"], v
    assert any("rank 1 waits for its DataLoader" in line for line in v["evidence"]), v
    assert v["details"]["cause"]["worker"]["function"] == "Samples.__getitem__", v


def test_zero_redundancy_optimizer_runs_healthy_and_unchanged(runs: dict) -> None:
    """Its step broadcasts each rank's shard of the parameters (asynchronous broadcasts); the
    steps are DDP's, and the weights end as they do without sddoctor."""
    res = _run(runs, "zero-healthy")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.report["outcome"] == "ok" and res.report["verdicts"] == [], res.report["verdicts"]
    for rank in (0, 1):
        steps = res.events(rank, "step")
        assert [s["step"] for s in steps] == list(range(1, 13))
        assert {(s.get("source"), s.get("samples")) for s in steps} == {("ddp", 16)}
    plain = runs["zero-plain"]
    assert isinstance(plain, str)
    checksum = re.compile(r"rank \d steps \d+ checksum \S+")
    assert sorted(checksum.findall(res.stdout)) == sorted(checksum.findall(plain)) != [], (res.stdout, plain)


def test_a_fabric_loop_runs_healthy_with_its_steps_counted(runs: dict) -> None:
    res = _run(runs, "fabric-healthy")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.report["outcome"] == "ok" and res.report["verdicts"] == [], res.report["verdicts"]
    for rank in (0, 1):
        steps = res.events(rank, "step")
        assert [s["step"] for s in steps] == list(range(1, 13))
        assert {s.get("samples") for s in steps} == {8}
    assert res.report["health"]["throughput"]["steps"] == 12


def test_a_hang_found_without_stacks_places_the_culprit_where_the_stop_found_it(tmp_path: Path) -> None:
    """With `--on-hang wait` no stack is taken: the hang is reported with rank 1 where its last
    state snapshot saw its main thread (its sleep). The user then presses Ctrl-C; the report adds
    the line rank 1 was stuck at when the job stopped, from how the rank ended."""
    res = run_supervised(
        tmp_path,
        torchrun(2, "--standalone", str(SHORT_TIMEOUT)),
        options=("--hang-timeout", "5", "--on-hang", "wait"),
        env={"OMP_NUM_THREADS": "1", "STALL": "sleep", "PG_TIMEOUT": "600"},
        interrupt_when_file=tmp_path / "run" / "report.json",
        timeout=120,
    )
    assert_no_sddoctor_traceback(res)
    assert res.returncode == 130 and res.report["outcome"] == "interrupted", res.stderr[-3000:]
    (v,) = res.verdicts("hang.")
    assert (v["kind"], v["culprit_rank"]) == ("hang.missing_rank", 1), v
    stuck = script_line("# STALL_SLEEP", SHORT_TIMEOUT)
    assert (v["location"], v["details"]["stopped_at"]) == (stuck, stuck), v
    assert (
        f"its main thread is at {stuck} in main()" in v["summary"]
        and "When the job was stopped, rank 1:" in v["summary"]
    ), v
