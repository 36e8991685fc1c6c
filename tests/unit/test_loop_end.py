"""Where a loop ends is nothing the agreed steps showed (fresh seed 30586142, job 61, both
roles; a 4x2 mesh, 8 ranks; the recorders' entries without call sites).

Each step posts its token count, accuracy and loss as size-1 all-reduces with
``async_op=True``, waited at the step's end. Rank C logs its gradient norm once more (57,
under ``if FAULTY and step == FAULT_STEP:``): it pairs silently with the others' loss, its
loss with their next token count... to the end: the others finish the loop's five passes and
wait in the final barrier (62) while C waits in its last loss (59). Shapes alone, the
program's step is one size-1 all-reduce after another (a period of one): "C's all-reduce is
what the steps post next, the others' barrier never was" blamed the seven (history, both
roles). A collective past the training loop is what no step could show (``ladder
._past_the_loop``); the count shift reads C's extra, under the rank condition."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


@pytest.mark.parametrize(("name", "culprit"), [("async_extra_loop_end_6", 6),
                                               ("async_extra_loop_end_1", 1)])
def test_ranks_past_the_loop_broke_nothing_the_steps_showed(fixtures, name, culprit):
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    assert d["fix"].startswith(f"Rank {culprit} posted more collectives on default_pg"), d["fix"]
    div = d["first_divergence"]
    lines = {int(r): c["callsite"]["line"] for r, c in div["per_rank"].items() if c}
    assert lines == {r: 57 if r == culprit else 59 for r in range(8)}, lines
