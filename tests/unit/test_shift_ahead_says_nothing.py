"""A count shift at a camp's line leaves the camps' order nothing to say (exploration seed
20261208, job 16, ``async``, a 2-stage pipeline on two nodes, ``MOE_HANG_FR_STACKS=0``, both
roles). Rank C posts an extra size-1 all-reduce (57) in its fourth of five steps, every
logging all-reduce async; the other finishes the loop and waits in the barrier after it as
#16, C in its last loss (59) as #16. Was: the other named, "it went past what the others wait
in" — it posted 59's collective itself, as #15, before it left. The shift (the other left the
loop right after 59's pass) reads an extra of C's or a skip of the other's, one each: on two
ranks the counts cannot tell, and nothing else here does (no call sites, no majority, no
history: every collective alike). The verdict says so."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_captures


@pytest.mark.parametrize(("name", "waiting"), [("async_p2p_left_0", 1), ("async_p2p_left_1", 0)])
def test_a_rank_that_left_the_loop_is_not_named_for_being_ahead(fixtures, name, waiting):
    run = fixtures / name
    d = diagnose(load_captures([run / "node0", run / "node1"])).to_dict()
    assert d["verdict"] == "desync", d["summary"]
    assert d["culprit_ranks"] == [0, 1], d["summary"]  # not the one that left: undecided
    assert d["culprit_basis"] == "ambiguous"
    ranks = {r["rank"]: r for r in d["ranks"]}
    assert ranks[waiting]["callsite"]["line"] == 59
    assert ranks[1 - waiting]["callsite"]["line"] == 62
