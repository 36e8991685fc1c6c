"""Two collectives that met at one number, not one collective given two shapes (fresh seed
44719023, job 96, ``async``, DDP on two nodes, ``MOE_HANG_FR_STACKS=0``, both roles). Rank C
all-reduces an extra size-1 gradient norm under a branch (50); it meets the others' DDP
bucket (161 floats, posted from ``loss.backward()`` at 53) and gloo aborts C. The others'
recorder entries carry no call site; two of them died inside that very collective, at 53 —
a rank's line is where its pending collective was posted. Two lines: the branch's advice,
not "pad to a common size" (was)."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_captures


# the mirrored run's culprit kept the bucket it posted after its extra (its posted log): the
# alignment by content reads the extra itself there (tests/unit/test_size_shift.py)
@pytest.mark.parametrize(("name", "culprit", "kind"), [
    ("async_bucket_nostacks_0", 2, "size_mismatch"),
    ("async_bucket_nostacks_1", 0, "extra_collective")])
def test_an_extra_meeting_a_bucket_is_not_a_shape_to_pad(fixtures, name, culprit, kind):
    run = fixtures / name
    d = diagnose(load_captures([run / "node0", run / "node1"])).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    assert d["first_divergence"]["kind"] == kind, d["first_divergence"]
    assert "pad to a common size" not in d["fix"], d["fix"]
    assert "_async_ddp.py:50 " in d["fix"], d["fix"]
    if kind == "size_mismatch":  # two lines: the branch's, and where the others wait
        assert d["fix"].startswith(f"Rank {culprit} took `if FAULTY and step == FAULT_STEP`"), \
            d["fix"]
        assert "_async_ddp.py:53 <module>" in d["fix"], d["fix"]
    else:  # the extra the others never post, under its branch
        assert d["fix"].startswith(f"Rank {culprit} posts the all_reduce at "), d["fix"]
        assert "under `if FAULTY and step == FAULT_STEP` that ranks 1-3 never post" in d["fix"]
