"""Validation on each rank's own files, the loss averaged over ranks batch by batch (a new
user's trial, tests/unit/fixtures/trial_jobs/val_uneven.py, 3 ranks): one rank's files hold
a batch fewer, so it returns from ``validate()`` and its next epoch's bucket all-reduce meets
the others' last validation all-reduce (gloo aborts one of them).

Was: culprit right, fix "Make rank 2 post the collective at validate:29 too: it went on to
train:45 without it". Its last agreed collective came from the others' very line by the same
calls, and it has since returned from that function: it left the loop they are still in —
whatever its line in the caller, a pass on there (``passes._returned_from``)."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


@pytest.mark.parametrize(("fixture", "short", "others"), [
    ("val_uneven_3r_2", 2, "ranks 0, 1"), ("val_uneven_3r_0", 0, "ranks 1, 2")])
def test_a_rank_that_returned_from_the_loop_they_are_in_left_it(fixtures, fixture, short,
                                                                 others):
    d = diagnose(load_capture(fixtures / fixture)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [short], "history"), d["summary"]
    assert d["fix"].startswith(
        f"Rank {short} left the loop at /tmp/trial/val_uneven.py:26 while {others} are "
        "still in it (/tmp/trial/val_uneven.py:29 validate): the ranks ran different "
        "numbers of iterations"), d["fix"]
    assert "too: it went on" not in d["fix"]
