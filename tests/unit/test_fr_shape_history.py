"""Issue 18, case 4: ``moe-hang analyze`` on real gloo dumps of 2 ranks that all-gathered 4×8
on the default group for 11 steps from one helper; then one rank posts 5×8 from another call
site (tests/unit/fixtures/fr_real/make_dumps.py, ``shape_break_1`` and its mirror
``shape_break_0``; meta.json says what each plants). One rank against one, but not
undecided: the op's history on the group says which rank broke the shape every rank had
kept (docs/DESIGN.md §8.3, §8.5, ``history``)."""

from __future__ import annotations

import json

import pytest
from conftest import FIXTURES

from moe_hang.commands.diagnose import analyze_paths

REAL = FIXTURES / "fr_real"
RUNS = [(v, f) for v in ("shape_break_1", "shape_break_0")
        for f in ("pickle_frames", "pickle", "json")]


def planted(variant: str) -> dict:
    return json.loads((REAL / variant / "meta.json").read_text())["planted"]


@pytest.mark.parametrize("variant, form", RUNS)
def test_the_dumps_hold_eleven_kept_shapes_and_one_broken(variant, form):
    """What the evidence is, whatever the engine concludes from it."""
    want = planted(variant)
    d = analyze_paths([REAL / variant / form], force=False)
    fd = d.first_divergence
    assert d.verdict == "desync"
    assert fd is not None and (fd.pg, fd.seq, fd.kind) == (want["pg"], want["seq"], want["kind"])
    (culprit,) = want["culprits"]
    sizes = {r: c.input_sizes for r, c in fd.per_rank.items() if c is not None}
    assert sizes == {culprit: [[5, 8]], 1 - culprit: [[4, 8]]}
    if form == "pickle_frames":  # with stacks: each side's own helper
        sites = {r: c.callsite.function for r, c in fd.per_rank.items()
                 if c is not None and c.callsite is not None}
        assert sites == {culprit: "gather_extra", 1 - culprit: "gather_rows"}


@pytest.mark.parametrize("variant, form", RUNS)
def test_the_rank_that_broke_the_shape_every_rank_kept_is_the_culprit(variant, form):
    want = planted(variant)
    d = analyze_paths([REAL / variant / form], force=False)
    assert d.verdict == "desync"
    assert d.culprit_ranks == want["culprits"], (d.culprit_ranks, d.summary)
    assert d.culprit_basis == want["basis"]
    assert "does not decide" not in d.summary
