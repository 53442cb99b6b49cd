"""Classic user mistakes that hang a DDP job, with no fault injected: one plain DDP program
(`tests/clients/user_bugs.py`, 2 ranks, CPU, gloo, an MLP with a BatchNorm so that every training
forward broadcasts DDP's buffers) with the mistake switched on by BUG. Each verdict must be true:
its kind, the rank off the common path and the user's own line.

The runs start side by side in one module-scoped fixture; each test reads one report."""

from __future__ import annotations

from pathlib import Path

import pytest
from client_fixtures import CLIENTS, assert_no_sddoctor_traceback
from supervise_fixtures import Supervised, run_side_by_side, run_supervised, script_line, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = CLIENTS / "user_bugs.py"
#: 2 epochs of 8 steps; the bugs fire at step 4 (after 3 whole steps: a routine seen 3 times)
BASE = {"OMP_NUM_THREADS": "1", "STEPS": "8", "AT": "4"}
CASES: dict[str, dict[str, str]] = {
    "healthy": {},
    "val_rank0": {"BUG": "val_rank0"},
    "nan_skip": {"BUG": "nan_skip"},
    "except_skip": {"BUG": "except_skip"},
    "uneven": {"BUG": "uneven"},
    "slow_save": {"BUG": "slow_save"},
    "order": {"BUG": "order", "SAME_SHAPES": "1"},
    "early_exit": {"BUG": "early_exit"},
    "reduce_op": {"BUG": "reduce_op"},
    "breakpoint": {"BUG": "breakpoint"},
    "dtype": {"BUG": "dtype"},
    "root": {"BUG": "root"},
    "group_rank0": {"BUG": "group_rank0"},
    "caught": {"BUG": "caught"},
    "caught_log": {"BUG": "caught_log"},
    "prompt": {"BUG": "prompt"},
    "model": {"BUG": "model"},
    "caught_barrier": {"BUG": "caught_barrier"},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Supervised]:
    root = tmp_path_factory.mktemp("user-bugs")

    def one(name: str, where: Path) -> Supervised:
        job = torchrun(2, "--standalone", str(SCRIPT))
        options = ("--hang-timeout", "5", "--on-hang", "kill")
        return run_supervised(where, job, options=options, env={**BASE, **CASES[name]}, timeout=150)

    return run_side_by_side(root, CASES, one, workers=3)


def _run(runs: dict[str, Supervised], name: str, returncode: int = 124) -> Supervised:
    res = runs[name]
    assert_no_sddoctor_traceback(res)
    assert res.returncode == returncode, res.stderr[-3000:]
    return res


def _verdict(res: Supervised) -> dict:
    (v,) = res.report["verdicts"]
    return v


def test_the_healthy_program_ends_ok_with_every_step(runs: dict) -> None:
    res = _run(runs, "healthy", 0)
    assert res.report["outcome"] == "ok" and res.report["verdicts"] == [], res.report["verdicts"]
    assert [res.report["health"]["ranks"][r]["steps"] for r in "01"] == [16, 16]


def test_a_validation_forward_on_rank_0_only_names_rank_0_there(runs: dict) -> None:
    """Without torch.no_grad() the DDP forward broadcasts the BatchNorm buffers: rank 0's extra
    broadcast meets rank 1's next training forward, and the ranks are one call apart after it."""
    v = _verdict(_run(runs, "val_rank0"))
    assert (v["kind"], v["culprit_rank"]) == ("hang.mismatch", 0), v
    assert v["location"] == script_line("# VALIDATION", SCRIPT), v
    assert v["details"]["parted_at"]["odd_ranks"] == [0], v


@pytest.mark.parametrize("name", ["nan_skip", "except_skip"])
def test_a_batch_skipped_before_its_backward_on_one_rank_names_that_rank(runs: dict, name: str) -> None:
    """Rank 1 drops a batch after its forward (a `continue` on a non-finite loss, or in an
    `except`): its next forward's buffer broadcast meets rank 0's gradient all-reduce. Both ranks
    call both sites; rank 1's own record shows the backward it skipped."""
    v = _verdict(_run(runs, name))
    assert (v["kind"], v["culprit_rank"]) == ("hang.mismatch", 1), v
    assert v["location"] == script_line("# FORWARD", SCRIPT), v
    assert v["details"]["left_routine"]["usual"]["caller"] == script_line("# BACKWARD", SCRIPT), v
    assert "rank 1 ran a training forward without its backward" in v["summary"], v


def test_uneven_shards_show_the_ranks_steps(runs: dict) -> None:
    """Rank 1's shard has a batch more: rank 0 leaves the loop for the epoch's metric all-reduce
    while rank 1 trains on. The rank that left is named where it went (as for uneven inputs
    ending at a barrier), and the step counts show the difference."""
    v = _verdict(_run(runs, "uneven"))
    assert (v["kind"], v["culprit_rank"]) == ("hang.mismatch", 0), v
    assert v["location"] == script_line("# EPOCH METRIC", SCRIPT), v
    assert "(rank 1 is in its step 9, rank 0 finished 8)" in v["summary"], v
    assert "uneven inputs" in v["summary"] and "only some ranks reach" in v["summary"], v


def test_a_slow_checkpoint_on_rank_0_names_its_save_line(runs: dict) -> None:
    v = _verdict(_run(runs, "slow_save"))
    assert (v["kind"], v["culprit_rank"]) == ("hang.missing_rank", 0), v
    assert v["location"] == script_line("# SLOW SAVE", SCRIPT), v
    assert (v["details"]["op"], v["details"]["waiting_ranks"]) == ("barrier", [1]), v
    assert f"called at {script_line('# BARRIER', SCRIPT)}" in v["summary"], v


def test_collectives_in_a_different_order_name_no_rank(runs: dict) -> None:
    """Rank 0 all-reduces then broadcasts, rank 1 the other way round (equal shapes: gloo waits
    instead of aborting). Neither rank is more wrong than the other."""
    v = _verdict(_run(runs, "order"))
    assert (v["kind"], v["culprit_rank"]) == ("hang.mismatch", None), v
    assert v["details"]["parted_at"]["odd_ranks"] == [0, 1], v
    assert "the ranks took different branches" in v["summary"], v


def test_a_rank_that_leaves_early_is_named_not_the_one_that_lost_it(runs: dict) -> None:
    v = _verdict(_run(runs, "early_exit", 1))
    assert (v["kind"], v["culprit_rank"]) == ("exited_early", 1), v
    assert v["details"]["consequences"] == [0], v


def test_a_different_reduce_op_on_one_rank_is_found_though_nothing_failed(runs: dict) -> None:
    """Rank 1 reduces the epoch metric with MAX, rank 0 with SUM: the all-reduce completes on both
    and the job ends 0; the report says which call, what each rank passed and where."""
    res = _run(runs, "reduce_op", 0)
    v = _verdict(res)
    assert (v["kind"], v["severity"], v["culprit_rank"]) == ("collective.mismatch", "error", None), v
    passed = v["details"]["passed"]
    assert passed["0"]["sig"] == "float32[2] SUM" and passed["1"]["sig"] == "float32[2] MAX", v
    assert passed["0"]["caller"] == script_line("# EPOCH METRIC", SCRIPT), v
    assert passed["1"]["caller"] == script_line("# METRIC MAX", SCRIPT), v
    assert v["details"]["calls"] == 2, v  # one per epoch
    assert "all_reduce #" in v["summary"] and "nothing failed" in v["summary"], v


def test_a_different_dtype_of_the_same_width_is_found(runs: dict) -> None:
    v = _verdict(_run(runs, "dtype", 0))
    assert v["kind"] == "collective.mismatch", v
    passed = v["details"]["passed"]
    assert (passed["0"]["sig"], passed["1"]["sig"]) == ("float32[2] SUM", "int32[2] SUM"), v
    assert passed["0"]["caller"] == passed["1"]["caller"] == script_line("# EPOCH METRIC", SCRIPT), v


def test_a_breakpoint_left_in_a_rank_is_said_to_be_one(runs: dict) -> None:
    """`breakpoint()` in a rank without a terminal: pdb reads end-of-input at the next line and
    raises BdbQuit, whose message is empty. The crash says what that means and how to debug a rank."""
    res = runs["breakpoint"]
    assert_no_sddoctor_traceback(res)
    assert res.returncode == 1, res.stderr[-3000:]
    (crash,) = res.verdicts("crash")
    assert (crash["culprit_rank"], crash["location"]) == (1, script_line("# AFTER BREAKPOINT", SCRIPT)), crash
    assert "raised BdbQuit at" in crash["summary"] and "pdb read end-of-input" in crash["summary"], crash
    assert crash["details"]["known_error"]["code"] == "debugger_without_terminal"
    assert "torch.distributed.breakpoint(rank=N)" in crash["evidence"][-1]


def test_a_broadcast_whose_root_differs_per_rank_is_a_mismatch_at_its_line(runs: dict) -> None:
    """`dist.broadcast(t, src=rank)`: each rank waits to send to the others, with the same op and
    shapes. The roots tell them apart; the line every rank called is where the fix goes."""
    v = _verdict(_run(runs, "root", 124))
    assert (v["kind"], v["culprit_rank"]) == ("hang.mismatch", None), v
    assert v["location"] == script_line("# ROOT FROM RANK", SCRIPT), v
    assert "root 0 at" in v["summary"] and "root 1 at" in v["summary"], v
    assert "passed different roots" in v["summary"], v
    assert {c["root"] for c in v["details"]["calls"].values()} == {0, 1}, v


def test_a_group_only_one_rank_creates_names_that_rank_inside_new_group(runs: dict) -> None:
    """new_group under `if rank == 0`: rank 0 waits inside it for rank 1, which waits in the next
    all-reduce. The verdict says new_group must be called by every rank."""
    v = _verdict(_run(runs, "group_rank0", 124))
    assert (v["kind"], v["culprit_rank"]) == ("hang.missing_rank", 0), v
    assert v["location"] == script_line("# GROUP ON RANK 0", SCRIPT), v
    assert "it waits inside new_group(), which every rank of the parent group must call" in v["summary"], v


@pytest.mark.parametrize("name", ["caught", "caught_log"])
def test_an_error_the_program_catches_does_not_make_the_run_ok(runs: dict, name: str) -> None:
    """Rank 1 raises; the script's own `except Exception` reports it (a printed traceback, or
    logger.exception then sys.exit(0)) and ends 0. Rank 0's next gradient all-reduce fails ("connection
    closed by peer"), which it catches the same way: every rank ends 0. The run is still a failure,
    rank 1 left first, at the line that raised."""
    res = _run(runs, name, 1)
    assert res.report["outcome"] == "failed" and res.report["job_exit_code"] == 0, res.report["verdicts"]
    v = _verdict(res)
    assert (v["kind"], v["culprit_rank"]) == ("exited_early", 1), v
    assert v["location"] == script_line("# BAD SAMPLE", SCRIPT), v
    assert v["details"]["all_ended_ok"] is True, v
    caught = v["details"]["handled_error"]
    assert caught["type"] == "ValueError" and "is corrupt" in caught["message"], caught
    assert "caught ValueError" in v["summary"] and "every rank ended with code 0" in v["summary"], v
    # rank 0's failed all-reduce is known from its own record, though its program caught the error
    assert any(e.startswith("rank 0 was in #") and "raised: " in e for e in v["evidence"]), v["evidence"]
    if name == "caught_log":
        assert v["details"]["exit_call"] == script_line("# CAUGHT EXIT", SCRIPT), v


def test_a_question_asked_on_standard_input_is_said_to_be_one(runs: dict) -> None:
    """input() in a rank without a terminal reads end-of-input: a crash at that line, with why."""
    v = _verdict(_run(runs, "prompt", 1))
    assert (v["kind"], v["culprit_rank"]) == ("crash", 1), v
    assert v["location"] == script_line("# PROMPT", SCRIPT), v
    assert v["details"]["known_error"]["code"] == "prompt_without_terminal", v
    assert "standard input" in v["summary"], v


def test_ranks_that_built_different_models_are_told_so(runs: dict) -> None:
    """DDP's construction finds rank 1's parameters unlike rank 0's: a crash at the DDP line, with
    the cause in words."""
    v = _verdict(_run(runs, "model", 1))
    assert (v["kind"], v["culprit_rank"]) == ("crash", 1), v
    assert v["location"] == script_line("# WRAP", SCRIPT), v
    assert v["details"]["known_error"]["code"] == "ddp_model_mismatch", v


def test_a_caught_error_that_leaves_a_rank_in_its_cleanup_is_named_in_the_hang(runs: dict) -> None:
    """Rank 1 raises, its script prints the traceback and goes to its cleanup's barrier while rank 0
    waits in its step: the hang names rank 1, the error it caught, and the line that raised it."""
    v = _verdict(_run(runs, "caught_barrier"))
    assert v["kind"].startswith("hang.") and v["culprit_rank"] == 1, v
    assert v["location"] == script_line("# BAD SAMPLE", SCRIPT), v
    assert v["details"]["handled_error"]["type"] == "ValueError", v
    assert "caught ValueError" in v["summary"] and script_line("# CLEANUP BARRIER", SCRIPT) in v["summary"], v
