"""Two sizes at one number, or one side a collective out of step (fresh seed 92817364, job 2,
``skip``, FSDP2 on 2 ranks, ``MOE_HANG_FR_STACKS=0``, both roles). The culprit skips the third
block of its forward: its head all-gather (25) meets the other's third block all-gather
(300); gloo aborts the culprit. Where the other got through (it received less than it
expected) it went on to the head's all-gather — the culprit's, and the pair its earlier
steps posted in that order. Aligned by content, the culprit lacks one collective: a skip,
not a size to pad. Was: "pad to a common size" (the recorder's entries alone at that
number). The mirrored run's survivor never got past: the abort's byte counts placed it."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_captures


@pytest.mark.parametrize(("name", "culprit", "other_line"), [
    ("skip_fsdp2_abort_nostacks_0", 0, None), ("skip_fsdp2_abort_nostacks_1", 1, 54)])
def test_a_survivor_that_posted_next_what_the_culprit_posted_reads_a_skip(
        fixtures, name, culprit, other_line):
    d = diagnose(load_captures([fixtures / name])).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    div = d["first_divergence"]
    assert (div["kind"], div["seq"]) == ("missing_rank", 55), div
    assert "pad to a common size" not in d["fix"], d["fix"]
    assert d["fix"].startswith("FSDP all-gathers a module's parameters when it is called; "
                               f"rank {culprit} did not call the one "), d["fix"]
    other = 1 - culprit
    got = div["per_rank"][str(other)]
    # no call site in the survivor's recorder and its stack is one collective on: no line is
    # claimed for it, rather than the line it is at now
    assert (got["callsite"]["line"] if got and got.get("callsite") else None) == other_line
    if other_line is None:
        assert "(its all_gather default_pg#55; no line recorded)" in d["fix"], d["fix"]
