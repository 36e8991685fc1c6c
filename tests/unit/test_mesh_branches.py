"""Stacks alone (``diagnose`` of a 2x2 mesh whose loop is at the script's top level: py-spy
shows no loop counters there), two jobs the fuzz generator wrote (seed 84402917, jobs 73 and
59, both roles). Was: "hang", no culprit, "which rank deviated the stacks do not say".

- One rank all-reduces the world's stats before its dp gradient, under `if FAULTY and step
  == FAULT_STEP:`; the others run the `else` (dp, then the stats): its dp partner waits in
  the dp all-reduce, two ranks in the world one. Every rank ran that `if`, and it went one
  way on one rank and the other way on three: a decision counted over the ranks that made it
  (``fallback._branch_split``), not ranks counted across groups.
- One rank skips the world accuracy all-reduce under `if not (FAULTY and step ==
  FAULT_STEP):`; its next world all-reduce (the loss, size 1) pairs with theirs, and it is a
  pass on in its tp all-reduce while the rest wait in the loss. The same stacks as a lagging
  tp partner's extra — but the loop's only way to post fewer of its every-rank collectives,
  and none to post more, is a rank condition that leaves ranks out
  (``gates.ways_left_out``): the rank a pass on did without it."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


def _lines(d: dict) -> dict[int, int]:
    return {x["rank"]: x["callsite"]["line"] for x in d["ranks"]}


@pytest.mark.parametrize(("fixture", "swapped"), [
    ("mesh2d_order_swap_2", 2), ("mesh2d_order_swap_0", 0)])
def test_one_if_every_rank_ran_split_one_against_three(fixtures, fixture, swapped):
    d = diagnose(load_capture(fixtures / fixture)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [swapped], "majority"), d["summary"]
    assert d["fix"].startswith(
        f"Rank {swapped} took `if FAULTY and step == FAULT_STEP`, a branch the others do "
        "not take"), d["fix"]
    partner = 2 - swapped  # its dp partner, held up in the dp all-reduce of the `else`
    assert _lines(d) == {swapped: 52, partner: 57, 1: 60, 3: 60}


@pytest.mark.parametrize(("fixture", "skipper"), [
    ("mesh2d_silent_skip_0", 0), ("mesh2d_silent_skip_2", 2)])
def test_the_loops_one_way_to_post_fewer_names_the_rank_a_pass_on(fixtures, fixture,
                                                                   skipper):
    d = diagnose(load_capture(fixtures / fixture)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [skipper], "source"), d["summary"]
    assert d["fix"].startswith(
        f"Rank {skipper} did not take `if not (FAULTY and step == FAULT_STEP):` "), d["fix"]
    assert "silent_mesh2d.py:53 <module> that ranks" in d["fix"], d["fix"]
    assert "same group" not in d["fix"]
    assert _lines(d) == {r: 47 if r == skipper else 55 for r in range(4)}
