"""Hand-written data parallelism over an MoE: every parameter's gradient all-reduced async
(waited after the loop), skipped where the gradient is None — an expert that got no token
on one rank at step 3. Its two all-reduces (weight, bias) are skipped; the next expert's,
of the same sizes, pair silently with them; the sizes first differ at the loss all-reduce.
Written as a new user's job (issue 27's trial), recorded under ``moe-hang watch`` in both
roles; the capture is self-contained (the job's file is not here)."""

from __future__ import annotations

import json

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


@pytest.mark.parametrize("name, starved", [("grad_none_skip_0", 0), ("grad_none_skip_1", 1)])
def test_a_skip_on_a_later_lap_of_one_line_names_the_gate_inside_the_loop(
        fixtures, name, starved):
    """The culprit's last agreed collective is the same line as the one it skipped (an
    earlier lap): the ways past it are the gates inside the loop, and fewer laps. Was: no
    gate (line order only), "left the loop ... all-reduce the count with MIN". gloo aborted
    the culprit, whose posted log ends with the abort: its records are its whole history,
    not a stale save (was: "its own records and its peers' disagree", likely only)."""
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"], d["certainty"]) == (
        "desync", [starved], "history", "definite"), d["summary"]
    fix = d["fix"]
    assert "`if p.grad is not None:` around it" in fix, fix
    assert "fewer laps of `for p in params:`" in fix, fix
    assert "disagree" not in json.dumps(d["evidence"])
