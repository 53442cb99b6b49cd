"""SDDOCTOR_FAULT faults triggered by collectives fire at the right collective, on the right rank."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from instrument_fixtures import collectives, events, line_of, reap, start_ranks, state, wait_for

LOOP = line_of("loop-all-reduce")


def test_skip_leaves_the_rank_short_of_the_collective_and_the_others_waiting(tmp_path: Path) -> None:
    procs = start_ranks(tmp_path, 3, "loop", "6", fault="skip:rank=1,seq=3")
    try:
        waiting = wait_for(
            lambda: (
                all(collectives(tmp_path, r).get("inflight") for r in (0, 2))
                and collectives(tmp_path, 1).get("issued")
            ),
            60,
            "ranks 0 and 2 to wait in #3",
        )
        assert waiting
        hb = state(tmp_path, 1)["heartbeat"]
        wait_for(lambda: state(tmp_path, 1)["heartbeat"] > hb, 5, "rank 1's heartbeat to tick")
        assert all(p.poll() is None for p in procs), "a skip must hang the job, not crash it"
        snaps = {r: collectives(tmp_path, r) for r in range(3)}
        # SIGTERM reaches a rank blocked inside gloo (no Python handler can run there): it must
        # still die promptly of SIGTERM, with its events flushed
        started = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        procs[0].wait(timeout=10)
        took = time.monotonic() - started
    finally:
        reap(procs)
    assert procs[0].returncode == -signal.SIGTERM and took < 5
    assert events(tmp_path, 0, "exit")[-1]["status"] == "signal"
    assert events(tmp_path, 0, "exit")[-1]["code"] == 143
    for r in (0, 2):
        (c,) = snaps[r]["inflight"]
        assert (c["pg"], c["seq"], c["op"], c["caller"]) == ("0", 3, "all_reduce", LOOP)
        assert snaps[r]["issued"] == {"0": 3}
    assert snaps[1]["inflight"] == [] and snaps[1]["issued"] == {"0": 2}
    assert snaps[1]["last_done"]["seq"] == 2
    (fault,) = events(tmp_path, 1, "fault")
    assert (fault["fault"], fault["seq"], fault["op"], fault["caller"]) == (
        "skip:rank=1,seq=3",
        3,
        "all_reduce",
        LOOP,
    )
    assert not events(tmp_path, 0, "fault") and not events(tmp_path, 2, "fault")


def test_shape_makes_the_ranks_disagree_at_the_collective(tmp_path: Path) -> None:
    procs = start_ranks(tmp_path, 2, "loop", "4", fault="shape:rank=1,seq=2")
    try:
        wait_for(
            lambda: all(collectives(tmp_path, r).get("inflight") for r in (0, 1)), 60, "both ranks in #2"
        )
        snaps = {r: collectives(tmp_path, r) for r in (0, 1)}
    finally:
        reap(procs)
    (c0,), (c1,) = snaps[0]["inflight"], snaps[1]["inflight"]
    assert (c0["seq"], c1["seq"]) == (2, 2) and c0["caller"] == c1["caller"] == LOOP
    assert c0["shapes"] == [[4]] and c1["shapes"] == [[5]]
    (fault,) = events(tmp_path, 1, "fault")
    assert fault["seq"] == 2 and fault["shape"] == [5]


def test_sleep_before_a_collective_makes_the_others_wait(tmp_path: Path) -> None:
    procs = start_ranks(tmp_path, 2, "loop", "4", fault="sleep:rank=1,seconds=1.2,seq=3")
    try:
        for p in procs:
            p.wait(timeout=60)
    finally:
        reap(procs)
    assert [p.returncode for p in procs] == [0, 0]
    waited = [events(tmp_path, r, "collective")[-1]["ops"]["all_reduce"]["seconds"] for r in (0, 1)]
    # rank 0 sat in all_reduce #3 while rank 1 slept before issuing it
    assert waited[0] - waited[1] > 0.8, waited
    (fault,) = events(tmp_path, 1, "fault")  # a sleep leaves its event too, once
    assert (fault["fault"], fault["seq"], fault["caller"]) == ("sleep:rank=1,seconds=1.2,seq=3", 3, LOOP)
    assert not events(tmp_path, 0, "fault")


def test_a_fault_for_a_rank_outside_the_world_stops_the_rank_with_exit_2(tmp_path: Path) -> None:
    procs = start_ranks(tmp_path, 2, "loop", "2", fault="kill:rank=5,seq=1")
    try:
        for p in procs:
            p.wait(timeout=60)
    finally:
        outs = reap(procs)
    assert [p.returncode for p in procs] == [2, 2]
    assert all("outside the world of 2 rank(s)" in out and "Traceback" not in out for out in outs), outs


def test_kill_and_raise_at_a_collective(tmp_path: Path) -> None:
    procs = start_ranks(tmp_path, 2, "loop", "4", fault="raise:rank=0,seq=2;kill:rank=1,seq=2")
    try:
        for p in procs:
            p.wait(timeout=60)
    finally:
        reap(procs)
    assert procs[0].returncode == 1
    assert procs[1].returncode == -signal.SIGKILL
    (raised,) = events(tmp_path, 0, "fault")
    assert (raised["fault"], raised["seq"], raised["caller"], raised["op"]) == (
        "raise:rank=0,seq=2",
        2,
        LOOP,
        "all_reduce",
    )
    (exc,) = events(tmp_path, 0, "exception")
    assert exc["type"] == "InjectedFault" and exc["caller"] == LOOP
    assert "collective #2" in exc["message"]
    assert events(tmp_path, 0, "exit")[-1]["status"] == "error"
    (killed,) = events(tmp_path, 1, "fault")
    assert (killed["fault"], killed["seq"], killed["caller"]) == ("kill:rank=1,seq=2", 2, LOOP)
    assert not events(tmp_path, 1, "exit"), "SIGKILL leaves no exit event"


def test_collective_faults_take_a_process_group() -> None:
    from sddoctor.instrument.faults import parse_faults

    (sleep, kill) = parse_faults("sleep:rank=1,seconds=0.5,seq=2,every=3,pg=1;kill:rank=0,seq=4,pg=0:p2p")
    assert (sleep.get("pg"), sleep.get("every"), kill.get("pg")) == ("1", 3, "0:p2p")
