"""An expert-parallel dispatch with a fast path: ``if x_td.shape[0] == 0: return x_td``
before the token-count all_to_all_single. At step 3 the data filter leaves one rank no
token: it returns early, skips both all-to-alls and waits in the gradient all-reduce of the
same step, while the other waits in the count exchange. Written as a new user's job (issue
27's trial), recorded under ``moe-hang watch`` in both roles; the capture is self-contained."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


@pytest.mark.parametrize("name, empty", [("a2a_empty_skip_0", 0), ("a2a_empty_skip_1", 1),
                                         ("a2a_empty_skip_epochs_1", 1)])
def test_the_fast_path_is_the_one_way_past_not_fewer_laps(fixtures, name, empty):
    """The culprit is inside the step loop now (its gradient all-reduce of the same step):
    it ran no fewer laps of that loop, so the one way past the all-to-all is the early
    return. Was: "2 ways past it (... ; fewer laps of `for step in range(6):`)", and next:
    the culprit's own line instead of the branch. The same with the step loop in a
    ``train()`` called from an epoch loop (a review's case): a loop around it cannot make
    "fewer laps" a way past for a culprit that passed the line in this very lap."""
    d = diagnose(load_capture(fixtures / name))
    assert (d.verdict, d.culprit_ranks, d.culprit_basis, d.certainty) == (
        "desync", [empty], "history", "definite"), d.summary
    assert "the one way past it the source shows is `if x_" in d.fix and ".shape[0] == 0: return`" \
        in d.fix, d.fix
    assert "fewer laps" not in d.fix
    assert d.fix_site is not None and d.fix_site.line == (15 if "epochs" in name else 11)
