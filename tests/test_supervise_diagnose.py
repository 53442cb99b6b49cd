"""Table-driven tests of the pure diagnosis on hand-built RunStates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import sddoctor.instrument.api
from sddoctor.supervise.diagnose import diagnose, place_stackless_culprits
from sddoctor.supervise.diagnose_base import group_creation_text
from sddoctor.supervise.diagnose_crash import last_traceback
from sddoctor.supervise.diagnose_oom import host_oom_finding
from sddoctor.supervise.state import Arrival, RankState, RunState
from sddoctor.supervise.watch import parse_launcher_failures

#: a frame of sddoctor's own code, where it is really installed (never the user's line)
SDDOCTOR_API = sddoctor.instrument.api.__file__

NOW = 1000.0


def call(
    seq: int, op: str = "all_reduce", shapes: Any = None, caller: str = "train.py:20", since: float = 990.0
):
    return {"pg": "0", "seq": seq, "op": op, "shapes": shapes or [[4]], "caller": caller, "since": since}


def rank(
    r: int, *, inflight=None, issued=None, done=None, phase=None, step=None, heartbeat=NOW - 0.5, **kw
) -> RankState:
    colls: dict[str, Any] = {"inflight": inflight or []}
    if issued is not None:
        colls["issued"] = {"0": issued}
    if done is not None:
        colls["last_done"] = done
    state = {"rank": r, "t": NOW - 0.5, "heartbeat": heartbeat, "collectives": colls}
    if phase:
        state["phase"] = phase
    if step is not None:
        state["step"] = step
    return RankState(rank=r, state=state, pid=100 + r, alive=kw.pop("alive", True), **kw)


def hung(*ranks: RankState, world_size: int | None = None, **kw) -> RunState:
    return RunState(
        now=NOW,
        started=900.0,
        ranks={r.rank: r for r in ranks},
        world_size=world_size or len(ranks),
        last_progress=NOW - 10,
        hang_timeout=5.0,
        **kw,
    )


def stack(frame: str, *extra: str) -> dict[str, Any]:
    return {"ok": True, "top_user_frame": frame, "top_user_function": "loop", "frames": [*extra, frame]}


# -- hangs ------------------------------------------------------------------------------------

HANG_CASES = [
    pytest.param(
        hung(
            rank(0, inflight=[call(7)], issued=7),
            rank(1, issued=6, done=call(6), stack=stack("train.py:33")),
        ),
        "hang.missing_rank",
        1,
        "train.py:33",
        id="missing-rank-with-stack",
    ),
    pytest.param(
        hung(
            rank(0, inflight=[call(7)], issued=7), rank(1, issued=6, done=dict(call(6), caller="train.py:21"))
        ),
        "hang.missing_rank",
        1,
        "train.py:21",
        id="missing-rank-located-by-last-collective",
    ),
    pytest.param(
        hung(
            rank(0, inflight=[call(7)]),
            rank(1, inflight=[call(7)]),
            rank(2, alive=False, exit={"code": 0, "t": 995.0}),
        ),
        "hang.missing_rank",
        2,
        None,
        id="rank-exited-early",
    ),
    pytest.param(
        hung(
            rank(0, inflight=[call(7)]),
            rank(1, inflight=[call(7)]),
            rank(2, inflight=[call(7, shapes=[[5]])]),
        ),
        "hang.mismatch",
        2,
        "train.py:20",
        id="shape-mismatch-minority",
    ),
    pytest.param(
        hung(rank(0, inflight=[call(7)]), rank(1, inflight=[call(7, op="broadcast", caller="eval.py:9")])),
        "hang.mismatch",
        None,
        None,
        id="op-mismatch-two-ranks-no-evidence",
    ),
    pytest.param(
        hung(
            rank(0, inflight=[call(7)]),
            rank(
                1,
                inflight=[call(7, shapes=[[5]])],
                faults=[{"fault": "shape:rank=1,seq=7", "caller": "t.py:3"}],
            ),
        ),
        "hang.mismatch",
        1,
        "train.py:20",
        id="shape-mismatch-two-ranks-fault-evidence",
    ),
    pytest.param(
        hung(rank(0, inflight=[call(7)]), rank(1, inflight=[call(7)])),
        "hang.comm",
        None,
        "train.py:20",
        id="all-wait-same-collective",
    ),
    pytest.param(
        hung(rank(0, inflight=[call(7)]), rank(1, phase="data", issued=6)),
        "hang.dataloader",
        1,
        None,
        id="dataloader-phase",
    ),
    pytest.param(
        hung(
            rank(0, inflight=[call(7)]),
            rank(
                1,
                issued=6,
                stack=stack("train.py:50", "/x/site-packages/torch/utils/data/dataloader.py:1 in next"),
            ),
        ),
        "hang.dataloader",
        1,
        "train.py:50",
        id="dataloader-stack",
    ),
    pytest.param(
        hung(
            rank(0, inflight=[call(7)]),
            rank(
                1,
                issued=6,
                stack=stack(
                    "train.py:50",
                    "/x/site-packages/lightning/fabric/utilities/distributed.py:213 in _sync_ddp",
                    "/x/site-packages/lightning/pytorch/loops/evaluation_loop.py:386 in _store_dataloader_outputs",
                ),
            ),
        ),
        "hang.missing_rank",
        1,
        "train.py:50",
        id="a-function-named-after-dataloaders-is-not-one",
    ),
    pytest.param(
        hung(rank(0, issued=5), rank(1, issued=5)), "hang.unknown", None, None, id="nobody-in-a-collective"
    ),
    pytest.param(
        hung(
            rank(0, inflight=[call(7)]),
            rank(1, inflight=[call(7)], heartbeat=NOW - 30),
            rank(2, inflight=[call(7)]),
        ),
        "hang.comm",
        1,
        "train.py:20",
        id="frozen-rank-inside-the-collective",
    ),
]


@pytest.mark.parametrize(("state", "kind", "culprit", "location"), HANG_CASES)
def test_hang_classification(state: RunState, kind: str, culprit: int | None, location: str | None) -> None:
    verdicts = diagnose(state)
    hangs = [v for v in verdicts if v.kind.startswith("hang.")]
    assert [v.kind for v in hangs] == [kind], [v.summary for v in verdicts]
    assert hangs[0].culprit_rank == culprit
    if location is not None:
        assert hangs[0].location == location
    assert hangs[0].severity == "error"
    assert hangs[0].evidence


def test_no_hang_before_timeout() -> None:
    state = hung(rank(0, inflight=[call(7, since=NOW - 4.0)]), rank(1, issued=6))
    state.last_progress = NOW - 4.0  # timeout is 5 s
    assert not [v for v in diagnose(state) if v.kind.startswith("hang")]


def test_a_rank_held_in_one_call_for_the_timeout_is_a_hang_though_others_progress() -> None:
    """Progress elsewhere (a thread's collectives on its own group) does not hide rank 0 waiting
    10 s in one all-reduce for rank 1; the stall is dated from that call, so it stays one hang."""
    state = hung(rank(0, inflight=[call(7)]), rank(1, issued=6))
    state.last_progress = NOW - 1.0
    assert state.stalled_since == 990.0 and state.stalled_for == 10.0
    (v,) = [v for v in diagnose(state) if v.kind.startswith("hang")]
    assert (v.kind, v.culprit_rank) == ("hang.missing_rank", 1), v.summary


def test_without_a_stack_a_missing_rank_is_where_its_main_thread_last_synced() -> None:
    """py-spy could not attach: rank 1 is placed by its last completed call, and that is its main
    thread's, not the metrics thread's all-reduce on its own group that completed after it."""
    meter = {**call(40, caller="meter.py:9"), "pg": "1", "off_main": True, "t": NOW - 1.0}
    missing = rank(1, issued=6, done=meter)
    missing.state["collectives"]["last_done_main"] = {**call(6, caller="train.py:30"), "t": NOW - 9.0}
    state = hung(rank(0, inflight=[call(7)]), missing)
    (v,) = [v for v in diagnose(state) if v.kind.startswith("hang")]
    assert (v.kind, v.culprit_rank, v.location) == ("hang.missing_rank", 1, "train.py:30"), v.summary


def test_a_frozen_hang_without_the_culprits_stack_is_placed_where_sigterm_found_it() -> None:
    """The verdict frozen at the hang placed rank 1 at its last completed call; the exit event of
    the stop that followed says where its main thread was. A culprit whose stack was taken keeps
    its verdict, and a verdict placed once is not placed again."""
    missing = rank(1, issued=6, done=call(6, caller="train.py:30"))
    state = hung(rank(0, inflight=[call(7)]), missing)
    (frozen,) = [v for v in diagnose(state) if v.kind.startswith("hang")]
    assert frozen.location == "train.py:30"
    missing.exit = {"status": "signal", "signal": 15, "at": "train.py:12", "at_function": "load_batch"}
    (placed,) = place_stackless_culprits([frozen], state)
    assert (placed.location, placed.details["stopped_at"]) == ("train.py:12", "train.py:12")
    assert placed.summary.endswith(
        "When the job was stopped, rank 1: it was at train.py:12 in load_batch() when SIGTERM stopped it"
    )
    assert place_stackless_culprits([placed], state) == [placed]
    missing.stack = {"ok": True, "top_user_frame": "train.py:30"}
    assert place_stackless_culprits([frozen], state) == [frozen]


def test_a_rank_frozen_before_its_snapshot_showed_work_is_past_its_start_up() -> None:
    """Rank 1 froze within a second of DDP's construction: its last snapshot says it is starting,
    but rank 0 completed calls of the default group, which rank 1 had to join. The hang timeout
    applies, not the start-up allowance, and the stopped rank is named with its cause."""
    starting = rank(1, heartbeat=NOW - 8)
    starting.stack = {**stack("train.py:41"), "stopped": True}
    state = hung(rank(0, inflight=[call(5)], issued=5, done=call(4)), starting)
    state.startup_timeout = 900.0
    assert state.past_startup(1) and not state.in_startup and state.hung
    (v,) = [v for v in diagnose(state) if v.kind.startswith("hang")]
    assert (v.kind, v.culprit_rank, v.location) == ("hang.missing_rank", 1, "train.py:41"), v.summary
    assert v.details["frozen_cause"] == "stopped" and "its process is stopped (state T" in v.summary
    assert "kill -CONT 101" in v.evidence[-1]
    assert not hung(rank(0, inflight=[call(1, since=NOW - 1)]), rank(1)).past_startup(1)


def test_a_rank_a_debugger_holds_is_frozen_by_the_heartbeat_rule_and_said_to_be_traced() -> None:
    """State t can be a sampling profiler's brief stop too, so a traced rank needs the usual 5 s of
    silent heartbeat before it is called frozen; then the verdict says a tracer holds it."""

    def state_with_heartbeat(age: float) -> RunState:
        held = rank(1, issued=6, done=call(6), heartbeat=NOW - age)
        held.stack = {**stack("train.py:33"), "traced": True}
        return hung(rank(0, inflight=[call(7)], issued=7), held)

    assert not [v for v in diagnose(state_with_heartbeat(4)) if "frozen_ranks" in v.details]
    (v,) = [v for v in diagnose(state_with_heartbeat(6)) if v.kind.startswith("hang")]
    assert (v.culprit_rank, v.details["frozen_cause"]) == (1, "traced"), v.summary
    assert "held by a tracer (state t" in v.summary and "`detach`" in v.evidence[-1]


def test_a_call_a_peer_completed_does_not_hold_the_rank_whose_snapshot_is_behind() -> None:
    """Rank 1's last snapshot has it inside all_reduce #2 since 990; rank 0 completed #2, so rank 1
    got out of it: the stall is not dated from it, and a frozen rank 1 is not placed inside it."""
    behind = rank(1, inflight=[call(2)], issued=2, heartbeat=NOW - 4)
    behind.stack = {**stack("train.py:20"), "main_holds_gil": True}
    state = hung(rank(0, inflight=[call(3, since=NOW - 6)], issued=3, done=call(2)), behind)
    state.last_progress = NOW - 6
    assert state.overtaken(1, behind.snapshot.inflight[0])
    assert state.blocked_call is not None and state.blocked_call[0] == 0
    (v,) = [v for v in diagnose(state) if v.kind.startswith("hang")]
    assert (v.kind, v.culprit_rank, v.details["frozen_cause"]) == ("hang.missing_rank", 1, "holds_gil")
    assert "inside all_reduce #2" not in v.summary and "holds the GIL in native code" in v.summary
    assert "which is behind it" in v.evidence[1]
    # the same snapshot with a fresh heartbeat and no sign of a freeze is not frozen
    behind.stack = stack("train.py:20")
    assert not [x for x in diagnose(state) if "frozen_ranks" in x.details]


def test_an_oom_kill_the_kernel_log_does_not_name_is_still_said_from_its_counter() -> None:
    """The kernel log could not be read (dmesg_restrict): the counter moved during the run, and a
    rank that died of SIGKILL is said to have most likely been one of its kills."""
    state = hung(rank(0), rank(1))
    state.host_oom = {"kills": 2, "source": "/proc/vmstat", "killed": None}
    clause, details = host_oom_finding(state, 4321, killed_hard=True, exception_message=None) or ("", {})
    assert clause == (
        "; the kernel's OOM killer killed 2 processes on this host during the run (/proc/vmstat): "
        "most likely it, for lack of host memory (not the GPU's)"
    )
    assert details == {"kills": 2, "source": "/proc/vmstat", "killed": None}
    worker = "DataLoader worker (pid(s) 77) exited unexpectedly"
    assert "most likely its DataLoader worker" in host_oom_finding(state, 4321, False, worker)[0]  # type: ignore[index]
    assert host_oom_finding(state, 4321, killed_hard=False, exception_message="ValueError") is None
    state.host_oom = {"kills": 0, "source": "/proc/vmstat", "killed": None}
    assert host_oom_finding(state, 4321, killed_hard=True, exception_message=None) is None


def test_a_rank_killed_without_a_record_of_its_end_is_not_said_to_die_at_its_last_collective() -> None:
    """SIGKILL runs no code: a rank so killed left only its last completed collective, a line it
    had left since. The summary names it as that; a stack taken before says where it died."""
    survivor = rank(0, alive=False, exit={"t": 10.2, "signal": 15})
    killed = rank(1, alive=False, exit={"t": 10.0, "signal": 9}, done=call(4, caller="/u/t.py:61"))
    state = RunState(now=20.0, started=0.0, ranks={0: survivor, 1: killed}, job_exit={"code": 1, "t": 11})
    (v,) = diagnose(state)
    assert (v.kind, v.culprit_rank, v.location) == ("crash", 1, "/u/t.py:61"), v
    assert v.summary.startswith(
        "rank 1 died first: it was killed by signal 9 (SIGKILL); "
        "its last completed collective was all_reduce #4 at /u/t.py:61"
    ), v.summary
    killed.stack = {"ok": True, "top_user_frame": "/u/t.py:58", "top_user_function": "fill"}
    (v,) = diagnose(state)
    assert (v.location, "(SIGKILL) at /u/t.py:58;" in v.summary) == ("/u/t.py:58", True), v


def test_a_restart_after_an_nccl_system_error_says_its_usual_cause() -> None:
    """torchrun --max-restarts: the first failure was NCCL's "unhandled system error"; the
    restarted verdict says what usually causes it and how to find out."""
    message = "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error, NCCL version 2.21.5"
    failed = rank(1)
    failed.attempts = [
        {
            "pid": 11,
            "exception": {"type": "DistBackendError", "message": message, "t": 5.0},
            "exit": {"code": 1, "t": 5.1},
        }
    ]
    (v,) = [v for v in diagnose(_ended(rank(0), failed)) if v.kind == "restarted"]
    assert v.details["known_error"]["code"] == "nccl_system_error", v
    assert v.summary.startswith(
        "the launcher restarted the workers: on attempt 1 rank 1 raised DistBackendError"
    ), v.summary
    assert "; NCCL failed in a system call (/dev/shm too small?" in v.summary, v.summary
    assert any("NCCL_SOCKET_IFNAME" in line for line in v.evidence), v.evidence


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_a_stuck_nccl_collective_says_what_usually_holds_it(backend: str) -> None:
    """Every rank inside the same all-reduce: on NCCL, the usual P2P causes and how to tell them;
    gloo has no P2P, so no such advice."""
    ranks = [rank(r, inflight=[call(7)]) for r in (0, 1)]
    for r in ranks:
        r.state["backend"] = backend  # as the rank's state file says it
    (v,) = diagnose(hung(*ranks))
    assert v.kind == "hang.comm", v
    advice = [line for line in v.evidence if "NCCL_P2P_DISABLE=1" in line]
    assert len(advice) == (1 if backend == "nccl" else 0), v.evidence


def test_a_rendezvous_that_cannot_complete_names_the_store_a_rank_cannot_reach() -> None:
    """Every rank waits in init_process_group; torch logged a store client's failed tries (the
    line as torch 2.13 printed it when rank 1 was given a wrong MASTER_ADDR): the address is named."""
    ranks = [rank(r) for r in (0, 1)]
    for r in ranks:
        r.state["waiting"] = {"what": "init_process_group", "since": 901.0, "caller": "/u/job.py:9"}
    tried = (
        "[W1206 19:00:29.310263554 TCPStore.cpp:340] [c10d] TCP client failed to connect/validate to host "
        "10.255.255.1:29571 - retrying (try=7, timeout=120000ms, delay=12576ms): Ping failed"
    )
    state = hung(*ranks, stderr_tail=["noise", tried, "frame #4: c10d::TCPStore::TCPStore(...)"])
    state.startup_timeout = 15.0
    (v,) = diagnose(state)
    assert (v.kind, v.culprit_rank) == ("hang.startup", None), v
    assert v.details["known_error"]["code"] == "store_unreachable", v.details
    assert f"the job's output says: {tried}" in v.evidence, v.evidence
    assert any("the rendezvous store at 10.255.255.1:29571" in line for line in v.evidence), v.evidence


TORCH_DIR = Path(torch.__file__).parent  # torch's frames are library code where torch really is


def test_a_launcher_error_wrapping_the_cause_is_read_through_to_it() -> None:
    """torchrun's outer RendezvousConnectionError says nothing; the error it was raised from, printed
    above it, holds the cause. No rank ran, and no line of the user's is on the stack."""
    tail = [
        "Traceback (most recent call last):",
        f'  File "{TORCH_DIR}/distributed/elastic/rendezvous/c10d_rendezvous_backend.py", line 159, in _create_tcp_store',
        "    store = TCPStore(",
        "torch.distributed.DistNetworkError: The client socket has timed out after 60000ms while trying to "
        "connect to (node-0, 29400).",
        "",
        "The above exception was the direct cause of the following exception:",
        "",
        "Traceback (most recent call last):",
        f'  File "{TORCH_DIR}/distributed/run.py", line 1019, in run',
        "    elastic_launch(",
        "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d "
        "store has failed. See inner exception for details.",
    ]
    state = RunState(now=20.0, started=0.0, ranks={}, job_exit={"code": 1, "t": 11}, stderr_tail=tail)
    (v,) = diagnose(state)
    assert (v.kind, v.culprit_rank, v.location) == ("crash", None, None), v
    assert (
        v.details["known_error"]["code"] == "store_unreachable" and v.details["known_error"]["port"] == 29400
    )
    assert v.summary == (
        "the job exited with code 1: torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: "
        "The connection to the C10d store has failed. See inner exception for details.; the rendezvous "
        "store at node-0:29400 was unreachable"
    ), v.summary


def test_a_work_the_program_left_pending_is_not_a_stall() -> None:
    """An irecv or async_op Work may stay pending on purpose (an early-stop flag polled with
    is_completed()); one DDP issued (a gradient bucket) holds the rank's step, and counts."""
    pending = {**call(7), "async": True, "user_async": True}
    state = hung(rank(0, inflight=[pending]), rank(1, issued=6))
    state.last_progress = NOW - 1.0
    assert state.blocked_call is None and state.stalled_for == 1.0
    assert not [v for v in diagnose(state) if v.kind.startswith("hang")]
    bucket = {**pending, "ddp": "bucket"}
    state = hung(rank(0, inflight=[bucket]), rank(1, issued=6))
    state.last_progress = NOW - 1.0
    assert state.stalled_for == 10.0


def test_a_helper_threads_long_wait_is_not_a_stall_of_the_rank() -> None:
    """A listener thread blocked in recv, or a metrics thread waiting for a peer's thread that
    starts later, while the main loop trains on: the rank is not held."""
    listener = {**call(7), "off_main": True}
    state = hung(rank(0, inflight=[listener]), rank(1, issued=6))
    state.last_progress = NOW - 1.0
    assert state.blocked_call is None and not state.hung


def _with_issued(r: RankState, **issued: int) -> RankState:
    r.state["collectives"]["issued"] = {pg.removeprefix("pg"): n for pg, n in issued.items()}
    return r


@pytest.mark.parametrize(
    "waiters_meter_in_flight", [False, True], ids=["meter-between-calls", "meter-in-flight"]
)
def test_a_helper_threads_call_is_not_where_its_rank_is_held(waiters_meter_in_flight: bool) -> None:
    """Rank 1's main thread is stuck reading its batch while its metering thread, which all-reduces
    on a group of its own every 0.2 s, is inside #69 there; rank 0's snapshot, written at another
    instant, had issued only #68 there (or is inside #70, newer than its main thread's wait). The
    meter is not where either rank is held: rank 1 is missing from the default group's #15, at its
    main thread's line, and no crossing of groups is seen."""
    meter = {**call(69, caller="meter.py:9", since=NOW - 0.1), "pg": "1", "off_main": True}
    waiting = [call(15, caller="train.py:20", since=NOW - 6)]
    if waiters_meter_in_flight:
        waiting.append({**meter, "seq": 70, "since": NOW - 0.05})
    waiter = _with_issued(rank(0, inflight=waiting), pg0=15, pg1=70 if waiters_meter_in_flight else 68)
    stuck = _with_issued(rank(1, inflight=[meter], stack=stack("train.py:9")), pg0=14, pg1=69)
    (v,) = [v for v in diagnose(hung(waiter, stuck)) if v.kind.startswith("hang")]
    assert (v.kind, v.culprit_rank, v.location) == ("hang.missing_rank", 1, "train.py:9"), v.summary
    assert (v.details["pg"], v.details["seq"]) == ("0", 15)
    assert "inside all_reduce #69" not in v.summary
    assert "from a thread other than its main thread" in v.evidence[1]


def test_a_call_a_peer_has_passed_is_over_though_the_snapshot_still_shows_it() -> None:
    """Rank 0 has issued #8 on the group, so #7 completed; rank 1's snapshot (written once a
    second) still shows it in flight since long ago. That is no stall, and no diagnosis runs on
    such a half-updated state."""
    state = hung(rank(0, issued=8, inflight=[call(8, since=NOW - 0.5)]), rank(1, inflight=[call(7)]))
    state.last_progress = NOW - 0.5
    assert state.blocked_call == (0, state.ranks[0].snapshot.inflight[0])
    assert not state.hung and diagnose(state) == []


def test_no_hang_while_every_rank_is_still_setting_up() -> None:
    state = hung(rank(0), rank(1))  # snapshots, but no collective issued and no step yet
    assert diagnose(state) == []


def test_no_hang_after_the_job_ended() -> None:
    state = hung(rank(0, inflight=[call(7)]), rank(1, issued=6))
    state.job_exit = {"code": 0, "t": NOW}
    assert not [v for v in diagnose(state) if v.kind.startswith("hang")]


def test_every_rank_missing_from_the_call_is_placed_not_only_the_culprit() -> None:
    state = hung(
        rank(0, inflight=[call(9)], issued=9),
        rank(1, inflight=[call(9)], issued=9),
        rank(2, issued=8, stack=stack("train.py:33")),
        rank(3, issued=8, stack=stack("train.py:35")),
    )
    (v,) = [v for v in diagnose(state) if v.kind.startswith("hang")]
    assert (v.kind, v.culprit_rank, v.details["missing_ranks"]) == ("hang.missing_rank", 2, [2, 3])
    assert "Rank 3 never reached it either (rank 3: its stack is at train.py:35 in loop())" in v.summary
    assert v.summary.endswith("Ranks 0, 1 wait there for 10 s"), v.summary


def test_a_rooted_call_whose_ranks_pass_different_roots_is_a_mismatch() -> None:
    """Same op and shapes, roots 0 and 1 (src=rank): no 'communication stuck'. And a broadcast
    whose record has no root (DDP's buffers, an older writer) is compared as before."""
    mine = [{**call(6, "broadcast", caller="train.py:50"), "root": r} for r in (0, 1)]
    state = hung(rank(0, inflight=[mine[0]], issued=6), rank(1, inflight=[mine[1]], issued=6))
    (v,) = [v for v in diagnose(state) if v.kind.startswith("hang")]
    assert (v.kind, v.culprit_rank, v.location) == ("hang.mismatch", None, "train.py:50"), v.summary
    assert "root 0 at train.py:50" in v.summary and "passed different roots" in v.summary
    same = {**call(6, "broadcast", caller="train.py:50")}
    state = hung(rank(0, inflight=[same], issued=6), rank(1, inflight=[same], issued=6))
    (v,) = [v for v in diagnose(state) if v.kind.startswith("hang")]
    assert v.kind == "hang.comm", v.summary


def test_a_stack_inside_torchs_group_creation_says_every_rank_must_call_it() -> None:
    c10d = "/env/site-packages/torch/distributed/distributed_c10d.py"
    mesh = "/env/site-packages/torch/distributed/device_mesh.py"
    frames = [f"{c10d}:2169 in _new_process_group_helper", f"{c10d}:5863 in new_group", "/u/t.py:18 in main"]
    assert group_creation_text(frames).startswith("; it waits inside new_group(), which every rank")
    assert "inside init_device_mesh()" in group_creation_text([f"{mesh}:1090 in init_device_mesh"])
    assert group_creation_text(["/u/t.py:18 in new_group", f"{c10d}:4000 in all_reduce"]) == ""


def test_mismatch_summary_names_both_shapes() -> None:
    state = hung(rank(0, inflight=[call(3, shapes=[[8]])]), rank(1, inflight=[call(3, shapes=[[9]])]))
    (v,) = [v for v in diagnose(state) if v.kind == "hang.mismatch"]
    assert "[[8]]" in v.summary and "[[9]]" in v.summary and "rank 0" in v.summary and "rank 1" in v.summary


@pytest.mark.parametrize(
    ("earlier", "usual"),
    [
        # FSDP2: one line reduce-scatters every layer's gradients, each its own size; rank 0 was
        # seen there with another layer's size, rank 1's earlier calls were not sighted
        ([(0, 6, "reduce_scatter", [[390]]), (0, 8, "reduce_scatter", [[64]])], [[390]]),
        # Fabric's all_reduce: a barrier, then the all-reduce, from the one user line
        ([(0, 5, "barrier", []), (1, 5, "barrier", []), (1, 6, "reduce_scatter", [[390]])], [[390]]),
    ],
    ids=["a-site-with-several-usual-shapes", "a-barrier-on-the-same-line"],
)
def test_a_usual_shape_at_a_call_site_is_no_change(earlier: list, usual: Any) -> None:
    """The rank whose shapes at a call site were never seen there is the odd one, not the rank
    whose site also carries other shapes or other ops (the fault on rank 1 is left out here, so
    the shapes alone must tell)."""
    ranks = {
        0: rank(0, inflight=[call(15, "reduce_scatter", shapes=usual, caller="fsdp.py:33")]),
        1: rank(1, inflight=[call(15, "reduce_scatter", shapes=[[391]], caller="fsdp.py:33")]),
    }
    for r, seq, op, shapes in earlier:
        ranks[r].arrivals.setdefault("0", {})[seq] = Arrival(
            enqueue=900.0 + seq, op=op, shapes=shapes, caller="fsdp.py:33"
        )
    (v,) = diagnose(hung(*ranks.values()))
    assert (v.kind, v.culprit_rank, v.location) == ("hang.mismatch", 1, "fsdp.py:33"), v


def _trained(r: RankState, seqs: range, *, forward: str = "t.py:78", backward: str = "t.py:88") -> RankState:
    """Give `r` a record of training steps under DDP with buffers: odd seqs the forward's buffer
    broadcast, even seqs the backward's gradient all-reduce."""
    for seq in seqs:
        op, caller = ("broadcast", forward) if seq % 2 else ("all_reduce", backward)
        r.arrivals.setdefault("0", {})[seq] = Arrival(enqueue=900.0 + seq, op=op, shapes=[[4]], caller=caller)
    return r


def test_a_rank_that_ran_a_forward_without_its_backward_is_the_culprit() -> None:
    """Rank 1 skipped a backward (a `continue` on a NaN loss): its next forward's buffer broadcast
    meets rank 0's gradient all-reduce. Both ranks call both sites, so the sites alone do not say
    who left the common path; rank 1's own record does (a broadcast right after a broadcast)."""
    bucket = dict(call(10, caller="t.py:88", since=995.0), ddp="bucket")
    buffers = dict(call(10, "broadcast", caller="t.py:78", since=995.0), ddp="buffers")
    state = hung(
        _trained(rank(0, inflight=[bucket], step=4), range(1, 10)),
        _trained(rank(1, inflight=[buffers], step=4), range(1, 10)),
    )
    (v,) = diagnose(state)
    assert (v.kind, v.culprit_rank, v.location) == ("hang.mismatch", 1, "t.py:78"), v
    assert "every earlier time it called all_reduce at t.py:88 next: it skipped that call" in v.summary
    assert "rank 1 ran a training forward without its backward" in v.summary, v.summary
    assert v.details["left_routine"]["usual"] == {"op": "all_reduce", "caller": "t.py:88"}


def test_ranks_each_at_a_site_of_their_own_took_different_branches() -> None:
    """Rank 0 all-reduces then broadcasts, rank 1 the other way round, each from its own lines:
    no rank is the odd one, and the summary does not say one rank's call is extra."""
    state = hung(
        _trained(rank(0, inflight=[call(11, caller="t.py:66")]), range(1, 11)),
        _trained(rank(1, inflight=[call(11, "broadcast", shapes=[[3]], caller="t.py:69")]), range(1, 11)),
    )
    (v,) = diagnose(state)
    assert (v.kind, v.culprit_rank) == ("hang.mismatch", None), v
    assert "the ranks took different branches" in v.summary and "only some ranks reach" not in v.summary


def test_comm_hang_points_to_check_nccl() -> None:
    (v,) = diagnose(hung(rank(0, inflight=[call(7)]), rank(1, inflight=[call(7)])))
    assert "sddoctor check-nccl" in v.summary


# -- crashes ----------------------------------------------------------------------------------

CRASH_CASES = [
    pytest.param(
        [
            rank(0, alive=False, exit={"t": 10.3, "signal": 15}),
            rank(1, alive=False, exit={"t": 10.0, "signal": 9}),
            rank(2, alive=False, exit={"t": 10.3, "signal": 15}),
        ],
        [],
        1,
        "SIGKILL",
        id="sigkill-first-others-terminated",
    ),
    pytest.param(
        [
            rank(
                0,
                alive=False,
                exit={"t": 10.1, "code": 1},
                exception={"t": 10.05, "type": "RuntimeError", "message": "Connection reset by peer"},
            ),
            rank(1, alive=False, exit={"t": 10.0}),
        ],
        [{"rank": 1, "exitcode": -9, "pid": 5, "root_cause": False}],
        1,
        "SIGKILL",
        id="victim-saw-connection-reset",
    ),
    pytest.param(
        [
            rank(
                0,
                alive=False,
                exit={"t": 10.0, "code": 1},
                exception={
                    "t": 9.9,
                    "type": "InjectedFault",
                    "message": "boom",
                    "traceback": [
                        "/u/train.py:40 in <module>",
                        "/u/train.py:12 in step",
                        f"{SDDOCTOR_API}:3 in f",
                    ],
                },
            ),
            rank(1, alive=False, exit={"t": 10.4, "signal": 15}),
        ],
        [],
        0,
        "boom",
        id="exception-with-traceback",
    ),
    pytest.param(
        [
            rank(0, alive=False, exit={"t": 10.0, "code": 0}),
            rank(1, alive=False, exit={"t": 10.0, "code": 0}),
        ],
        [],
        None,
        None,
        id="healthy-exit",
    ),
]


@pytest.mark.parametrize(("ranks", "failures", "culprit", "text"), CRASH_CASES)
def test_crash_blames_the_first_death(ranks, failures, culprit, text) -> None:
    state = RunState(
        now=20.0,
        started=0.0,
        ranks={r.rank: r for r in ranks},
        world_size=len(ranks),
        last_progress=9.0,
        job_exit={"code": 1 if culprit is not None else 0, "t": 11.0},
        launcher_failures=failures,
    )
    crashes = [v for v in diagnose(state) if v.kind == "crash"]
    if culprit is None:
        assert crashes == []
        return
    assert len(crashes) == 1
    assert crashes[0].culprit_rank == culprit
    assert text in crashes[0].summary
    others = [r.rank for r in ranks if r.rank != culprit]
    assert crashes[0].details["consequences"] == others


def test_crash_location_is_the_innermost_user_frame() -> None:
    ranks = CRASH_CASES[2].values[0]
    state = RunState(now=20.0, started=0.0, ranks={r.rank: r for r in ranks}, job_exit={"code": 1, "t": 11})
    (v,) = [v for v in diagnose(state) if v.kind == "crash"]
    assert v.location == "/u/train.py:12"


#: a library's file, where this interpreter really installs libraries (not torch's, not sddoctor's)
LIB = str(Path(pytest.__file__).parent / "strategy.py")


def _library_only_crash(spawned_at: str | None) -> RunState:
    """Rank 0 raised with only library and sddoctor frames on its stack (a worker that Lightning's
    ddp_spawn runs), spawned from the user's line `spawned_at`."""
    exception = {
        "t": 9.9,
        "type": "InjectedFault",
        "message": "boom",
        "traceback": [f"{LIB}:640 in run", f"{LIB}:641 in __call__", f"{SDDOCTOR_API}:3 in f"],
    }
    r0 = rank(0, alive=False, exit={"t": 10.0, "code": 1}, exception=exception, spawned_at=spawned_at)
    r1 = rank(1, alive=False, exit={"t": 10.4, "signal": 15})
    return RunState(now=20.0, started=0.0, ranks={0: r0, 1: r1}, job_exit={"code": 1, "t": 11})


def test_a_crash_without_a_user_frame_is_never_located_in_sddoctor() -> None:
    (v,) = [v for v in diagnose(_library_only_crash(None)) if v.kind == "crash"]
    assert v.location == f"{LIB}:641"


def test_a_spawned_worker_without_a_user_frame_is_located_where_it_was_started() -> None:
    (v,) = [v for v in diagnose(_library_only_crash("/u/fit.py:55")) if v.kind == "crash"]
    assert v.location == "/u/fit.py:55"
    assert any(f"{LIB}:641" in line for line in v.evidence), v.evidence


def test_deaths_after_sddoctor_stopped_the_job_are_not_crashes() -> None:
    r0 = rank(0, alive=False, exit={"t": 12.0, "signal": 15})
    r1 = rank(1, alive=False, exit={"t": 12.1, "signal": 9})
    state = RunState(
        now=20.0,
        started=0.0,
        ranks={0: r0, 1: r1},
        job_exit={"code": -15, "t": 13},
        stopped_by_supervisor="hang",
        stopped_at=11.9,
    )
    assert [v for v in diagnose(state) if v.kind == "crash"] == []


def test_a_rank_only_seen_gone_after_its_supervisor_died_is_not_a_crash() -> None:
    """Offline, a rank gone without an exit record has its last heartbeat as its time, which a
    loaded host writes seconds late: that is no death before the supervisor's."""
    gone = {"source": "process gone without an exit event (killed?)", "unclean": True}

    def state(exit_info: dict) -> RunState:
        r0 = rank(0, alive=False, exit=exit_info)
        return RunState(
            now=30.0, started=0.0, ranks={0: r0}, stopped_by_supervisor="supervisor died", stopped_at=20.0
        )

    assert [v.kind for v in diagnose(state({**gone, "t": 18.8, "last_seen_alive": True}))] == []
    # long before the supervisor died, or a death whose time is known: a crash
    assert "crash" in [v.kind for v in diagnose(state({**gone, "t": 10.0, "last_seen_alive": True}))]
    assert "crash" in [v.kind for v in diagnose(state({"t": 18.8, "signal": 9}))]


def test_gloo_size_mismatch_abort_is_a_mismatch_not_a_crash() -> None:
    r0 = rank(0, alive=False, exit={"t": 10.0, "signal": 6})
    r1 = rank(
        1,
        alive=False,
        exit={"t": 10.2, "code": 1},
        faults=[{"fault": "shape:rank=1,seq=4", "seq": 4, "caller": "/u/t.py:9", "shape": [9]}],
    )
    state = RunState(
        now=20.0,
        started=0.0,
        ranks={0: r0, 1: r1},
        job_exit={"code": 1, "t": 11},
        stderr_tail=["what():  [enforce fail] 9 vs 8. Received data size doesn't match expected size."],
    )
    verdicts = diagnose(state)
    assert [v.kind for v in verdicts] == ["hang.mismatch"]
    assert verdicts[0].culprit_rank == 1 and verdicts[0].location == "/u/t.py:9"


def test_a_size_mismatch_abort_without_records_says_where_the_ranks_were() -> None:
    """The rank gloo aborted wrote no record of the call it died in, and no two records of one
    call differ (a timeline row has no shapes: an unknown is no difference). Its fatal-signal dump
    and the other rank's last call say where each was; no rank is guessed."""
    bucket = dict(call(10, caller="/u/t.py:89"), ddp="bucket")
    r0 = rank(0, alive=False, exit={"t": 10.2, "signal": 15}, done=bucket)
    r1 = rank(1, alive=False, exit={"t": 10.0, "signal": 6}, done=call(5, caller="/u/t.py:89"))
    frames = [f"{SDDOCTOR_API}:3 in all_reduce", "/u/t.py:63 in sync"]
    r1.fatal = {"error": "Aborted", "frames": frames}
    r0.arrivals["0"] = {5: Arrival(enqueue=905.0, op="all_reduce", shapes=[[676]], caller="/u/t.py:89")}
    r1.arrivals["0"] = {5: Arrival(enqueue=905.0, op="all_reduce", shapes=None, caller="/u/t.py:89")}
    state = RunState(
        now=20.0,
        started=0.0,
        ranks={0: r0, 1: r1},
        job_exit={"code": 1, "t": 11},
        stderr_tail=["what():  [enforce fail] 676 vs 4. Received data size doesn't match expected size."],
    )
    (v,) = diagnose(state)
    assert (v.kind, v.culprit_rank, v.location) == ("hang.mismatch", None, None), v
    assert "rank 1 aborted at /u/t.py:63 (its fatal-signal dump)" in v.summary, v.summary
    assert (
        "rank 0's last recorded call was all_reduce #10 (DDP's gradient all-reduce in the backward) at /u/t.py:89"
        in v.summary
    ), v.summary
    # the peer's call raised (connection reset) and its record says what it passed there
    r0 = state.ranks[0] = rank(0, alive=False, exit={"t": 10.2, "signal": 15}, done=bucket)
    r0.state["collectives"]["failed"] = {
        **call(11, caller="/u/t.py:13"),
        "dtypes": ["float64"],
        "shapes": [[8]],
    }
    (v,) = diagnose(state)
    assert "rank 0 was in all_reduce #11 (float64[8]) at /u/t.py:13, which raised" in v.summary, v.summary


def test_a_size_mismatch_abort_inside_one_line_is_placed_at_that_line() -> None:
    """Every rank called the collective they disagree on from one line (an all_to_all_single whose
    split sizes differ per rank): the aborted rank's dump names that line and no other rank was seen
    at another, so the verdict is placed there, with no culprit. A peer seen in a call at another
    line keeps it unplaced (the test above)."""
    frames = [f"{SDDOCTOR_API}:3 in all_to_all_single", "/u/t.py:41 in train"]
    stderr = ["what():  [enforce fail] 12 vs 8. Received data size doesn't match expected size."]
    for peer_call in (None, dict(call(6, op="all_to_all_single", caller="/u/t.py:41"))):
        r0 = rank(0, alive=False, exit={"t": 10.0, "signal": 6})
        r0.fatal = {"error": "Aborted", "frames": frames}
        r1 = rank(1, alive=False, exit={"t": 10.2, "signal": 15})
        if peer_call is not None:
            r1.state["collectives"]["failed"] = peer_call
        state = RunState(
            now=20.0, started=0.0, ranks={0: r0, 1: r1}, job_exit={"code": 1, "t": 11}, stderr_tail=stderr
        )
        (v,) = diagnose(state)
        assert (v.kind, v.culprit_rank, v.location) == ("hang.mismatch", None, "/u/t.py:41"), v


# -- OOM --------------------------------------------------------------------------------------


def test_oom_recovered_by_fallback() -> None:
    oom = {
        "t": 5.0,
        "step": 3,
        "phase": "backward",
        "mem_alloc": 2**30,
        "mem_reserved": 2**31,
        "mem_total": 2**34,
    }
    fb = {
        "t": 5.2,
        "step": 3,
        "old_micro_batch": 8,
        "new_micro_batch": 4,
        "old_grad_accum": 1,
        "new_grad_accum": 2,
    }
    state = RunState(now=20.0, started=0.0, ranks={1: rank(1, ooms=[oom], fallbacks=[fb]), 0: rank(0)})
    (v,) = diagnose(state)
    assert v.kind == "oom.recovered" and v.culprit_rank == 1 and v.severity == "info"
    assert "backward" in v.summary and "8 -> 4" in v.summary


def test_fatal_oom_replaces_the_crash_of_that_rank() -> None:
    oom = {"t": 5.0, "step": 3, "phase": "forward", "mem_alloc": 2**30}
    r1 = rank(1, ooms=[oom], alive=False, exit={"t": 5.1, "code": 1})
    state = RunState(now=20.0, started=0.0, ranks={1: r1, 0: rank(0)}, job_exit={"code": 1, "t": 6})
    assert [(v.kind, v.culprit_rank) for v in diagnose(state)] == [("oom", 1)]


# -- parsing ----------------------------------------------------------------------------------

TORCHRUN_TAIL = """\
Failures:
[1]:
  time      : 2026-12-02_10:08:18
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 7695)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 7695
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_10:08:18
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 7694)  (SIGABRT)
  error_file: <N/A>
""".splitlines()


def test_parse_torchrun_failures() -> None:
    failures = parse_launcher_failures(TORCHRUN_TAIL)
    assert failures == [
        {"rank": 0, "local_rank": 0, "exitcode": -6, "pid": 7694, "root_cause": True},
        {"rank": 1, "local_rank": 1, "exitcode": -15, "pid": 7695, "root_cause": False},
    ]


def test_last_traceback_from_stderr() -> None:
    lines = [
        "noise",
        "Traceback (most recent call last):",
        '  File "/u/a.py", line 3, in <module>',
        "    main()",
        '  File "/u/a.py", line 2, in main',
        "    1/0",
        "ZeroDivisionError: division by zero",
    ]
    assert last_traceback(lines) == [
        "/u/a.py:3 in <module>",
        "/u/a.py:2 in main",
        "ZeroDivisionError: division by zero",
    ]


def test_fresh_oom_waits_for_the_fallback_while_the_rank_lives() -> None:
    oom = {"t": 15.0, "step": 3, "phase": "backward"}
    state = RunState(now=20.0, started=0.0, ranks={1: rank(1, ooms=[oom]), 0: rank(0)})
    assert diagnose(state) == []
    state.now = 30.0  # no fallback 15 s later: the step did not recover
    assert [(v.kind, v.culprit_rank) for v in diagnose(state)] == [("oom", 1)]


# -- replicas ---------------------------------------------------------------------------------


def _replicas(r: int, digest: str, warn: bool = False) -> RankState:
    state = rank(r, step=8, replicas=[{"kind": "replicas", "step": 8, "params_sha256": digest}])
    if warn:
        state.warnings.append(
            {"kind": "warning", "code": "replicas_differ", "message": "UNet weights differ"}
        )
    return state


def _ended(*ranks: RankState) -> RunState:
    return RunState(now=NOW, started=900.0, ranks={r.rank: r for r in ranks}, world_size=len(ranks))


@pytest.mark.parametrize(
    "ranks, culprit",
    [
        ((_replicas(0, "a" * 64), _replicas(1, "b" * 64, warn=True)), None),  # two ranks: who is right?
        ((_replicas(0, "a" * 64), _replicas(1, "a" * 64), _replicas(2, "c" * 64)), 2),  # the odd one out
        ((rank(0, step=8), _replicas(1, "a" * 64, warn=True)), None),  # only the warning survived
    ],
)
def test_diverged_replicas_are_an_error(ranks, culprit):
    (v,) = diagnose(_ended(*ranks))
    assert (v.kind, v.severity, v.culprit_rank) == ("replicas.differ", "error", culprit)
    assert "diverged" in v.summary


def test_equal_replicas_are_no_verdict():
    assert diagnose(_ended(_replicas(0, "a" * 64), _replicas(1, "a" * 64))) == []


@pytest.mark.parametrize(("died_after", "severity"), [(4.0, "warning"), (120.0, "error")])
def test_crash_right_after_the_flight_recorder_dump_is_not_blamed_as_a_cause(
    died_after: float, severity: str
) -> None:
    asked_at = NOW - 200.0
    r1 = rank(1, alive=False, exit={"t": asked_at + died_after, "signal": 11})
    state = RunState(
        now=NOW,
        started=0.0,
        ranks={0: rank(0), 1: r1},
        job_exit={"code": 1, "t": NOW},
        flight_recorder={"ranks": {}, "asked_at": asked_at},
    )
    (v,) = [v for v in diagnose(state) if v.kind == "crash"]
    assert (v.culprit_rank, v.severity) == (1, severity)
    assert ("flight-recorder" in v.summary) == (severity == "warning")


def _thread_death(t: float, error: str, caller: str, kind: str = "RuntimeError") -> dict[str, Any]:
    message = f"thread 'meter' ended with {kind}: {error}"
    return {"kind": "warning", "code": "thread_exception", "t": t, "message": message, "thread": "meter",
            "type": kind, "error": error, "caller": caller, "traceback": [f"{caller} in run"]}  # fmt: skip


def test_a_thread_that_only_lost_its_peer_in_a_crash_is_no_finding_of_its_own() -> None:
    """Rank 1 was killed; rank 0's meter thread then died of "Connection closed by peer": that is
    the crash's consequence. Its upload thread's own error earlier is a finding, said once."""
    survivor = rank(0, alive=False, exit={"t": 10.4, "signal": 15})
    survivor.warnings = [
        _thread_death(5.0, "bucket not found", "/u/train.py:70", "OSError"),
        _thread_death(6.0, "bucket not found", "/u/train.py:70", "OSError"),
        _thread_death(10.2, "Connection closed by peer [127.0.0.1]:5000", "/u/train.py:50"),
    ]
    state = RunState(
        now=20.0,
        started=0.0,
        ranks={0: survivor, 1: rank(1, alive=False, exit={"t": 10.0, "signal": 9})},
        world_size=2,
        last_progress=9.0,
        job_exit={"code": 1, "t": 11.0},
    )
    verdicts = diagnose(state)
    assert [v.kind for v in verdicts] == ["crash", "thread.died"], verdicts
    died = verdicts[1]
    assert (died.severity, died.culprit_rank, died.location) == ("warning", 0, "/u/train.py:70"), died
    assert "rank 0's thread 'meter' died of OSError: bucket not found" in died.summary, died.summary


def test_a_rank_killed_without_a_record_says_where_its_last_snapshot_saw_it() -> None:
    """The heartbeat writes where the main thread is (`main_at`) into each snapshot: a rank killed
    by SIGKILL is named at that line, with how long before its death it was seen there, unless
    its peers completed calls after that snapshot that took it too (it had moved on)."""
    survivor = rank(0, alive=False, exit={"t": 10.2, "signal": 15}, done={**call(4), "t": 9.0})
    killed = rank(1, alive=False, exit={"t": 10.0, "signal": 9}, done=call(4, caller="/u/t.py:61"), issued=4)
    killed.state.update(t=9.6, main_at={"at": "/u/t.py:58", "function": "fill"})
    state = RunState(now=20.0, started=0.0, ranks={0: survivor, 1: killed}, job_exit={"code": 1, "t": 11})
    (v,) = diagnose(state)
    assert (v.kind, v.culprit_rank, v.location) == ("crash", 1, "/u/t.py:58"), v
    assert v.summary.startswith(
        "rank 1 died first: it was killed by signal 9 (SIGKILL); "
        "its main thread was at /u/t.py:58 in fill() 0.4 s before it ended"
    ), v.summary
    # rank 0 completed all_reduce #6 (t=9.3) where rank 1's snapshot had issued #4: it is behind
    survivor.state = {**survivor.state, "collectives": {"last_done": {**call(6), "t": 9.3}}}
    (v,) = diagnose(state)
    assert v.location == "/u/t.py:61" and "its last completed collective was all_reduce #4" in v.summary, v
    # ... but a call that ended as rank 1 died (broken by its death) proves nothing
    survivor.state = {**survivor.state, "collectives": {"last_done": {**call(5), "t": 9.9}}}
    (v,) = diagnose(state)
    assert v.location == "/u/t.py:58", v


def test_a_hung_rank_without_a_stack_is_placed_by_its_snapshot() -> None:
    """No py-spy stack (ptrace refused, --on-hang wait): the missing rank's own snapshot says
    where its main thread is, a fresher line than its last completed collective."""
    waiter = rank(0, inflight=[call(5)], issued=5)
    missing = rank(1, issued=4, done=call(4, caller="train.py:20"))
    missing.state["main_at"] = {"at": "train.py:14", "function": "load_batch"}
    (v,) = diagnose(hung(waiter, missing))
    assert (v.kind, v.culprit_rank, v.location) == ("hang.missing_rank", 1, "train.py:14"), v
    assert "its main thread is at train.py:14 in load_batch()" in v.summary, v.summary
    missing.stack = {"ok": True, "top_user_frame": "train.py:15", "top_user_function": "decode"}
    (v,) = diagnose(hung(waiter, missing))
    assert v.location == "train.py:15", v  # a stack, when there is one, comes first


def test_a_world_the_jobs_processes_cannot_fill_is_known_only_when_it_cannot_be_filled() -> None:
    """Ranks in init_process_group for 4 ranks: unreachable with mp.spawn's nprocs=2 on a loopback
    rendezvous, or a launcher that starts 2; not with another host's address (another node's workers
    may start later), not with 4 processes, and not before the hang timeout."""

    def waiting(r: int, addr: str = "127.0.0.1", since: float = NOW - 10) -> RankState:
        state = rank(r, phase=None)
        state.state["waiting"] = {
            "what": "init_process_group",
            "since": since,
            "caller": "w.py:3",
            "world_size": 4,
        }
        state.comm_env = {"MASTER_ADDR": addr}
        return state

    found = hung(waiting(0), waiting(1), spawned_nprocs=2).unreachable_world()
    assert found is not None and (found["waiting_for"], found["processes"]) == (4, 2), found
    assert hung(waiting(0), waiting(1), launcher_world_size=2).unreachable_world() is not None
    assert hung(waiting(0, "10.0.0.5"), waiting(1, "10.0.0.5"), spawned_nprocs=2).unreachable_world() is None
    assert hung(waiting(0), waiting(1), spawned_nprocs=4).unreachable_world() is None
    assert hung(waiting(0), waiting(1, since=NOW - 1), spawned_nprocs=2).unreachable_world() is None
    assert hung(waiting(0), waiting(1)).unreachable_world() is None  # a shell script: no count known
