"""A wait-for cycle whose culprit is held in its own extra (fresh seed 30586142, job 35, both
roles; a 2x4 mesh, 8 ranks, beside a busy neighbour).

Rank C all-reduces its gradient norm on the world group once more (line 57, under ``if FAULTY
and step == FAULT_STEP:``) and waits in it; its tp peers wait for it in the next step's tp
all-reduce (47), the other dp row in its dp all-reduce (50). The source names C's extra; the
divergence shown was the tp group's, where C is only absent because it is held in its extra
(was: "div: ranks 0-2 at 47, C absent"). A cycle's divergence is the reading's own: for an
extra, the group and number the culprits posted it as, which the others never did."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


@pytest.mark.parametrize(("name", "culprit"), [("mesh_extra_cycle_3", 3),
                                               ("mesh_extra_cycle_1", 1)])
def test_a_cycles_extra_is_shown_where_the_culprit_posted_it(fixtures, name, culprit):
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["rule_id"]) == ("desync", [culprit], "cycle"), \
        d["summary"]
    div = d["first_divergence"]
    assert (div["pg"], div["seq"]) == ("0", 9), div
    lines = {int(r): c["callsite"]["line"] for r, c in div["per_rank"].items() if c}
    assert lines == {culprit: 57}, lines
    assert "_step_shift_mesh2d.py:57 <module>) under `if FAULTY and step" in d["fix"], d["fix"]
