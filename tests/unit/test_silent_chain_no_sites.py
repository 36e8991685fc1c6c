"""Silent pairings without call sites in the recorder, where the extra met the others' collective
one or more lines before the line the ranks now part at (fresh seed 83017265, jobs 19 and 30,
both roles; ``MOE_HANG_FR_STACKS=0``, beside a busy neighbour).

Job 19 (DTensor, 2 ranks): rank C's extra size-1 all-reduce (63) pairs with the other's loss
(65), C's loss with the other's next token count (51), and the ops first differ at #18: C's
token count against the other's DTensor all-gather (52). Was: the divergence at #18 at 51/52.
Between the extra and 51 the loop posts the loss (65) on every pass: C posted the extra two
numbers below its 51 (#16), where the other posted its loss.

Job 30 (FSDP2, 2 ranks, async): every logging all-reduce is posted with ``async_op=True`` and
waited at the step's end; C's extra (82) pairs with the other's next token count (71), and
both ranks' stacks sit in the forward's first FSDP all-gather (50, called at 73) while C's
token count (#74) is pending before it. Was: C "at 50" in an all-reduce (the stack's line
for a collective posted earlier) and the divergence at #74 (C's token count read as the
extra, a block of one alike the three all-reduces before it). A rank held behind a
collective it posted right before the stack's (gloo runs a group's in order) is at the last
call the source shows before the stack's line in the pass: 71; and the block sits where the
count shift at C's line says — the loop's one call under a branch, met as #73."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


def _lines(div: dict) -> dict[int, int]:
    return {int(r): c["callsite"]["line"] for r, c in div["per_rank"].items() if c}


@pytest.mark.parametrize(("name", "culprit"), [("silent_dtensor_nostacks_0", 0),
                                               ("silent_dtensor_nostacks_1", 1)])
def test_an_extra_met_the_collective_after_it_lines_before_where_they_part(fixtures, name,
                                                                           culprit):
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    assert d["fix"].startswith(f"Rank {culprit} posted more collectives on default_pg"), d["fix"]
    assert d["fix"].endswith("_silent_dtensor.py:63 <module>."), d["fix"]
    div = d["first_divergence"]
    assert (div["seq"], div["kind"]) == (16, "extra_collective"), div
    assert _lines(div) == {culprit: 63, 1 - culprit: 65}


@pytest.mark.parametrize(("name", "culprit"), [("async_fsdp_nostacks_0", 0),
                                               ("async_fsdp_nostacks_1", 1)])
def test_a_rank_held_behind_an_async_collective_is_at_the_line_that_posted_it(fixtures, name,
                                                                             culprit):
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    ranks = {r["rank"]: r for r in d["ranks"]}
    assert ranks[culprit]["collective"]["seq"] == 74
    assert ranks[culprit]["callsite"]["line"] == 71  # the token count, posted async
    assert ranks[1 - culprit]["callsite"]["line"] == 50  # in the forward's all-gather
    assert d["fix"].endswith("_async_fsdp2.py:82 <module>."), d["fix"]
    div = d["first_divergence"]
    assert (div["seq"], div["kind"]) == (73, "extra_collective"), div
    assert _lines(div) == {culprit: 82, 1 - culprit: 71}
