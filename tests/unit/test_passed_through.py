"""gates.went_through (the count shift's premise): a rank at a later line of a loop's body
posted the collective of an earlier line itself only where nothing in the body lets a pass
get by that line without posting it."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_hang.analysis.gates import went_through
from moe_hang.capture.source import read_facts
from moe_hang.evidence.stacks import Frame

JOB = '''import torch.distributed as dist
for step in range(4):
    dist.all_reduce(a)
    for g in grads_with_tokens:
        dist.all_reduce(g)
    if step % 2:
        dist.all_reduce(b)
    try:
        dist.all_reduce(c)
    except RuntimeError:
        pass
    if skip:
        continue
    dist.all_reduce(d)
    dist.barrier(group=tp)
'''


@pytest.mark.parametrize("line, passed", [
    (3, True),    # right in the loop's body: every pass posts it
    (5, False),   # an inner loop may run no time
    (7, False),   # under an if
    (9, False),   # in a try
    (14, False),  # after a guard that leaves the pass early
])
def test_only_a_line_every_pass_posts_was_posted_by_a_rank_past_it(
        tmp_path: Path, line: int, passed: bool) -> None:
    job = tmp_path / "job.py"
    job.write_text(JOB)
    at_b, at_a = Frame(str(job), line, "<module>"), Frame(str(job), 15, "<module>")
    src = read_facts([at_b, at_a])
    assert went_through(src, [at_a], [at_b], None, []) is passed
    assert went_through(src, [at_b], [at_a], None, []) is False  # the rank behind posted nothing


LAP = '''import torch.distributed as dist
for step in range(4):
    dist.all_reduce(a, group=tp)
    loss = step_loss()
    dist.all_reduce(loss)
'''


@pytest.mark.parametrize("posted, went", [(4, True), (5, False)])
def test_a_rank_a_pass_on_went_through_the_line_the_others_are_past(
        tmp_path: Path, posted: int, went: bool) -> None:
    """A rank at line 3 waiting in tp's #5 where the ranks at line 5 (both lines posted every
    pass) posted up to tp#4 is a pass on: it went through line 5 too. Where they posted tp#5
    already, nothing says it is a pass on."""
    from moe_hang.evidence.flight_recorder import Collective

    job = tmp_path / "job.py"
    job.write_text(LAP)
    at_a, at_b = Frame(str(job), 3, "<module>"), Frame(str(job), 5, "<module>")
    src = read_facts([at_a, at_b])
    mine = Collective(pg="1", seq=5, op="all_reduce", frames=[])
    assert went_through(src, [at_a], [at_b], mine, [{"1": posted}]) is went
    assert went_through(src, [at_a], [at_b], None, [{"1": posted}]) is False
