"""A rank-only checkpoint under FSDP2 where the recorder keeps no call sites (fresh seed
83017265, job 40, ``fsdp_eval``, 3 ranks, ``MOE_HANG_FR_STACKS=0``, both roles): rank C alone
calls ``save_full_checkpoint(step)`` under a branch at the end of step 2; its five
``unit.unshard()`` all-gathers (42) pair silently with the others' step-3 forward (same
sizes), its own forward's first all-gather then meets their backward's, and gloo aborts a
rank. Was: "ranks 0, 1 all_gather(25) at 80; rank C never posted it" and FSDP's "dummy input"
advice (a skip). The capture now stores which functions of the module a loop calls post
collectives (``Step.helpers``: FSDP2's ``unshard()`` and calls of a module passed to
``fully_shard`` included), and the block is placed by the source (``helper_block``): the
loop's one broadcast (90) was posted by all as #51; the others posted the forward's first
(79) right after it, C five more — the one helper a branch calls between the two."""

from __future__ import annotations

import ast

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.capture.helpers import loop_helpers, posting_functions
from moe_hang.evidence.load import load_capture


@pytest.mark.parametrize(("name", "culprit"), [("checkpoint_nostacks_0", 2),
                                               ("checkpoint_nostacks_1", 1)])
def test_a_helper_under_a_branch_places_a_block_alike_the_step(fixtures, name, culprit):
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    assert "dummy input" not in d["fix"]
    assert d["fix"].startswith(f"Rank {culprit} posts 5 all_gathers from "
                               "save_full_checkpoint() at "), d["fix"]
    div = d["first_divergence"]
    assert (div["seq"], div["kind"]) == (52, "extra_collective"), div
    assert div["per_rank"][str(culprit)]["callsite"]["line"] == 42
    assert all(c is None for r, c in div["per_rank"].items() if int(r) != culprit)


def test_the_helpers_a_loop_calls_and_what_they_post():
    tree = ast.parse('''
import torch.distributed as dist
def evaluate():
    print("x")
    return model(x)
def log(t):
    dist.all_reduce(t, group=LOG)
def save():
    for unit in UNITS:
        unit.unshard()
def plain():
    return 1
fully_shard(model)
for step in range(3):
    if rank == 0:
        print(evaluate())
    log(t)
    plain()
''')
    posting = posting_functions(tree)
    assert posting == {"evaluate": (5, "all_gather", "fsdp"),
                       "log": (7, "all_reduce", "all_reduce"),
                       "save": (10, "all_gather", "fsdp")}
    loop = tree.body[-1]
    assert loop_helpers(loop, posting) == ((16, 5, "evaluate", "all_gather", "fsdp"),
                                           (17, 7, "log", "all_reduce", "all_reduce"))


@pytest.mark.parametrize(("name", "culprit"), [("eval_nostacks_0", 1), ("eval_nostacks_1", 0)])
def test_a_rank_only_validation_forward_is_placed_by_the_source(fixtures, name, culprit):
    """A job written for the occasion (``eval_nostacks_jobs/train_eval.py``: FSDP2 on two
    ranks, ``EVAL_RANK`` alone runs ``validate()`` — a forward under ``no_grad`` — every
    third step; watched with ``MOE_HANG_FR_STACKS=0``). Two ranks: no majority; the branch's
    rank condition, at the helper's call, decides. Was (rank 1 evaluating): "posted different
    sizes at seq 34", a size fix."""
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    assert d["culprit_basis"] == "source"
    assert d["fix"].startswith(f"Rank {culprit} posts 3 all_gathers from validate() at "), d["fix"]
    assert "FSDP all-gathers the parameters" in d["fix"]
    div = d["first_divergence"]
    assert (div["seq"], div["kind"]) == (31, "extra_collective"), div
    assert div["per_rank"][str(culprit)]["callsite"]["line"] == 28
