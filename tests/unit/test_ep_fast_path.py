"""A 2x2 mesh, expert parallel across pairs, data parallel across them: a rank whose router
kept no token for the layer returns from it before its all-to-all on the ep group (``if
x_TD.shape[0] == 0: return x_TD``). Its partner waits in the all-to-all; it went on through
the dp all-reduce (its dp partner posted that too) to the step's world all-reduce: a cycle.
Written as a new user's job (``ep_fast_path_jobs/``), recorded under ``moe-hang watch`` on
4 ranks in two roles (the empty rank 3, then 0)."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


@pytest.mark.parametrize("name, empty, partner", [("ep_fast_path_3", 3, 2),
                                                  ("ep_fast_path_0", 0, 1)])
def test_the_guard_inside_the_layer_is_the_way_past_the_exchange(fixtures, name, empty,
                                                                 partner):
    """Both of the culprit's ep collectives came from one line of ``moe_layer`` (one call a
    step): the lap between them is the step loop's, and the culprit — at a later line of
    that loop, as #k of the world group where its partner posted #k-1 — is in its partner's
    pass: it went through the layer's call without the exchange, past the guard. Was: "make
    it post that too, in the same order" (no branch named)."""
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [empty]), d["summary"]
    fix = d["fix"]
    assert f"Rank {empty} skipped the all_to_all at" in fix, fix
    assert "the one way past it the source shows is `if x_TD.shape[0] == 0: return`" in fix
    assert f"taken by rank {empty}, not by rank {partner}" in fix, fix
