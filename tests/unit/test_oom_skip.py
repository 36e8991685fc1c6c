"""Skip a batch that runs out of memory (a new user's trial,
tests/unit/fixtures/trial_jobs/oom_skip.py, 3 ranks): ``try: forward; backward`` with
``except RuntimeError: ... continue``; one rank's long batch runs out of memory at step 3, so
its buckets pair silently with the others' next step and it ends in the final barrier.

Was: culprit right, but the fix named no way past ("the ranks ran different numbers of
iterations, or rank 1 cut one short"): the source facts knew ``if ...: continue`` guards,
not a handler that leaves. A handler whose last statement is ``continue`` (``break``,
``return``) is a gate of its ``try`` body and of what follows it."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture

HANDLER = "`except RuntimeError: ... continue` (/tmp/trial/oom_skip.py:36)"


@pytest.mark.parametrize(("fixture", "culprit"), [("oom_skip_3r_1", 1), ("oom_skip_3r_0", 0)])
def test_the_handler_that_skips_the_batch_is_a_way_past(fixtures, fixture, culprit):
    d = diagnose(load_capture(fixtures / fixture)).to_dict()
    # the culprit is past the training loop, the others at its next collective: where the
    # loop ends is nothing the agreed steps showed (ladder._past_the_loop): two against one
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [culprit], "majority"), d["summary"]
    assert d["fix"].startswith(f"Rank {culprit} skipped the all_reduce at "
                               "/tmp/trial/oom_skip.py:35 train"), d["fix"]
    assert HANDLER in d["fix"], d["fix"]


def test_stacks_alone_the_handler_is_the_way_past_their_collective(fixtures):
    d = diagnose(load_capture(fixtures / "oom_skip_stacks_1")).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [1], "majority"), d["summary"]
    assert f"one way past their collective within a pass (a rank that takes it posts " \
           f"fewer): {HANDLER}" in d["fix"], d["fix"]
    assert d["fix_site"]["line"] == 36, d.get("fix_site")
