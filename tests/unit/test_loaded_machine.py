"""Captures from a loaded machine (the corpus run beside a fuzz run): evidence thinner than
on a quiet one, and what it still says.

A rank idle on its own DataLoader worker's work (tests/corpus/jobs/dataloader_worker_busy.py
under ``moe-hang diagnose``), recorded on a loaded machine (a fuzz run beside the corpus):
the worker got too little CPU over the 1.2 s window to count as moving, but py-spy found it
on CPU inside ``Shards.__getitem__``. Was: "Rank 1 is outside any collective ... while rank 0
in all_reduce waits for it", HANG, exit 3 on a healthy job."""

from __future__ import annotations

import dataclasses

from conftest import relocated

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture


def _ev(fixtures, tmp_path):
    run = relocated(fixtures / "dataloader_busy_loaded_1", tmp_path / "run",
                    "/work/main/tests/corpus/jobs", str(fixtures.parents[1] / "corpus" / "jobs"))
    return load_capture(run)


def test_a_helper_on_cpu_at_the_jobs_code_is_work_in_progress(fixtures, tmp_path):
    d = diagnose(_ev(fixtures, tmp_path)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["certainty"]) == (
        "straggler", [1], "uncertain"), d["summary"]
    assert "through its DataLoader worker" in d["summary"], d["summary"]
    assert "dataloader_worker_busy.py:37 Shards.__getitem__" in d["summary"], d["summary"]


def test_a_helper_off_cpu_is_not_work_in_progress(fixtures, tmp_path):
    """The same worker seen off CPU there: the rank waits on it, stuck (not healthy)."""
    ev = _ev(fixtures, tmp_path)
    r1 = ev.ranks[1]
    r1.helpers = [dataclasses.replace(h, busy=False) for h in r1.helpers]
    d = diagnose(ev).to_dict()
    assert d["verdict"] == "hang" and d["culprit_ranks"] == [1], d["summary"]


def test_a_wait_without_call_sites_is_at_the_line_that_posted_its_handle(fixtures, tmp_path):
    """tests/corpus/jobs/async_wait_skip.py under watch beside a fuzz run (both roles): no
    probe answered, so the recorders are the periodic saves, without call sites. The waiting
    rank's line is the post its handle came from (the source: ``work = dist.all_reduce(...,
    async_op=True)`` at 19), not the ``work.wait()`` it sits at (22)."""
    for name, skipper in (("async_wait_no_sites_0", 1), ("async_wait_no_sites_1", 0)):
        run = relocated(fixtures / name, tmp_path / name, "/work/main/tests/corpus/jobs",
                        str(fixtures.parents[1] / "corpus" / "jobs"))
        d = diagnose(load_capture(run)).to_dict()
        assert (d["verdict"], d["culprit_ranks"]) == ("desync", [skipper]), d["summary"]
        waiter = next(r for r in d["ranks"] if r["rank"] != skipper)
        assert waiter["callsite"]["line"] == 19, waiter
