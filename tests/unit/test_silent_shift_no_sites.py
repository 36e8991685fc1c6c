"""A silent skip or extra read from the counts where the recorder keeps no call sites
(exploration seed 20261207, job 11, ``silent``, both roles: FSDP2 on 2 ranks beside a busy
neighbour, ``MOE_HANG_FR_STACKS=0``). Rank C skips its size-1 accuracy all-reduce at step
2; its loss pairs with the other's accuracy, its next token count with the other's loss, and the ops
first differ at #55: the other's token count (70) against C's first FSDP all-gather of step
3 (50, in the forward called at 71). Was: "make rank C post the collective at :70 too" — C
did post it: the three size-1 all-reduces look alike without call sites, and which one C
lacks only the source can say. C is later in the pass, at the same number the other waits
in at 70: it posted line 70's collective lower — a count shift; the group's step (17
collectives) makes a pass behind the farther reading."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


@pytest.mark.parametrize(("name", "culprit"), [("silent_fsdp_nostacks_0", 0),
                                               ("silent_fsdp_nostacks_1", 1)])
def test_a_rank_later_in_the_pass_at_the_same_number_posted_fewer(fixtures, name, culprit):
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    fix = d["fix"]
    assert fix.startswith(f"Rank {culprit} posted fewer collectives on default_pg than rank "
                          f"{1 - culprit} before "), fix
    assert "post the collective at" not in fix
    assert fix.endswith("_silent_fsdp2.py:77 <module>."), fix  # the accuracy's branch


@pytest.mark.parametrize(("name", "culprit"), [("silent_extra_nostacks_0", 0),
                                               ("silent_extra_nostacks_1", 1)])
def test_a_rank_at_an_earlier_line_at_the_same_number_is_a_pass_on(fixtures, name, culprit):
    """Fresh seed 61827304, job 84 (``silent``, FSDP2 on two nodes of one rank beside a busy
    neighbour, no call sites in the recorder, both roles): rank C's extra size-1 all-reduce
    (77) pairs with the other's loss (79); C waits in its own loss as #69, the other in its
    next step's first all-gather (50, in the forward called at 69) as #69 too. Was: "rank C
    did not call the module the other called ... a dummy input" (an FSDP skip). The other is
    at an earlier line of the loop: a pass on (in C's pass, behind, it would be the accuracy
    (74) and more short of C's count, every pass posting it): it posted the loss of C's pass
    lower — C posted more, and its extra is the loop's one call under a branch, where it met
    the other's loss (#68)."""
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    fix = d["fix"]
    assert fix.startswith(f"Rank {culprit} posted more collectives on default_pg than rank "
                          f"{1 - culprit} before "), fix
    assert "dummy input" not in fix and fix.endswith("_silent_fsdp2.py:77 <module>."), fix
    div = d["first_divergence"]
    assert div["seq"] == 68, div
    lines = {int(r): c["callsite"]["line"] for r, c in div["per_rank"].items()}
    assert lines == {culprit: 77, 1 - culprit: 79}, lines
