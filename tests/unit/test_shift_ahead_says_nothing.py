"""A count shift at a camp's line leaves the camps' order nothing to say (exploration seed
20261208, job 16, ``async``, a 2-stage pipeline on two nodes, ``MOE_HANG_FR_STACKS=0``, both
roles). Rank C posts an extra size-1 all-reduce (57) in its fourth of five steps, every
logging all-reduce async; the other finishes the loop and waits in the barrier after it as
#16, C in its last loss (59) as #16. Was: the other named, "it went past what the others wait
in" — it posted 59's collective itself, as #15, before it left. The shift (the other left the
loop right after 59's pass) reads an extra of C's or a skip of the other's, one each: on two
ranks the counts cannot tell, nor can the order, the history or a majority (no call sites,
every collective alike). The source can: the loop's one collective a branch decides is under
a rank condition that names who runs it (``if FAULTY and step == FAULT_STEP:``), the only way
a pass posts one more — C's extra, *likely* (tests/unit/test_shift_branch_source.py)."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_captures


@pytest.mark.parametrize(("name", "waiting"), [("async_p2p_left_0", 1), ("async_p2p_left_1", 0)])
def test_a_rank_that_left_the_loop_is_not_named_for_being_ahead(fixtures, name, waiting):
    run = fixtures / name
    d = diagnose(load_captures([run / "node0", run / "node1"])).to_dict()
    assert d["verdict"] == "desync", d["summary"]
    # not the one that left: the one the loop's rank-conditioned branch names
    assert d["culprit_ranks"] == [waiting], d["summary"]
    assert d["culprit_basis"] == "source"
    ranks = {r["rank"]: r for r in d["ranks"]}
    assert ranks[waiting]["callsite"]["line"] == 59
    assert ranks[1 - waiting]["callsite"]["line"] == 62
