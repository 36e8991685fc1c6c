"""Stacks alone (``moe-hang diagnose`` of a job run without moe-hang, no recorder): a rank
outside any collective past a loop the others still wait in — written as a new user's jobs
(issue 27's trial), recorded in both roles. Async all-reduces waited later, as NCCL jobs
post them; the captures are self-contained (the jobs' files are not here)."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


@pytest.mark.parametrize("name, skipper", [("left_loop_skip_0", 0), ("left_loop_skip_1", 1)])
def test_a_rank_past_a_loop_no_loop_brings_it_back_to_is_the_culprit(fixtures, name, skipper):
    """It skipped one async all-reduce at step 4 (a rank condition), finished its steps and
    idles in evaluation after the loop, module level; the other waits in ``work.wait()``
    inside the loop. Nothing brings the skipper back: a hang it caused, likely (was: "it
    may be slow I/O or a checkpoint", uncertain)."""
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"], d["certainty"]) == (
        "hang", [skipper], "program_order", "likely"), d["summary"]
    assert "left the loop at /tmp/trial/async_skip.py:10" in d["summary"], d["summary"]
    assert "fewer of the loop's collectives" in d["fix"], d["fix"]
    assert d["fix_site"]["line"] == 10  # next: the loop it left


def test_a_rank_evaluating_between_epochs_comes_back_and_is_not_called_gone(fixtures):
    """The same stacks inside an epoch loop: the evaluating rank comes round to the inner
    loop again — slow, maybe; the others wait for it, uncertain, as before."""
    d = diagnose(load_capture(fixtures / "left_loop_slow_1")).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["certainty"]) == ("hang", [1], "uncertain")
    assert "left the loop" not in d["summary"] and "in waits on" not in d["summary"]
