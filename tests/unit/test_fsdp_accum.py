"""FSDP2 with gradient accumulation, micro-batches packed by each rank's own data (a new
user's job, fixtures/fsdp_accum_jobs/fsdp_accum.py, 3 ranks): at step 2 one rank has three
micro-batches where the others have two. Sync is on for the last micro-batch only
(``set_requires_gradient_sync``), so after their second backward the others reduce gradients
while it all-gathers parameters for its own (gradient sync off). Recorded under ``moe-hang
watch`` (both roles) and by ``moe-hang diagnose`` of a plain launch. Was: "rank 2 did not
call the module ranks 0, 1 called ... run a skipped block on an empty or dummy input" —
what it lacked is FSDP's gradient reduction, not a module's all-gather."""

from __future__ import annotations

import pytest
from conftest import relocated

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


@pytest.mark.parametrize("name, more, basis", [("fsdp_accum_2", 2, "history"),
                                               ("fsdp_accum_0", 0, "history"),
                                               ("fsdp_accum_stacks_2", 2, "majority")])
def test_a_rank_without_the_others_gradient_reduction_had_its_sync_off(
        fixtures, tmp_path, name, more, basis):
    run = relocated(fixtures / name, tmp_path / "run", "/tmp/trial2",
                    str(fixtures / "fsdp_accum_jobs"))
    d = diagnose(load_capture(run)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [more], basis), d["summary"]
    fix = d["fix"]
    assert "dummy input" not in fix and "did not call" not in fix, fix
    assert f"where rank {more} all-gathered parameters in its backward instead: FSDP " \
           "reduces a module's gradients only where gradient sync is on" in fix, fix
    assert "more micro-batches this step" in fix and "or that module was not called" in fix
    assert "Give every rank the same number of micro-batches" in fix, fix


def test_a_culprit_in_its_next_forward_is_not_said_to_have_had_sync_off():
    """The others reduce after their backward; a rank that skipped its backward (a guard
    before ``loss.backward()``) all-gathers in its next forward: nothing says its sync was off
    (the review's counter-case)."""
    from moe_hang.analysis.diagnosis import CulpritBasis, Divergence, MismatchKind
    from moe_hang.analysis.situation import Situation
    from moe_hang.evidence.stacks import Frame

    fsdp = "/x/site-packages/torch/distributed/fsdp/_fully_shard/"
    reduce = [Frame(fsdp + "_fsdp_collectives.py", 619, "foreach_reduce"),
              Frame(fsdp + "_fsdp_param_group.py", 688, "post_backward"),
              Frame("/x/site-packages/torch/autograd/graph.py", 979, "_engine_run_backward"),
              Frame("/job/train.py", 35, "<module>")]
    forward = [Frame(fsdp + "_fsdp_collectives.py", 364, "foreach_all_gather"),
               Frame(fsdp + "_fsdp_param_group.py", 407, "unshard"),
               Frame(fsdp + "_fsdp_state.py", 230, "_pre_forward"),
               Frame("/job/train.py", 33, "<module>")]
    backward = [*forward[:2], Frame(fsdp + "_fsdp_param_group.py", 585, "pre_backward"),
                *reduce[2:]]
    div = Divergence(pg="0", seq=9, kind=MismatchKind.OP, members=[0, 1, 2],
                     per_rank={0: None, 1: None, 2: None})
    for mine, said in ((forward, False), (backward, True)):
        s = Situation(div, [2], CulpritBasis.HISTORY, {}, {0: reduce, 1: reduce, 2: mine})
        assert s.lacks_fsdp_reduce() is said
