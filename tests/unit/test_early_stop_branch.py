"""A data-parallel loop whose early-stopping check runs on each rank's own validation shard:
where one rank's loss improved, it alone all-reduces a size-1 flag after the step's stats
all-reduce, while the others go round to the next step's gradient all-reduces (inside an
inner loop over the parameters). Written as a new user's job (``early_stop_branch_jobs/``,
issue 27's trial), recorded under ``moe-hang watch`` on 4 ranks in two roles; the capture is
self-contained. gloo aborted the culprit (8 bytes where it expected 4)."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


@pytest.mark.parametrize("name, lucky", [("early_stop_branch_2", 2),
                                         ("early_stop_branch_1", 1)])
def test_an_extra_in_a_data_branch_is_that_branch_not_a_loop_left(fixtures, name, lucky):
    """The others are at the inner loop's line (28) a pass on: their last collective before
    the divergence (the stats all-reduce, line 33) is past that loop, so they came back
    into it round the step loop; the culprit did not "leave the loop" they are in. The
    advice is the branch its data took (was: "left the loop at train_es.py:27 ... give each
    the same count", wrong: every rank ran every pass of it)."""
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [lucky], "history"), d["summary"]
    fix = d["fix"]
    assert "`if val < best_val:`" in fix and "train_es.py:36" in fix, fix
    assert "left the loop" not in fix and "same count" not in fix, fix
    site = d["first_divergence"]["per_rank"][str(lucky)]["callsite"]
    assert (site["line"], d["first_divergence"]["per_rank"]["0" if lucky else "3"]
            ["callsite"]["line"]) == (39, 28)
