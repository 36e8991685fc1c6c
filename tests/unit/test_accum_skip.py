"""Gradient accumulation over 4 micro-batches counted on each rank, a corrupt batch skipped
with `continue` on one rank's own data, gradients all-reduced in a helper every 4 (a new
user's trial, tests/unit/fixtures/trial_jobs/accum_skip.py, 2 ranks, both roles): at step 7
the rank whose count lags skips the helper and waits in the checkpoint barrier while the
other all-reduces its gradients.

Was: culprit right, the fix "Rank 1 left the loop at :26 (the helper's `for p in
model.parameters()`) while rank 0 is still in it": its last agreed collective came from the
very line the other waits at, so it read as having left that loop — but the helper was
called anew. At the frame both share (`train`) its `step` is the others', and its line is
later in that pass: it went past their call in this pass, and the `if micro == ACCUM:`
around the call is its way past (``gates.gates_in_their_pass``; not the `continue` guard
before it: that would have left the pass)."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture

JOB = "/tmp/trial/accum_skip.py"


@pytest.mark.parametrize(("fixture", "bad", "good"), [
    ("accum_skip_1", 1, 0), ("accum_skip_0", 0, 1), ("accum_skip_stacks_1", 1, 0)])
def test_later_in_their_pass_out_of_the_helper_took_the_branch_around_the_call(
        fixtures, fixture, bad, good):
    d = diagnose(load_capture(fixtures / fixture)).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [bad]), d["summary"]
    assert d["fix"].startswith(
        f"Rank {bad} skipped the all_reduce at {JOB}:27 sync_grads: the one way past it "
        f"the source shows is `if micro == ACCUM:` around it ({JOB}:39), false on rank "
        f"{bad}, true on rank {good} (in their pass: its `step` is 7, as theirs)"), d["fix"]
    assert "left the loop" not in d["fix"]
