"""A count shift that the loop's one branch decides (exploration seed 31337001, job 6, and the
same shape in 20261208 job 16 and 61827304 job 12: ``async`` extra, a two-stage pipeline,
``MOE_HANG_FR_STACKS=0``, both roles). Every collective on the default group is a size-1
all-reduce posted with ``async_op=True``; one rank also logs a gradient norm under ``if FAULTY
and step == FAULT_STEP:``; they all pair silently, and at the end the rank with the extra
waits in its last loss all-reduce as the number the other waits in, in the barrier right
after the loop. Two ranks, one on each side: the counts tie. The loop's only collective on
the group a branch decides is under a condition that names who runs it: the only way a pass
posts one more, none to post one fewer — the extra's side (the source rung). Where the extra
met the other's collective: the accuracy all-reduce after it in the pass, the point-to-point
calls between numbering nothing, and the other rank's last pass through to the loop's end
(``paired.paired_at``). Was: "does not decide", both named."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_captures


@pytest.mark.parametrize(("name", "culprit"), [("async_p2p_extra_nostacks_0", 0),
                                               ("async_p2p_extra_nostacks_1", 1)])
def test_the_loops_one_branch_under_a_rank_condition_names_the_extra(fixtures, name, culprit):
    d = diagnose(load_captures([fixtures / name])).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    assert d["culprit_basis"] == "source", d["culprit_basis"]
    div = d["first_divergence"]
    assert (div["kind"], div["seq"]) == ("extra_collective", 14), div
    lines = {int(r): c["callsite"]["line"] for r, c in div["per_rank"].items()}
    assert lines == {culprit: 48, 1 - culprit: 57}, lines
    at = {r["rank"]: r["callsite"]["line"] for r in d["ranks"]}
    assert at == {culprit: 59, 1 - culprit: 62}, at
    assert d["fix"].startswith(f"Rank {culprit} posted more collectives on default_pg than "
                               f"rank {1 - culprit} before "), d["fix"]
    assert d["fix"].endswith("_async_p2p.py:48 <module>."), d["fix"]
