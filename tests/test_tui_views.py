"""The pure parts of the screen: which columns fit, line pieces, short formats, the collective a
rank waits in, and the all-ranks img/s."""

from __future__ import annotations

import pytest

from sddoctor.ranks.status import RankInputs, RankStatus, RateTracker, derive, images_total
from sddoctor.tui.format import age, gib_short, loss_short, sparkline
from sddoctor.tui.paths import elide_path
from sddoctor.tui.rowtable import Column, fit_columns
from sddoctor.tui.views import fit_pieces

COLUMNS = [
    Column("Rank"),
    Column("State"),
    Column("Loss", priority=2),
    Column("GPU", priority=3),
    Column("Call site", flex=True, min_width=10, clip=elide_path),
]


def test_fit_columns_leaves_out_the_least_important_first():
    natural = [4, 12, 6, 3, 37]
    wide, gap = fit_columns(COLUMNS, natural, 200)
    assert wide == [(0, 4), (1, 12), (2, 6), (3, 3), (4, 37)] and gap == 2
    narrow, gap = fit_columns(COLUMNS, natural, 40)
    # Rank, State, Call site (at least 10) and Loss fit with two spaces; GPU does not
    assert [i for i, _ in narrow] == [0, 1, 2, 4] and gap == 2
    assert sum(w for _, w in narrow) + gap * (len(narrow) - 1) == 40  # the flexible column takes the rest


def test_fit_columns_goes_to_one_space_before_dropping_what_must_stay():
    shown, gap = fit_columns(COLUMNS, [4, 12, 6, 3, 37], 29)
    assert [i for i, _ in shown] == [0, 1, 4] and gap == 1 and dict(shown)[4] == 11


def test_an_empty_column_is_left_out():
    shown, _ = fit_columns(COLUMNS, [4, 12, 0, 3, 37], 200)
    assert 2 not in dict(shown)


def test_fit_pieces_keeps_the_order_and_drops_by_priority():
    pieces = [(0, "node0", "bold"), (3, "load 1.50 1.20 0.90", ""), (1, "8 GPUs", ""), (0, "run: r", "")]
    assert fit_pieces(pieces, 200).plain == "node0  load 1.50 1.20 0.90  8 GPUs  run: r"
    assert fit_pieces(pieces, 30).plain == "node0  8 GPUs  run: r"
    assert fit_pieces(pieces, 5).plain == "node0  run: r"  # priority 0 stays, even past the width


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(0, "0s"), (95, "95s"), (100, "1m40s"), (725, "12m"), (11220, "3h07m"), (None, "-")],
)
def test_age(seconds, shown):
    assert age(seconds) == shown


def test_short_numbers():
    assert [loss_short(v) for v in (0.12345, 1.2345e-5, 12345.6, None)] == [
        "0.1235",
        "1.23e-05",
        "1.23e+04",
        "-",
    ]
    assert [gib_short(v) for v in (140.4 * 2**30, 53.14 * 2**30, None)] == ["140", "53.1", "-"]
    assert sparkline([0, 50, 100, 150], 6) == "   ▄██"  # padded left; 0 is blank, past the top is full


def _rank(state: str, images_s: float | None) -> RankStatus:
    return RankStatus(rank=0, node="n", state=state, images_s=images_s)


def test_all_ranks_img_s_counts_only_ranks_that_make_progress():
    ranks = [
        _rank("training", 8.0),
        _rank("collective", 8.0),
        _rank("oom-fallback", 4.0),
        _rank("hung", 8.0),
        _rank("silent", 8.0),
        _rank("exited", 8.0),
        _rank("crashed", 8.0),
        _rank("starting", None),
    ]
    assert images_total(ranks) == 20.0
    assert images_total([_rank("hung", 8.0)]) is None


def test_a_collective_is_shown_in_flight_from_one_second_on():
    def status(since: float) -> RankStatus:
        state = {
            "step": 3,
            "heartbeat": 100.0,
            "collectives": {
                "inflight": [{"op": "all_reduce", "seq": 12, "since": since, "caller": "/j/t.py:9"}]
            },
        }
        return derive(RankInputs(rank=0, node="n", state=state), RateTracker(), [], now=100.0)

    assert status(99.5).inflight is None and status(99.5).call_site == "/j/t.py:9"
    waiting = status(5.0)
    assert (
        waiting.inflight == "all_reduce #12"
        and waiting.inflight_for == 95.0
        and waiting.state == "collective"
    )
