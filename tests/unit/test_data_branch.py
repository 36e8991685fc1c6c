"""The data decision behind an extra (a job written for a new-user trial, 4 ranks under
``watch``, both roles). A small MoE trainer logs metrics with ``async_op=True`` all-reduces
waited at the step's end; a rank whose routing left an expert without tokens also all-reduces
a "dead expert" counter under ``if (counts == 0).any():`` — no rank test, each rank's own
data. Its size-1 all-reduce meets the others' gradient all-reduce and gloo aborts it. Was:
the extra's line without the branch, and advice for a rank-only evaluation. The branch its
line sits in is named, and the advice is to post it everywhere (a neutral value where the
branch is not taken)."""

from __future__ import annotations

import pytest

from moe_hang.analysis.blocks import taken_branch
from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_captures
from moe_hang.evidence.source import Gate, LineFacts, SourceFacts
from moe_hang.evidence.stacks import Frame


@pytest.mark.parametrize(("name", "culprit"), [("data_branch_extra_0", 1),
                                               ("data_branch_extra_1", 2)])
def test_the_branch_an_extra_sits_in_is_its_data_decision(fixtures, name, culprit):
    d = diagnose(load_captures([fixtures / name])).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    assert "under `if (counts == 0).any()`" in d["summary"], d["summary"]
    others = ", ".join(str(r) for r in range(4) if r != culprit)
    assert d["fix"].startswith(
        f"Rank {culprit} posts the all_reduce at /tmp/newuser/moe_metrics.py:48 under "
        f"`if (counts == 0).any()` that ranks {others} never post: post it on every rank "
        "every step, with a neutral value where the branch is not taken"), d["fix"]
    at = {r["rank"]: r["callsite"]["line"] for r in d["ranks"]}
    assert at == {r: 48 if r == culprit else 50 for r in range(4)}, at


def test_a_guard_that_leaves_is_no_branch_the_line_sits_in():
    path = "/job.py"
    guard, branch = Gate(18, 19, "not tokens", "return"), Gate(28, 31, "x > 0", "else")
    src = SourceFacts({path: {20: LineFacts((), gates=(guard,)),
                              30: LineFacts((), gates=(guard, branch))}})
    assert taken_branch(src, [Frame(path, 20, "f")]) is None
    assert taken_branch(src, [Frame(path, 30, "f")]) == "if not (x > 0)"


JOB = '''\
import torch.distributed as dist
for step in range(8):
    if step % 4 == 0:  # every rank alike in a pass
        dist.all_reduce(t)  # PERIODIC
    if mine > 5.0:
        for k in range(n_local):  # how many: the rank's own count
            dist.all_reduce(t)  # LOOPED
    if flag.any():
        if step % 2 == 0:
            dist.all_reduce(t)  # NESTED
'''


def test_a_branch_every_rank_decides_alike_or_around_a_loop_is_not_the_decision(tmp_path):
    """A test on the loop's counter alone is taken alike in a pass (the next gate out is the
    decision); a branch with a loop inside it around the line says how many passes, not
    whether: none named."""
    from moe_hang.capture.source import read_facts

    job = tmp_path / "job.py"
    job.write_text(JOB)
    lines = {tag: n for n, text in enumerate(JOB.splitlines(), 1)
             for tag in ("PERIODIC", "LOOPED", "NESTED") if f"# {tag}" in text}
    frames = {tag: Frame(str(job), n, "<module>") for tag, n in lines.items()}
    src = read_facts(list(frames.values()))
    assert taken_branch(src, [frames["PERIODIC"]]) is None
    assert taken_branch(src, [frames["LOOPED"]]) is None
    assert taken_branch(src, [frames["NESTED"]]) == "if flag.any()"
