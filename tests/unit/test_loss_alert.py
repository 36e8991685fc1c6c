"""A new user's trial (``fixtures/trial_jobs/loss_alert.py``, 3 ranks, both roles): each rank
`all_gather_object`s an alert when its own batch loss spikes; one rank's data is noisier, so
only its alert is posted, and it meets the others' next gradient all-reduce. Under
``diagnose`` (stacks alone, the loop at the script's top level: no counters, no history)
the culprit was right and the fix the generic order advice; under watch it named the
branch. The minority waits in a branch of a test on its own data that the others' line is
outside of: the branch its data took (``advice``: ``gate_taken`` from stacks alone; a test
alike in a pass is out of step instead)."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


@pytest.mark.parametrize(("fixture", "spiky"), [
    ("loss_alert_stacks_2", 2), ("loss_alert_stacks_0", 0)])
def test_stacks_alone_name_the_branch_its_data_took(fixtures, fixture, spiky):
    d = diagnose(load_capture(fixtures / fixture)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [spiky], "majority"), d["summary"]
    assert d["fix"].startswith(f"Rank {spiky} posted at /tmp/trial/gather_obj.py:28 <module>, "
                               "in `if mine > 5.0:` (/tmp/trial/gather_obj.py:26)"), d["fix"]
    assert f"the test held on rank {spiky} alone (its own data)" in d["fix"]
