"""Stacks alone on a 2x2 mesh (fresh fuzz seed 28276042, job 52, both roles, recorded under
``moe-hang diagnose``): one rank broadcasts on its dp group where its dp partner all-reduces
there (line 53); the other two completed their dp all-reduce and wait in the world's
all-reduce (line 56). The stacks cannot say which of the dp pair took the odd branch (the
other two may have taken it as well and paired), nor which ranks a dp group holds."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


@pytest.mark.parametrize("name", ["stacks_mesh_op_swap_0", "stacks_mesh_op_swap_1"])
def test_one_op_at_two_lines_is_two_collectives_and_nobody_is_said_to_have_gone_past(
        fixtures, name):
    """Camps by op and line: the dp all-reduce (53) and the world's (56) are not one camp.
    Was (one role): the world's two and the dp all-reducer lumped as one camp that "went
    past" the broadcaster: three culprits, one of them right only by chance."""
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [0, 1, 2, 3], "ambiguous"), d["summary"]
