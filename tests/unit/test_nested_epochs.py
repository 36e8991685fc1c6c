"""Epochs of batches from each rank's own shards, one rank's a batch longer in epoch 1 (new-
user trials, tests/unit/fixtures/trial_jobs/nested_*.py, 2 ranks, both roles).

- ``nested_silent``: the loss all-reduced per batch, the accuracy per epoch, both one float:
  the long rank's fifth loss all-reduce pairs with the others' accuracy, and so on silently
  to the final barrier. Was: the *short* rank named by history ("it skipped 1"): the loss
  all-reduce is regular, so its absence read as the skip. But the steps post it several
  times running (an inner loop's collective): one fewer and one more read alike, and only
  the step's count decides — the one period the agreed run is consistent with puts the
  accuracy at that seq (``ladder._count_of_a_run``). The advice: one more pass of the inner
  loop the others have left (``passes.stayed``: the culprit's collective before came from
  the loop's body, not necessarily that very line).
- ``nested_uneven``: gradients all-reduced per parameter too (sizes differ: gloo aborts).
  Culprit right; was "Make rank 1 post the collective at :33 too"."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture

JOB = "/tmp/trial/nested_{}.py"


@pytest.mark.parametrize(("fixture", "long", "short"), [
    ("nested_silent_1", 1, 0), ("nested_silent_0", 0, 1)])
def test_one_more_pass_of_an_inner_loop_paired_silently_is_the_long_ranks(fixtures, fixture,
                                                                          long, short):
    d = diagnose(load_capture(fixtures / fixture)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [long], "history"), d["summary"]
    job = JOB.format("silent")
    assert d["fix"].startswith(
        f"Rank {long} posted at {job}:29 <module> (inside the loop at {job}:23) where rank "
        f"{short} posted {job}:31 <module>, after the loop"), d["fix"]


@pytest.mark.parametrize(("fixture", "long", "short"), [
    ("nested_uneven_1", 1, 0), ("nested_uneven_0", 0, 1)])
def test_one_more_pass_whose_sizes_differ_is_one_more_pass(fixtures, fixture, long, short):
    d = diagnose(load_capture(fixtures / fixture)).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [long]), d["summary"]
    job = JOB.format("uneven")
    assert d["fix"].startswith(
        f"Rank {long} posted at {job}:28 <module> (inside the loop at {job}:23) where rank "
        f"{short} posted {job}:33 <module>, after the loop"), d["fix"]
    # one more pass posts the loop's collective at that seq: its own, not a skip to it
    assert d["summary"].startswith("Ranks posted different sizes at seq 26 of default_pg"), \
        d["summary"]
    fd = d["first_divergence"]
    assert (fd["kind"], fd["per_rank"][str(long)]["callsite"]["line"]) == (
        "size_mismatch", 28)
