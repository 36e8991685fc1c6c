"""The stack and the recorder dump of a rank are taken side by side, not at one instant: on a
loaded machine the stack of a rank caught still inside a collective can be older than its
recorder's dump, which shows that collective (and every later one) completed. The rank moved
during the capture; the fresher source wins. Found on a healthy watched job (one rank paused
12 s, the stall capture came as it woke) that was called RANK_DIED: the stale stack made the
other rank "wait", so the paused rank, which had finished cleanly, "left early"."""

from __future__ import annotations

import pytest
from conftest import captured

from moe_hang.analysis.rankstate import rank_view
from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.flight_recorder import Collective, FRDump, PgStatus
from moe_hang.evidence.model import Evidence, RankEvidence
from moe_hang.evidence.probe_records import Heartbeat
from moe_hang.evidence.stacks import Frame, ThreadStack
from moe_hang.evidence.vocab import JobState, RankState

TORCH = "/x/site-packages/torch/distributed/distributed_c10d.py"


def _in(op: str, line: int) -> list[ThreadStack]:
    return [ThreadStack("MainThread", [Frame(TORCH, 9, op), Frame("/job/train.py", line, "step")],
                        is_main=True)]


def _fr(n: int, pending: bool = False, saved: bool = False) -> FRDump:
    """``n`` all-reduces then a barrier on the default group; the last one pending or not."""
    ops = ["all_reduce"] * n + ["barrier"]
    entries = [Collective(pg="0", seq=s, op=op, input_sizes=[[8]] if op != "barrier" else [[1]],
                          dtypes=["Float"], time_created_ns=1000 * s, record_id=s,
                          completed=not (pending and s == len(ops)),
                          frames=[Frame(TORCH, 9, op), Frame("/job/train.py", 30, "step")])
               for s, op in enumerate(ops, start=1)]
    done = len(ops) - 1 if pending else len(ops)
    return FRDump(entries, {"0": PgStatus(len(ops), done)}, pg_ranks={"0": (0, 1)},
                  backend="gloo")


def _finished(rank: int, posted: int) -> RankEvidence:
    """Exited 0 after its last beat, from the interpreter's exit, counted ``posted``."""
    return RankEvidence(rank=rank, alive=False, exit_code=0, heartbeat=Heartbeat(
        rank=rank, progress={"phase": "exiting"}, pg_status={"0": PgStatus(posted, posted)}))


def _late_stack(rank: int, *, op: str = "all_reduce", pending: bool = False) -> RankEvidence:
    """Alive, its stack still in ``op`` (py-spy's sample), its recorder asked for beside it."""
    return RankEvidence(rank=rank, alive=True, progressed=False, threads=_in(op, 30),
                        fr=_fr(5, pending=pending))


def _ev(*ranks: RankEvidence) -> Evidence:
    return Evidence(ranks={r.rank: r for r in ranks}, world_size=len(ranks),
                    job=JobState.STALLED)


@pytest.mark.parametrize("paused", [0, 1])
def test_a_stack_older_than_the_recorders_dump_is_not_a_wait(paused: int) -> None:
    """The paused rank woke and finished (its final count: every collective); the other's
    stack is still in the all-reduce while its recorder, dumped after, has all six done:
    nobody waits, nobody left early, and nothing ends the job."""
    ev = _ev(_finished(paused, 6), _late_stack(1 - paused))
    d = diagnose(captured(ev))
    assert d.verdict != "rank_died" and d.culprit_ranks == [], (d.rule_id, d.summary)
    assert d.certainty != "definite" or d.verdict == "healthy", (d.rule_id, d.summary)
    v = rank_view(ev.ranks[1 - paused])
    assert v.state != RankState.IN_COLLECTIVE and v.moved


@pytest.mark.parametrize("culprit", [0, 1])
def test_a_rank_whose_recorder_still_has_it_pending_waits(culprit: int) -> None:
    """The same stack with the barrier still pending in its recorder: the stack is not stale,
    it waits, and a rank that exited short of the barrier left it waiting."""
    ev = _ev(_finished(culprit, 5), _late_stack(1 - culprit, op="barrier", pending=True))
    d = diagnose(captured(ev))
    assert (d.verdict, d.culprit_ranks) == ("rank_died", [culprit]), d.summary
    assert not rank_view(ev.ranks[1 - culprit]).moved


@pytest.mark.parametrize("culprit", [0, 1])
def test_a_recv_the_recorder_does_not_see_is_still_a_wait(culprit: int) -> None:
    """gloo's recorder has no send/recv: nothing pending in it says nothing of a recv."""
    ev = _ev(_finished(culprit, 6), _late_stack(1 - culprit, op="recv"))
    v = rank_view(ev.ranks[1 - culprit])
    assert v.state == RankState.IN_COLLECTIVE and not v.moved


def test_a_saved_recorder_is_older_than_the_stack_and_proves_nothing() -> None:
    """The probe's periodic save predates the capture: the stack stands."""
    r = _late_stack(0)
    r.fr_saved = True
    v = rank_view(r)
    assert v.state == RankState.IN_COLLECTIVE and not v.moved
