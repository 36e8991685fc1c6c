"""Stacks alone on a 2x2 mesh: camps held up on groups of their own are not in conflict
with each other (docs/DESIGN.md §8). Fresh seed 68214390, job 3 (``skip``: rank C skips a
step and waits in the barrier after the loop, 60) and exploration seed 20261208, job 66
(``extra``: rank C checkpoints in a branch and waits in its barrier, 40), both under
``diagnose``, both roles. C's tp (or dp) peer waits on it in the tp all-reduce at an earlier
line (48) or the dp one (58); the two others went past that line — they completed their own
group's — and wait further on. Those two camps can both be right at once; the conflict is
between them and C, on a collective every rank owes, and there the ranks count. Was: three
of four named, by the order of the lines ("they went on past the tp all-reduce without it").
The same shape where no rank is left outside (ranks past a subgroup collective its other
members wait in: ``wrong_group``) stays a conflict: ``test_analysis.py``'s redirect test."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


@pytest.mark.parametrize(("name", "culprit", "line"), [
    ("mesh2d_skip_stacks_0", 2, 60), ("mesh2d_skip_stacks_1", 3, 60),
    ("mesh2d_checkpoint_stacks_0", 0, 40), ("mesh2d_checkpoint_stacks_1", 1, 40)])
def test_camps_held_up_on_their_own_groups_are_one_side(fixtures, name, culprit, line):
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    assert d["culprit_basis"] == "majority", d["culprit_basis"]
    if line == 60:  # past the loop the others are in: the loop's advice, both ways
        assert d["fix"].startswith(f"Rank {culprit} left the loop at "), d["fix"]
        assert "ran different numbers of iterations" in d["fix"], d["fix"]
        # the others at two lines, each said: the tp peer at 48, the rest at 51
        peer = 5 - culprit
        assert f"; rank {peer} at " in d["fix"] and "_skip_mesh2d.py:48 <module>)" in d["fix"], \
            d["fix"]
    else:  # in the branch only it took
        assert d["fix"].startswith(f"Rank {culprit} took `if FAULTY and step == FAULT_STEP`"), \
            d["fix"]
    lines = {r["rank"]: r["callsite"]["line"] for r in d["ranks"]}
    assert lines[culprit] == line, lines
