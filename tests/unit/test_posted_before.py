"""A collective without a call site that the rank went past, placed by the source (fresh seed
68214390, job 17, ``dtype``, DDP on two nodes, ``MOE_HANG_FR_STACKS=0``, both roles). Rank C
all-gathers a float64 tensor on the logger's group (55) where the other gathers float32; gloo
aborts the other ("received 12 bytes where it expected 6"), and C goes on to the broadcast
(57), where its stack is. C's recorder holds the all-gather without a call site. The
recorder's order says C posted it right before the broadcast its stack is in; the last call by
name before 57 in the loop's pass is that all-gather at 55, on a group of its own, every pass:
its line. Was: C's line at the divergence missing (its stack's line is the broadcast's)."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_captures


# the mirrored run caught its culprit still in the all-gather (gloo's abort of the other came
# first): its line is the stack's there, the same answer by the other road
@pytest.mark.parametrize(("name", "culprit", "now"), [("dtype_ddp_nostacks_0", 0, 57),
                                                      ("dtype_ddp_nostacks_1", 1, 55)])
def test_a_collective_gone_past_is_placed_where_its_thread_posted_it(fixtures, name, culprit,
                                                                      now):
    run = fixtures / name
    d = diagnose(load_captures([run / "node0", run / "node1"])).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    div = d["first_divergence"]
    assert (div["kind"], div["pg"], div["seq"]) == ("dtype_mismatch", "1", 3), div
    lines = {int(r): c["callsite"]["line"] for r, c in div["per_rank"].items()}
    assert lines == {0: 55, 1: 55}, div
    # where it is now is still the broadcast's line: only the collective it went past moved
    at = {r["rank"]: r["callsite"]["line"] for r in d["ranks"]}
    assert at[culprit] == now, at
    assert d["fix"].startswith("Cast to one dtype on every rank before the collective at "), \
        d["fix"]
    assert "_dtype_ddp.py:55 <module>" in d["fix"], d["fix"]
