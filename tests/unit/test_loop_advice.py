"""The advice for two ranks at two lines of one training step, where a loop or a branch
lies between them: built from the situation the ladder hands over (found by a review)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_hang.analysis.advice import advise_order
from moe_hang.analysis.diagnosis import CulpritBasis, Divergence, MismatchKind, RankCollective
from moe_hang.analysis.situation import Situation
from moe_hang.capture.source import read_facts
from moe_hang.evidence.stacks import Frame

JOB = '''import torch.distributed as dist


def step(me, n):
    for mb in range(n):
        dist.all_reduce(b)
        if overflow(b):
            dist.all_reduce(flag)
    dist.all_reduce(loss)
    log(me)


def log(me):
    dist.broadcast(x, 0)


def main(me):
    for s in range(10):
        step(me, 2)
'''
TORCH = "/x/site-packages/torch/distributed/distributed_c10d.py"
NAMES = {6: "step", 8: "step", 9: "step", 10: "step", 14: "log", 19: "main"}


def _advice(job: Path, culprits: list[int], lines: dict[int, tuple[int, ...]],
            basis: CulpritBasis = CulpritBasis.HISTORY,
            before: dict[int, int] | None = None) -> str:
    frames = {r: [Frame(TORCH, 1, "all_reduce")] + [Frame(str(job), n, NAMES[n]) for n in ls]
              for r, ls in lines.items()}
    src = read_facts([f for fs in frames.values() for f in fs])
    per = {r: RankCollective(op="all_reduce", pg="0", seq=20, input_sizes=[[4]],
                             dtypes=["Float"], callsite=fr[1]) for r, fr in frames.items()}
    div = Divergence(pg="0", seq=20, kind=MismatchKind.OP, members=sorted(frames),
                     per_rank=per)
    prev = {r: [Frame(str(job), n, NAMES[n])] for r, n in (before or {}).items()}
    return advise_order(Situation(div=div, culprits=culprits, basis=basis, reports={},
                                  frames=frames, src=src, before=prev)).text


@pytest.fixture
def job(tmp_path: Path) -> Path:
    p = tmp_path / "train.py"
    p.write_text(JOB)
    return p


def test_one_more_pass_of_the_loop_or_a_skip_is_said_where_the_line_is_each_pass(job):
    text = _advice(job, [0], {0: (6, 19), 1: (9, 19)}, before={0: 6})
    assert "(inside the loop at" in text and "(as rank 0 itself did in every earlier step)" \
        in text and "same count" in text, text


def test_an_extra_in_a_branch_inside_the_loop_is_the_branch_not_one_more_pass(job):
    """Rank 0 posted the flag all-reduce (under ``if overflow(b):``) where rank 1 posted the
    loss: an extra of its data's branch, not one more pass (was: "ran the loop more times
    ... give every rank the same count")."""
    text = _advice(job, [0], {0: (8, 19), 1: (9, 19)}, before={0: 6})
    assert "same count" not in text and "in `if overflow(b):`" in text, text
    assert "the test held on rank 0 alone" in text, text


def test_waiters_at_two_places_or_a_culprit_outside_the_loop_get_no_loop_advice(job):
    """Every culprit at the one line and every waiter at one line, or nothing is said of
    the loop (was: the first culprit's and the first waiter's lines stood for all)."""
    two_sites = _advice(job, [0], {0: (6, 19), 1: (9, 19), 2: (14, 10, 19)}, before={0: 6})
    assert "inside the loop" not in two_sites, two_sites
    mixed = _advice(job, [0, 2], {0: (6, 19), 1: (9, 19), 2: (14, 10, 19)})
    assert "inside the loop" not in mixed, mixed
