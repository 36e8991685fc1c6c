"""A skip read by the counts at a cycle: the divergence is where the skip was (fresh seed
44719023, job 31, ``silent``, a 2x4 mesh under watch beside a busy neighbour, stacks, both
roles). Rank C skips the accuracy all-reduce under ``if not (FAULTY and step == ...)`` (55);
its loss pairs with the others' accuracy (same size), and it waits in the next step's tp
all-reduce (49) while the others wait in the token all-reduce (47): a cycle through tp and
the world group. The counts read a skip of C's, the loop's one call on the world group under
a branch. Was: the divergence at the cycle's number, the others' line their wait (47); now
the others at the skipped line (55), C with none, no number (which pass, the counts do not
say) — as ``paired.skipped_at`` gives a desync."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


@pytest.mark.parametrize(("name", "culprit"), [("silent_mesh_cycle_0", 3),
                                               ("silent_mesh_cycle_1", 4)])
def test_a_skip_at_a_cycle_is_placed_at_the_skipped_line(fixtures, name, culprit):
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    div = d["first_divergence"]
    assert (div["kind"], div["pg"], div["seq"]) == ("missing_rank", "0", None), div
    assert div["per_rank"][str(culprit)] is None
    lines = {c["callsite"]["line"] for r, c in div["per_rank"].items() if c is not None}
    assert lines == {55}, div
    assert d["fix"].endswith("_silent_mesh2d.py:55 <module>."), d["fix"]
