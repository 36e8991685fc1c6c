"""Trials through torch's own dumps (the corpus's ``analyze`` mode: plain torchrun, every
stuck rank writes ``_dump_fr_trace()`` and its JSON twin), both roles. Both were a wrong
culprit, named definite.

- ``nested_epoch_extra`` (epochs of batches, rank C's shard a batch longer in epoch 1; the
  loss and the accuracy all-reduces are one float each): the reader kept the last 4 entries
  per group of every dump, so the agreed steps the ladder learned were three losses, and the
  short rank's accuracy "broke" them. A small job's dumps are now read whole: the history
  is as long as the budget shared by the dumps allows (``HISTORY_BUDGET``).
- The same from the JSON dumps (no frames): every all-reduce reads alike, and the agreed
  steps are one collective posted again and again, never seen to end. One rank's barrier
  against the other's all-reduce is where that run ends on one side: one more of it, or one
  fewer, and nothing the steps showed says which (``Program.endless``): no culprit named.
- ``fsdp2_eval_between_steps`` from the JSON dumps: the windowed history named the rank
  that did nothing extra; read whole, the evaluating rank."""

from __future__ import annotations

import pytest

from moe_hang.commands.diagnose import analyze_paths


@pytest.mark.parametrize(("fixture", "long_rank"), [
    ("nested_extra_dumps_0", 1), ("nested_extra_dumps_1", 0)])
def test_the_whole_history_of_a_small_jobs_dumps_names_the_longer_epoch(fixtures, fixture,
                                                                         long_rank):
    d = analyze_paths([fixtures / fixture / "pickle"], force=False)
    assert (d.verdict, d.culprit_ranks) == ("desync", [long_rank]), d.summary
    fd = d.first_divergence
    assert fd is not None and (fd.pg, fd.seq) == ("0", 10)
    c = fd.per_rank[long_rank]
    assert c is not None and c.callsite is not None and c.callsite.line == 33  # its loss


@pytest.mark.parametrize("fixture", ["nested_extra_dumps_0", "nested_extra_dumps_1"])
def test_where_a_run_never_seen_to_end_ends_names_no_one(fixtures, fixture):
    d = analyze_paths([fixtures / fixture / "json"], force=False)
    assert d.verdict == "desync"
    assert (d.culprit_ranks, d.culprit_basis) == ([0, 1], "ambiguous"), d.summary
    # what would settle it, where no line is known: not "compare the lines"
    assert d.fix is not None and "holds no rank's line: torch's pickle dumps" in d.fix, d.fix


@pytest.mark.parametrize(("fixture", "evaluator"), [
    ("fsdp2_eval_json_0", 0), ("fsdp2_eval_json_1", 1)])
def test_the_evaluating_rank_from_json_dumps_read_whole(fixtures, fixture, evaluator):
    d = analyze_paths([fixtures / fixture], force=False)
    assert (d.verdict, d.culprit_ranks) == ("desync", [evaluator]), d.summary
