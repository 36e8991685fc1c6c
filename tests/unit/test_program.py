"""The program learned from the agreed steps (docs/DESIGN.md §8.3): learning a run a second
time only counts it again — the same program as learning every run from scratch, to the
counts "seen followed more than once" reads."""

from __future__ import annotations

from dataclasses import fields

from moe_hang.analysis.program import Program
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.stacks import Frame


def _c(seq: int, op: str, size: int, line: int | None = None, pg: str = "1") -> Collective:
    return Collective(pg=pg, seq=seq, op=op, pg_desc="mesh_tp", input_sizes=[[size]],
                      dtypes=["Float"], completed=True,
                      frames=[Frame("/job/train.py", line, "step")] if line else [])


def _runs() -> list[list[Collective]]:
    a = [_c(s, "all_gather", 8) for s in range(1, 4)] + [_c(4, "all_reduce", 1)]
    b = [_c(s, "all_gather", 8, line=10 + s) for s in range(1, 4)]
    gap = [_c(1, "all_gather", 8), _c(3, "all_reduce", 1)]  # not consecutive: learned in full
    # the same run three times (every member of a group, every group of a kind), others between
    return [a, b, a, gap, a, b, gap]


def _public(p: Program) -> dict[str, object]:
    return {f.name: getattr(p, f.name) for f in fields(p) if not f.name.startswith("_")}


def test_a_run_learned_again_only_counts_again() -> None:
    replayed, fresh = Program(), Program()
    for run in _runs():
        replayed.learn(run)
        replayed.learn_order(run)
        fresh.learn(run)
        fresh.learn_order(run)
        fresh._learned.clear()  # nothing to replay: every run learned from scratch
    assert replayed._learned  # the replay was taken
    assert _public(replayed) == _public(fresh)
    # by shape, an all-gather is followed three times in each run of a (by the two next
    # all-gathers and the all-reduce), twice in each of b; gap's seqs are not consecutive
    key = ("within", ("mesh_tp", "all_gather", ((8,),), ("Float",)))
    assert replayed.seen_after[key] == 3 * 3 + 2 * 2


def test_learning_by_numbered_keys_is_learning_every_run_from_scratch() -> None:
    """``learn`` numbers each distinct collective (by what its keys read, lists by identity:
    the loader shares them) and finds a run learned before by its numbers: the same program
    as every member's run learned from its keys — with lists shared between ranks, lists
    equal but not shared, and two collectives alike but for one field each."""
    from moe_hang.analysis.program import agreed_runs, learn
    from moe_hang.analysis.rankstate import rank_view
    from moe_hang.analysis.timeline import RankViews
    from moe_hang.evidence.flight_recorder import FRDump, PgStatus
    from moe_hang.evidence.model import RankEvidence

    sizes, floats = [[8]], ["Float"]  # lists shared between ranks
    stack, none = [Frame("/job/train.py", 11, "step")], []

    def rank(r: int) -> RankEvidence:
        entries = []
        for s in range(1, 9):
            c = _c(s, "all_gather" if s % 4 else "all_reduce", 8, line=11 if s % 2 else None)
            if r % 2:  # the odd ranks' lists shared between them, the even ranks' their own
                c.input_sizes, c.dtypes = sizes, floats
                c.frames = stack if s % 2 else none
            if r == 3 and s == 5:
                c.dtypes = ["BFloat16"]  # alike rank 1's but for its dtype
            if r == 3 and s == 7:
                c.pg_desc = "mesh_dp"  # alike rank 1's but for its group's kind
            c.record_id = s
            entries.append(c)
        fr = FRDump(entries=entries, pg_status={"1": PgStatus(8, 8)})
        return RankEvidence(rank=r, alive=True, progressed=False, fr=fr)

    views = RankViews((r, rank_view(rank(r))) for r in range(4))
    learned = learn(views, {})
    fresh = Program()
    for run in agreed_runs(views, {}):
        fresh.learn(run)
        fresh.learn_period(run)
        fresh._learned.clear()
    for r in views:
        for order in views.thread_orders(r):
            fresh.learn_order(order)
            fresh._learned.clear()
    assert learned._learned  # runs were found again by their numbers
    assert _public(learned) == _public(fresh)
    assert ("mesh_dp", "all_gather", ((8,),), ("Float",)) in learned.seen_coarse
    assert ("mesh_tp", "all_gather", ((8,),), ("BFloat16",)) in learned.seen_coarse
