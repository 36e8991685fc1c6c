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
source places at the last call by name before the stack's line (``_held_behind``, the same
op now allowed where the thread is known). One camp of seven: C, by its history."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_captures


@pytest.mark.parametrize(("name", "culprit"), [("async_skip_held_0", 5), ("async_skip_held_1", 7)])
def test_a_rank_held_behind_its_async_post_is_at_that_posts_line(fixtures, name, culprit):
    d = diagnose(load_captures([fixtures / name])).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    assert d["culprit_basis"] == "history", d["culprit_basis"]
    div = d["first_divergence"]
    # every other rank's collective there is the token count, posted at 46: one camp
    sites = {int(r): c["callsite"]["line"] for r, c in div["per_rank"].items()
             if c and c.get("callsite")}
    assert sites[culprit] == 51 and all(v == 46 for r, v in sites.items() if r != culprit)
    at = {r["rank"]: r["callsite"]["line"] for r in d["ranks"]}
    assert at[culprit] == 51 and sum(v == 46 for v in at.values()) >= 6, at
