"""A rooted collective whose members name different roots (analysis/roots.py). A new user's
job (fixtures/best_src_jobs/best_src.py, 3 ranks under ``moe-hang watch``, both roles):
after each epoch the best config is broadcast with ``broadcast_object_list(cfg, src=best)``,
``best`` computed on each rank from its own copy of the scores; at epoch 2 one rank's copy is
stale. Every rank waits in the broadcast, the recorders' entries all match (they keep no
root); ``moe-hang diagnose`` of a plain launch (stacks alone: the source shows the call on
the default group). Was: "waiting 10 s on rank 0 in broadcast default_pg#8; ..." and
watch waited."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import relocated

from moe_hang.analysis.facts import facts
from moe_hang.analysis.roots import root_camps, roots_differ
from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.calls import RootedCall, pyspy_root
from moe_hang.evidence.load import load_capture

C10D = "/x/site-packages/torch/distributed/distributed_c10d.py"


def _run(fixtures, tmp_path, name):
    return relocated(fixtures / name, tmp_path / "run", "/tmp/trial3",
                     str(fixtures / "best_src_jobs"))


@pytest.mark.parametrize("name, odd", [("best_src_1", 1), ("best_src_0", 0),
                                       ("best_src_stacks_1", 1)])
def test_ranks_naming_another_root_are_a_desync(fixtures, tmp_path, name, odd):
    d = diagnose(load_capture(_run(fixtures, tmp_path, name))).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"], d["rule_id"]) == (
        "desync", [odd], "majority", "roots"), d["summary"]
    others = [r for r in range(3) if r != odd]
    assert f"naming different roots (ranks {others[0]}, {others[1]} src=1; rank {odd} " \
           "src=0)" in d["summary"], d["summary"]
    assert d["fix"].startswith("Every rank must pass broadcast_object_list the same src"), \
        d["fix"]


def test_ranks_of_different_groups_may_name_different_roots(fixtures, tmp_path):
    """Each tp group broadcasts from its own root: where the ranks are not in one group (here
    one rank's recorder names another), nothing is said of their roots."""
    f = facts(load_capture(_run(fixtures, tmp_path, "best_src_1")))
    assert root_camps(f) is not None
    v = f.views[0]
    assert v.current is not None
    f.views[0] = dataclasses.replace(v, current=dataclasses.replace(v.current, pg="7"))
    assert root_camps(f) is None


def test_the_root_is_the_outermost_call_that_shows_one():
    """``broadcast_object_list(src=0)`` passes its inner ``broadcast`` ``src=None`` and a
    ``group_src``: the call the job made is read; a group object says not which group."""
    raw = [{"name": "broadcast", "filename": C10D, "locals": [
               {"name": "src", "repr": "None"}, {"name": "group_src", "repr": "0"}]},
           {"name": "broadcast_object_list", "filename": C10D, "locals": [
               {"name": "src", "repr": "0"}, {"name": "group", "repr": "None"}]},
           {"name": "<module>", "filename": "/job.py"}]
    assert pyspy_root(raw) == RootedCall("broadcast_object_list", 0, "src", True)
    raw[1]["locals"] = [{"name": "group", "repr": "<ProcessGroup at 0x7f>"}]
    assert pyspy_root(raw) == RootedCall("broadcast", 0, "group_src", None)
    raw[0]["locals"].append({"name": "group", "repr": "<ProcessGroup at 0x7e>"})
    assert pyspy_root(raw) == RootedCall("broadcast", 0, "group_src", None)  # which, unknown


def test_no_root_named_by_a_majority_names_every_rank(fixtures, tmp_path):
    """Three ranks, three roots: the ladder's majority rung leaves nothing, and no other rung
    reads roots: every rank is named, and what would settle it."""
    f = facts(load_capture(_run(fixtures, tmp_path, "best_src_1")))
    for r, root in ((0, 0), (1, 1), (2, 2)):
        v = f.views[r]
        assert v.stack.root is not None
        f.views[r] = dataclasses.replace(v, stack=dataclasses.replace(
            v.stack, root=dataclasses.replace(v.stack.root, root=root)))
    out = roots_differ(f)
    assert (out.culprits, out.basis) == ([0, 1, 2], "ambiguous"), out.summary
    assert "No root has a majority" in out.summary, out.summary
