"""A checkpoint every 1.5 s of wall time, each rank by its own clock (a new user's trial,
tests/unit/fixtures/trial_jobs/timed_ckpt.py, 3 ranks): the slow rank's timer started later,
so the others' ``dcp.save`` all-gather meets its next step's bucket all-reduce.

Was, under ``watch`` (history: the savers): "Make ranks 0, 2 post the collective at
timed_ckpt.py:26 too: it went on to :30 without it" — they had posted it; the advice that
names the branch they took was given to one culprit only. Under ``diagnose`` (stacks alone,
``timed_ckpt_fn.py``, the loop in a function): "every rank must post the same collectives",
no line — the slow rank is a pass on (py-spy's ``step``), through the others' line in their
pass."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture

GATE = "`if time.monotonic() - last_save > SAVE_EVERY_S:`"


@pytest.mark.parametrize(("fixture", "savers", "slow"), [
    ("timed_ckpt_3r_1", [0, 2], 1), ("timed_ckpt_3r_0", [1, 2], 0)])
def test_the_branch_every_culprit_took_names_them_all(fixtures, fixture, savers, slow):
    d = diagnose(load_capture(fixtures / fixture)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", savers, "history"), d["summary"]
    who = f"ranks {savers[0]}, {savers[1]}"
    assert d["fix"].startswith(f"R{who[1:]} posted at /tmp/trial/timed_ckpt.py:30 <module>, "
                               f"in {GATE}"), d["fix"]
    assert f"where rank {slow} posted /tmp/trial/timed_ckpt.py:26" in d["fix"]
    assert f"held on {who} alone (their own data)" in d["fix"], d["fix"]
    assert "too: it went on" not in d["fix"]
    assert d["fix_site"]["line"] == 29


def test_stacks_alone_a_rank_a_pass_on_went_through_their_line(fixtures):
    d = diagnose(load_capture(fixtures / "timed_ckpt_stacks_1")).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [1], "majority"), d["summary"]
    assert d["fix"].startswith("Rank 1 skipped the all_gather at /tmp/trial/timed_ckpt_fn.py:31"
                               f" main: the one way past it the source shows is {GATE}"), d["fix"]
    assert "false on rank 1, true on ranks 0, 2 (a pass on: its `step` is 11, theirs 10)" \
        in d["fix"], d["fix"]
    assert d["fix_site"]["line"] == 30


def test_stacks_alone_in_the_same_pass_nothing_is_gone_through(fixtures):
    """Its counter equal to theirs: no pass on, so no way past their line is claimed."""
    ev = load_capture(fixtures / "timed_ckpt_stacks_1")
    for t in ev.ranks[1].threads or []:
        t.counters = {f: {k: n - 1 for k, n in c.items()} for f, c in t.counters.items()}
    d = diagnose(ev).to_dict()
    assert d["culprit_ranks"] == [1], d["summary"]
    assert "a pass on" not in d["fix"] and GATE not in d["fix"], d["fix"]
