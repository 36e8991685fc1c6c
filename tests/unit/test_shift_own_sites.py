"""A count shift on two ranks decided by the extra rank's own call sites (exploration seed
20261208, job 21, ``silent``, DDP on two ranks, ``MOE_HANG_FR_STACKS=0``, both roles). Rank
C's extra size-1 all-reduce (55) pairs with the other's loss (57), C's loss with the other's
token count (46), and gloo aborts C when its token count meets the other's DDP bucket (49) as
#23. The counts say one side posted one more before 46: C an extra or the other a skip, one
each. C's recorder was copied on its way out with call sites (the probe's last gasp), the
other's without: since C last posted 46, it posted from 55, a line none of its earlier steps
posted from — its extra. Was: "does not decide" and the size advice ("pad to a common size").
"""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


@pytest.mark.parametrize(("name", "culprit"), [("silent_ddp_own_sites_0", 0),
                                               ("silent_ddp_own_sites_1", 1)])
def test_a_line_no_earlier_step_posted_from_is_the_extra(fixtures, name, culprit):
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    assert "pad to a common size" not in d["fix"]
    assert d["fix"].startswith(f"Rank {culprit} posted more collectives on default_pg"), d["fix"]
    assert d["fix"].endswith("_silent_ddp.py:55 <module>."), d["fix"]
    div = d["first_divergence"]
    assert div["seq"] == 21, div
    lines = {int(r): c["callsite"]["line"] for r, c in div["per_rank"].items()}
    assert lines == {culprit: 55, 1 - culprit: 57}
