"""A block of one collective alike the run before it, placed by the having side's own call
sites (fresh seed 30586142, job 13, both roles; recorders without call sites, the probe's
posted log with them; 6 ranks).

Data parallel by hand, every logging all-reduce size 1 and posted with ``async_op=True``,
waited at the step's end. Rank C all-reduces its gradient norm once more (line 63) at step 3:
it pairs silently with the others' next token count (46), C's token count meets the others'
gradient all-reduce (51) and gloo aborts C. Aligned by shape alone (the others' entries carry
no call site), C's extra is one more size-1 all-reduce in a run of four — the diff put it at
the end (its token count, a line every step posts: "the others skipped it", by history, in
one role; the other role's capture made no block and was right). C's own entries say which
of the run is new: only line 63 was never posted from in its earlier steps
(``placing.placed_in_run``), and that one is its extra."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


@pytest.mark.parametrize(("name", "culprit"), [("async_extra_run_4", 4),
                                               ("async_extra_run_2", 2)])
def test_an_extra_in_a_run_of_alike_ones_is_the_one_from_a_new_line(fixtures, name, culprit):
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    assert d["fix"].startswith(f"Rank {culprit} posted more collectives on default_pg"), d["fix"]
    div = d["first_divergence"]
    assert (div["seq"], div["kind"]) == (17, "extra_collective"), div
    lines = {int(r): c["callsite"]["line"] for r, c in div["per_rank"].items() if c}
    assert lines == {r: 63 if r == culprit else 46 for r in range(6)}, lines
    ranks = {r["rank"]: r["callsite"]["line"] for r in d["ranks"]}
    assert ranks == {r: 46 if r == culprit else 51 for r in range(6)}, ranks
