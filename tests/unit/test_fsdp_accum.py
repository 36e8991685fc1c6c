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
    assert f"where rank {more} all-gathered parameters instead: FSDP reduces after a " \
           "backward only where gradient sync is on" in fix, fix
    assert f"rank {more} has more micro-batches this step" in fix, fix
    assert "Give every rank the same number of micro-batches" in fix, fix
