"""The rate of a helper thread fed by the main loop (analysis/rate.py): one collective per lap,
learned from every rank's own posting order; and where nothing is claimed (another rate, a
thread that falls behind, a history the recorder no longer holds). Two ranks, both roles."""

from __future__ import annotations

import pytest

from moe_hang.analysis import rate
from moe_hang.analysis.rankstate import rank_view
from moe_hang.analysis.timeline import RankViews
from moe_hang.evidence.flight_recorder import Collective, FRDump, PgStatus
from moe_hang.evidence.model import RankEvidence
from moe_hang.evidence.stacks import Frame, ThreadStack

MAIN, LOGGER = "1000", "2000"
JOB = "/job/train.py"


def _rank(r: int, laps: int, posts_in_lap: list[int], thread_alive: bool,
          first_seq: int = 1) -> RankEvidence:
    """Main posts one all-reduce per lap on group 0; the thread posts its group-2 all-reduces
    in the laps listed (``posts_in_lap[j]``: the lap after whose main all-reduce the j-th
    comes); its last one is pending where the thread is still alive."""
    entries: list[Collective] = []
    rid = 0

    def add(pg: str, seq: int, tid: str, line: int, done: bool) -> None:
        nonlocal rid
        rid += 1
        entries.append(Collective(pg=pg, seq=seq, op="all_reduce", input_sizes=[[4 if pg == "0"
                                                                                 else 2]],
                                  dtypes=["Float"], record_id=rid, time_created_ns=rid,
                                  completed=done, thread_id=tid,
                                  frames=[Frame(JOB, line, "f")]))

    seq2 = 0
    for lap in range(1, laps + 1):
        if lap >= first_seq:
            add("0", lap, MAIN, 9, True)
        for _ in range(posts_in_lap.count(lap)):
            seq2 += 1
            last = seq2 == len(posts_in_lap)
            add("2", seq2, LOGGER, 6, not (last and thread_alive))
    threads = [ThreadStack("MainThread", [Frame(JOB, 12, "<module>")], thread_id=MAIN,
                           is_main=True)]
    if thread_alive:
        threads.append(ThreadStack("metrics", [Frame(JOB, 6, "log_metrics")],
                                   thread_id=LOGGER))
    fr = FRDump(entries=entries, pg_status={"0": PgStatus(laps, laps),
                                            "2": PgStatus(seq2, seq2 - thread_alive)},
                pg_ranks={"0": (0, 1), "2": (0, 1)}, backend="gloo")
    return RankEvidence(rank=r, alive=True, progressed=False, fr=fr, threads=threads)


def _views(*ranks: RankEvidence) -> RankViews:
    return RankViews((r.rank, rank_view(r)) for r in ranks)


@pytest.mark.parametrize("culprit", [0, 1])
def test_a_thread_that_ended_one_short_broke_the_rate(culprit: int) -> None:
    short = _rank(culprit, 5, [1, 2, 3, 5], thread_alive=False)  # no item at lap 4
    full = _rank(1 - culprit, 5, [1, 2, 3, 4, 5], thread_alive=True)
    views = _views(short, full)
    assert rate.laps(views, "2", [0, 1]) == 5
    assert rate.deviates(views, "2", [0, 1]) == {culprit: True, 1 - culprit: False}
    assert rate.rate_vote([culprit], [1 - culprit], "2", views) is True
    assert rate.rate_vote([1 - culprit], [culprit], "2", views) is False


@pytest.mark.parametrize("culprit", [0, 1])
def test_a_thread_blocked_past_one_per_lap_posted_an_extra(culprit: int) -> None:
    extra = _rank(culprit, 5, [1, 2, 2, 3, 4, 5], thread_alive=True)  # two items at lap 2
    ended = _rank(1 - culprit, 5, [1, 2, 3, 4, 5], thread_alive=False)
    views = _views(extra, ended)
    assert rate.rate_vote([culprit], [1 - culprit], "2", views) is True


def test_a_thread_behind_its_queue_is_not_known_to_be_short() -> None:
    """Blocked at its third with five laps run: a backlog it may still post, or a skip."""
    behind = _rank(0, 5, [1, 2, 3], thread_alive=True)
    ended = _rank(1, 5, [1, 2, 3, 4, 5], thread_alive=False)
    views = _views(behind, ended)
    assert rate.deviates(views, "2", [0, 1]) == {0: None, 1: False}
    assert rate.rate_vote([0], [1], "2", views) is None


def test_a_thread_fed_every_other_lap_keeps_no_one_per_lap_rate() -> None:
    """One item every second lap: the rate is not one per lap, so nothing is claimed (an
    integer count alone would have blamed the rank that kept the program)."""
    a = _rank(0, 4, [2, 4], thread_alive=False)
    b = _rank(1, 4, [2, 3, 4], thread_alive=True)  # one more, at lap 3
    views = _views(a, b)
    assert rate.laps(views, "2", [0, 1]) is None
    assert rate.rate_vote([0], [1], "2", views) is None


def test_a_thread_two_laps_behind_keeps_no_pace() -> None:
    slow = _rank(0, 6, [3, 4, 5, 6], thread_alive=False)
    ok = _rank(1, 6, [1, 2, 3, 4, 5, 6], thread_alive=True)
    assert rate.laps(_views(slow, ok), "2", [0, 1]) is None


def test_a_recorder_that_lost_the_first_laps_claims_nothing() -> None:
    """The ring buffer dropped the main loop's first collectives: its laps are not counted."""
    a = _rank(0, 5, [1, 2, 3, 5], thread_alive=False, first_seq=3)
    b = _rank(1, 5, [1, 2, 3, 4, 5], thread_alive=True, first_seq=3)
    assert rate.laps(_views(a, b), "2", [0, 1]) is None
