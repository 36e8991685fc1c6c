"""A stack in a collective call is in the newest one its thread posted (fresh seed 27364518,
job 67, ``async`` skip, 8 ranks, ``MOE_HANG_FR_STACKS=0``, both roles). Each step posts its
token count with ``async_op=True`` (46), then all-reduces the gradients synchronously (51);
rank C skipped its accuracy all-reduce a step before, so its gradients (161) meet the
others' token count (1) and gloo aborts one of them. Five of the others died with both
pending — the token count "scheduled" (not waited yet), their stacks in the gradient
all-reduce's call. Was: their token count placed at the stack's line (51) because the ops
match, so they split from the two whose records placed it at 46 — and the majority named
those two. The thread posted the gradient all-reduce after the token count: its stack is in
the later call (``rankstate.posted_after``); it is held behind the older one, which the
source places at the last call by name before the stack's line (``placing.held_behind``, the same
op now allowed where the thread is known; a rank that died so is held behind it too). One camp
of seven: C, by its history; the skip at the loop's branch-decided call (59), where every
other rank posted it (``paired.skipped_at``)."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_captures


@pytest.mark.parametrize(("name", "culprit"), [("async_skip_held_0", 5), ("async_skip_held_1", 7)])
def test_a_rank_held_behind_its_async_post_is_at_that_posts_line(fixtures, name, culprit):
    d = diagnose(load_captures([fixtures / name])).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    assert d["culprit_basis"] == "history", d["culprit_basis"]
    at = {r["rank"]: r["callsite"]["line"] for r in d["ranks"]}
    assert at[culprit] == 51 and sum(v == 46 for v in at.values()) >= 6, at


@pytest.mark.parametrize(("name", "culprit"), [("async_skip_held_0", 5), ("async_skip_held_1", 7)])
def test_the_skip_is_placed_at_the_branch_every_other_rank_posted(fixtures, name, culprit):
    """The divergence is the skip, where the loop's one branch-decided call is (59, the
    accuracy all-reduce): the others posted it there — every one, also the rank that went
    further than the side held in the token count (it posted as many: none skipped it)."""
    d = diagnose(load_captures([fixtures / name])).to_dict()
    div = d["first_divergence"]
    assert div["kind"] == "missing_rank", div["kind"]
    lines = {int(r): c and c["callsite"]["line"] for r, c in div["per_rank"].items()}
    assert lines == {r: (None if r == culprit else 59) for r in range(8)}, lines
    assert ":59 " in d["fix"] and "Post every collective of a pass on every rank" in d["fix"]
