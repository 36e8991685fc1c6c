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
