"""Straggler arithmetic (sddoctor.supervise.straggler) on arrivals modelled as DDP makes them: every
collective starts on all ranks once the last one arrived, so the fast ranks wait and every rank has
the same period. The end-to-end runs (real ranks, injected sleeps) are in tests/test_real_clients.py."""

from __future__ import annotations

import pytest

from sddoctor.supervise.diagnose import diagnose
from sddoctor.supervise.state import Arrival, RankState, RunState
from sddoctor.supervise.straggler import StragglerTracker, analyse

NOW = 10_000.0


def synced(computes: list[float], n: int = 30, inside: float = 0.001, late: dict[int, tuple[int, float]] | None = None,
           steps: bool = True) -> dict[int, RankState]:  # fmt: skip
    """Ranks that each compute `computes[r]` seconds, then meet in one collective (a step each).
    `late={k: (rank, seconds)}` makes one rank late by that much at collective k only."""
    ranks = {r: RankState(rank=r, state={"t": NOW}, alive=True) for r in range(len(computes))}
    t = NOW - 50.0
    for k in range(n):
        arrive = {r: t + c for r, c in enumerate(computes)}
        if late and k in late:
            arrive[late[k][0]] += late[k][1]
        done = max(arrive.values()) + inside
        for r, rank in ranks.items():
            rank.arrivals.setdefault("0", {})[k + 1] = Arrival(
                enqueue=arrive[r], caller="train.py:9", duration=done - arrive[r]
            )
            if steps:
                rank.steps.append((done, k + 1, None, 8.0))
                rank.step_count += 1
        t = done
    return ranks


def state_of(ranks: dict[int, RankState], ratio: float = 2.0) -> RunState:
    return RunState(now=NOW, started=0.0, ranks=ranks, last_progress=NOW, straggler_ratio=ratio)


def stragglers(state: RunState) -> list[int | None]:
    return [v.culprit_rank for v in diagnose(state) if v.kind == "straggler"]


@pytest.mark.parametrize(
    ("computes", "culprit"),
    [
        pytest.param([0.01, 0.50, 0.01], 1, id="sleepy-rank-1-of-3"),
        pytest.param([0.30, 0.30], None, id="balanced"),
        pytest.param([0.002, 0.006], None, id="tiny-noise-is-not-a-straggler"),
        pytest.param([0.20, 0.35], None, id="below-ratio"),
        pytest.param([0.05, 0.05, 0.05, 0.40], 3, id="last-of-4"),
    ],
)
def test_who_is_a_straggler(computes: list[float], culprit: int | None) -> None:
    found = stragglers(state_of(synced(computes)))
    assert found == ([] if culprit is None else [culprit])


@pytest.mark.parametrize("jitter", [0.0, 0.004], ids=["tied", "trading-places"])
def test_two_equally_slow_ranks_of_four_are_one_finding_that_names_both(jitter: float) -> None:
    """Two GPUs of four throttle: ranks 1 and 3 each take 0.4 s where the others take 0.05 s. Who
    of the two is last is a tie, or a few ms either way; each alone is never 'most of the waiting',
    but together they keep the others waiting at every step."""
    ranks = synced([0.05, 0.40, 0.05, 0.40], n=40)
    for k in range(1, 41):
        ranks[1 + 2 * (k % 2)].arrivals["0"][k].enqueue += jitter
    (v,) = [v for v in diagnose(state_of(ranks)) if v.kind == "straggler"]
    assert v.culprit_rank in (1, 3) and v.details["ranks"][0] == v.culprit_rank, v.details
    assert sorted(v.details["ranks"]) == [1, 3], v.details
    assert v.summary.startswith("stragglers: ranks 1, 3 are each slower than the others"), v.summary


def test_a_slower_majority_is_not_a_set_of_stragglers() -> None:
    assert stragglers(state_of(synced([0.05, 0.40, 0.40, 0.40], n=40))) == []


def test_the_tracker_keeps_one_episode_while_equally_slow_ranks_trade_places() -> None:
    tracker = StragglerTracker(confirm_seconds=0.0, confirm_steps=0)
    declared = []
    for k in range(6):
        ranks = synced([0.05, 0.40, 0.05, 0.40], n=40)
        ranks[1 if k % 2 else 3].arrivals["0"][40].enqueue += 0.01  # the slowest changes each time
        episode = tracker.update(state_of(ranks), now=NOW + k)
        declared += [episode] if episode else []
    assert len(declared) == 1 and len(tracker.episodes) == 1
    assert sorted(declared[0].finding.ranks) == [1, 3]


def test_figures_per_step() -> None:
    finding = analyse(state_of(synced([0.01, 0.31])))
    assert finding is not None and finding.rank == 1
    assert finding.unit == "step" and finding.period == pytest.approx(0.311, abs=0.002)
    assert finding.seconds_per_unit == pytest.approx(0.31, abs=0.01)
    assert finding.others_seconds_per_unit == pytest.approx(0.01, abs=0.005)
    assert finding.others_wait_share == pytest.approx(0.3 / 0.311, abs=0.02)
    assert finding.last_share == 1.0


def test_one_late_arrival_is_not_a_straggler() -> None:
    """A compile or a checkpoint save: rank 1 is 20 s late once, then every rank is as fast again."""
    ranks = synced([0.05, 0.05], n=40, late={5: (1, 20.0)})
    assert stragglers(state_of(ranks)) == []


def test_one_long_stall_of_a_slightly_later_rank_is_not_a_straggler() -> None:
    """Rank 1 is a little later at every step (well below the ratio) and once stalls 9 s (a
    stuck read that then resolved): the stall is most of its lateness and of the others' wait,
    but one late arrival, reported as a stall, not as a rank that keeps the others waiting."""
    ranks = synced([0.05, 0.06], n=40, late={30: (1, 9.0)})
    finding = analyse(state_of(ranks))
    assert finding is not None and finding.rank == 1 and finding.heavy_rounds == 1
    assert stragglers(state_of(ranks)) == []
    twice = synced([0.05, 0.06], n=40, late={20: (1, 9.0), 30: (1, 9.0)})
    assert stragglers(state_of(twice)) == []
    assert stragglers(state_of(synced([0.05, 0.06], n=40, late={30: (1, 0.005)}))) == []


def test_ranks_taking_turns_are_not_stragglers() -> None:
    ranks = synced([0.05, 0.05], n=40)
    for k in range(1, 41):  # whoever is last changes every collective, by 0.1 s
        ranks[k % 2].arrivals["0"][k].enqueue += 0.1
    assert stragglers(state_of(ranks)) == []


def test_without_steps_the_unit_is_a_collective() -> None:
    finding = analyse(state_of(synced([0.01, 0.4], steps=False)))
    assert finding is not None and finding.rank == 1 and finding.unit == "collective"
    assert stragglers(state_of(synced([0.01, 0.4], steps=False))) == [1]


def test_the_tracker_declares_only_what_persists() -> None:
    tracker = StragglerTracker(confirm_seconds=10.0, confirm_steps=5)
    ranks = synced([0.01, 0.5], n=30)
    state = state_of(ranks)
    assert tracker.update(state, now=NOW) is None  # first seen
    assert tracker.update(state, now=NOW + 5) is None  # not long enough yet
    for k in range(31, 37):  # six more steps
        for rank in ranks.values():
            rank.steps.append((NOW + k, k, None, 8.0))
            rank.step_count += 1
    episode = tracker.update(state, now=NOW + 11)
    assert episode is not None and episode.rank == 1
    episode.cause = {"location": "train.py:4", "function": "load", "share": 0.9, "samples": 100}
    episode.ready = True
    state.straggler_episodes = [e.to_dict() for e in tracker.episodes.values()]
    (v,) = [v for v in diagnose(state) if v.kind == "straggler"]
    assert (v.culprit_rank, v.location) == (1, "train.py:4")
    assert "train.py:4 in load()" in v.summary and "they wait for it at train.py:9" in v.summary


def test_a_hot_line_few_samples_share_is_not_named() -> None:
    """Sampled as a short job ended, after its slow part, the straggler's busiest line held 6% of
    the samples: that says nothing of where its time goes, so the wait site is the location."""
    tracker = StragglerTracker(confirm_seconds=0.0, confirm_steps=0)
    state = state_of(synced([0.01, 0.5]))
    tracker.update(state, now=NOW)
    episode = tracker.update(state, now=NOW + 1)
    assert episode is not None
    episode.cause = {"location": "train.py:51", "function": "main", "share": 0.06, "samples": 99}
    episode.ready = True
    state.straggler_episodes = [e.to_dict() for e in tracker.episodes.values()]
    (v,) = [v for v in diagnose(state) if v.kind == "straggler"]
    assert (v.culprit_rank, v.location) == (1, "train.py:9"), v
    assert "train.py:51" not in v.summary and "its time goes" not in v.summary, v.summary
    assert v.details["cause"] is None and "6% of its 99 samples" in v.details["cause_problem"]


def test_the_tracker_forgets_a_candidate_that_stops() -> None:
    tracker = StragglerTracker(confirm_seconds=1.0, confirm_steps=0)
    slow = state_of(synced([0.01, 0.5]))
    assert tracker.update(slow, now=NOW) is None
    assert tracker.update(state_of(synced([0.05, 0.05])), now=NOW + 5) is None  # it went away
    assert tracker.update(slow, now=NOW + 6) is None  # seen again: the clock starts over
    assert tracker.episodes == {}


def test_a_supervisors_episodes_replace_the_window() -> None:
    """With a tracker (live, or its record in supervisor.json) an empty list means no straggler."""
    state = state_of(synced([0.01, 0.5]))
    state.straggler_episodes = []
    assert stragglers(state) == []


def test_straggler_location_is_where_the_others_wait_not_the_busiest_call_site() -> None:
    """Per step: one collective right after the slow part ("a.py:1") and three cheap ones after it
    ("b.py:2", the most frequent call site); rank 1 is slow before a.py:1 only."""

    def stepping(r: int, slow: float) -> RankState:
        arrivals, t, seq = {}, NOW - 30.0, 0
        for _ in range(12):
            t += 0.05 + slow
            arrivals[seq] = Arrival(enqueue=t, caller="a.py:1", duration=0.01)
            seq += 1
            for _ in range(3):
                t += 0.02
                arrivals[seq] = Arrival(enqueue=t, caller="b.py:2", duration=0.01)
                seq += 1
        return RankState(rank=r, state={"t": NOW}, alive=True, arrivals={"0": arrivals})

    # Under DDP the fast rank waits inside a.py:1, so its period matches the slow rank's: model its
    # arrivals at a.py:1 as the slow part's length earlier than rank 1's, with the wait inside it.
    fast, slow = stepping(0, 0.0), stepping(1, 0.6)
    for seq, a in fast.arrivals["0"].items():
        b = slow.arrivals["0"][seq]
        if a.caller == "a.py:1":
            a.enqueue, a.duration = b.enqueue - 0.6, 0.61
        else:
            a.enqueue = b.enqueue
    state = RunState(now=NOW, started=0.0, ranks={0: fast, 1: slow}, last_progress=NOW, straggler_ratio=2.0)
    (v,) = [v for v in diagnose(state) if v.kind == "straggler"]
    assert (v.culprit_rank, v.location) == (1, "a.py:1")


def test_the_hot_line_of_an_elastic_worker_is_its_own_code_under_torchs_record_wrapper() -> None:
    """py-spy's folded samples of a worker that torch's elastic agent started: its `@record` wrapper
    lives in torch/distributed, outside the user's frames; only a torch.distributed frame inside the
    user's line is a wait in a collective."""
    from sddoctor.codepaths import CodeRoots
    from sddoctor.supervise.stacks import hot_frame

    torch_dir = "/env/site-packages/torch"
    roots = CodeRoots(library=("/env/site-packages", "/usr/lib/python3.11", torch_dir), internal=(torch_dir,))
    outer = (
        f"_wrap ({torch_dir}/distributed/elastic/multiprocessing/api.py:706);"
        f"record.<locals>.wrap.<locals>.wrapper ({torch_dir}/distributed/elastic/multiprocessing/errors/__init__.py:367)"
    )
    raw = "\n".join(
        [
            f"thread (42): MainThread;{outer};train (/job/train.py:25);sleep ({torch_dir}/nn/modules/module.py:1778) 7",
            f"thread (42): MainThread;{outer};train (/job/train.py:26);"
            f"all_reduce ({torch_dir}/distributed/distributed_c10d.py:2800) 5",
            f"thread (42): MainThread;{outer};train (/job/train.py:27) 1",
            "thread (42): MainThread;_shutdown (/usr/lib/python3.11/threading.py:1590) 2",
            "thread (43): other;run (/job/train.py:90) 50",
        ]
    )
    hot = hot_frame(raw, 42, roots)
    assert hot == {"location": "/job/train.py:25", "function": "train", "share": 0.7, "samples": 10}, hot


def test_a_rank_waiting_for_its_dataloader_is_placed_at_its_workers_busiest_line() -> None:
    """py-spy `--subprocesses` prefixes each sample with its processes; the rank's main thread waits
    in torch's DataLoader at the user's loop line, its worker's main thread reads a sample."""
    from sddoctor.codepaths import CodeRoots
    from sddoctor.supervise.stacks import hot_frame

    torch_dir = "/env/site-packages/torch"
    roots = CodeRoots(library=("/env/site-packages", "/usr/lib/python3.11", torch_dir), internal=(torch_dir,))
    rank, worker = (
        'process 42:"python train.py";',
        'process 42:"python train.py";process 50:"python train.py";',
    )
    wait = f"__next__ ({torch_dir}/utils/data/dataloader.py:733);_get_data ({torch_dir}/utils/data/dataloader.py:1285)"
    worker_loop = f"_worker_loop ({torch_dir}/utils/data/_utils/worker.py:349)"
    raw = "\n".join(
        [
            f"{rank}thread (42): MainThread;main (/job/train.py:30);{wait} 45",
            f"{rank}thread (42): MainThread;main (/job/train.py:31) 5",
            f"{worker}thread (50): MainThread;{worker_loop};__getitem__ (/job/data.py:12);sleep (/usr/lib/python3.11/x.py:1) 80",
            f"{worker}thread (50): MainThread;{worker_loop} 20",
            f"{worker}thread (51): QueueFeederThread;run (/usr/lib/python3.11/threading.py:1) 99",
        ]
    )
    hot = hot_frame(raw, 42, roots)
    assert hot == {
        "location": "/job/train.py:30",
        "function": "main",
        "share": 0.9,
        "samples": 50,
        "waits_for": "dataloader",
        "worker": {"location": "/job/data.py:12", "function": "__getitem__", "share": 0.8, "samples": 100},
    }, hot


def test_the_snapshots_hot_line_counts_positions_since_the_episode_began() -> None:
    from sddoctor.supervise.state import RankState
    from sddoctor.supervise.straggler import snapshot_hot_line

    rank = RankState(rank=1)
    rank.positions = [(float(t), "t.py:5", "load") for t in range(10)]  # before the episode
    rank.positions += [(float(t), "t.py:9", "augment") for t in range(10, 16)]
    rank.positions += [(float(t), "t.py:12", "main") for t in range(16, 18)]
    cause = snapshot_hot_line(rank, since=10.0)
    assert cause == {
        "location": "t.py:9",
        "function": "augment",
        "share": 0.75,
        "samples": 8,
        "source": "snapshots",
    }
    assert snapshot_hot_line(rank, since=14.0) is None  # 4 snapshots say too little
