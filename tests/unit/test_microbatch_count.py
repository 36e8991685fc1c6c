"""A rank that packs its data into one more micro-batch than the others (DDP without
``no_sync``: every micro-batch's backward all-reduces the bucket) — written as a new user's
job (issue 27's trial), recorded under ``moe-hang watch`` in both roles. The capture is
self-contained (its source facts are in ``source.json``): the job's file is not here."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


@pytest.mark.parametrize("name, heavy", [("microbatch_count_0", 0), ("microbatch_count_1", 1)])
def test_the_rank_that_ran_the_loop_once_more_is_named_and_both_readings_are_said(
        fixtures, name, heavy):
    """DDP's warm-up (broadcasts, the first bucket, the bucket rebuild) is two steps long,
    then three steps of (bucket, bucket, loss): the step is learned, and at seq 17 it posts
    the loss — the heavy rank's bucket breaks it. Was: no step learned, the line order named
    the other rank ("it went past what the others wait in"). The stacks cannot tell one
    more pass from a skipped loss all-reduce (gloo aborted both ranks): the advice names
    both and the same-count fix, never "post that too"."""
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [heavy], "history"), d["summary"]
    lines = {r: c["callsite"]["line"] for r, c in d["first_divergence"]["per_rank"].items()}
    assert lines == {str(heavy): 18, str(1 - heavy): 21}
    fix = d["fix"]
    assert "(inside the loop at /tmp/trial/microbatch.py:15)" in fix and "same count" in fix, fix
    assert f"(as rank {heavy} itself did in every earlier step)" in fix and "too:" not in fix, fix
    assert d["fix_site"]["line"] == 15  # next: the loop whose count differs
