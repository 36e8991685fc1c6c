"""Ranks out of step in a loop: training resumed from each rank's own record of its last
saved step, one rank's stale (tests/unit/fixtures/trial_jobs/, recorded under
``moe-hang watch``). Every 4 steps every rank evaluates under ``if step % 4 == 0:`` — a test
on the loop's counter, decided alike by every rank in one pass — but the stale rank's loop
began a step earlier, so the others' evaluation collective meets its bucket all-reduce.

Was: the ranks that evaluated blamed by history ("it broke what its earlier iterations
kept": the recorded steps had not reached a step divisible by 4), with "the test held on
rank 1 alone (its own data)". What the agreed steps always did says nothing of a collective
that comes due only at some passes; the advice says the ranks are out of step. The captures
keep the source facts: the job files need not exist where this runs (self-contained)."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rules import diagnose
from moe_hang.analysis.source import periodic_gate
from moe_hang.evidence.load import load_capture
from moe_hang.evidence.source import Gate, LineFacts, SourceFacts, Step

OUT_OF_STEP = "The ranks are out of step in the loop at /tmp/trial/"


@pytest.mark.parametrize(("fixture", "culprits", "basis", "evaluated", "kind"), [
    # two ranks, rank 0 stale: gloo aborts rank 1 (1 element against 577); nothing decides
    ("resume_skew_2r_0", [0, 1], "ambiguous", "Rank 1", "size_mismatch"),
    # three ranks, rank 1 stale: the two that agree decide
    ("resume_skew_3r_1", [1], "majority", "Ranks 0, 2", "missing_rank"),
    # a checkpoint barrier under the same test (rank 1 stale): a hang, gloo aborts nothing
    ("resume_skew_barrier_1", [0, 1], "ambiguous", "Rank 0", "op_mismatch"),
])
def test_ranks_out_of_step_at_a_collective_every_pass_decides_alike(
        fixtures, fixture, culprits, basis, evaluated, kind):
    d = diagnose(load_capture(fixtures / fixture)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", culprits, basis), d["summary"]
    assert d["first_divergence"]["kind"] == kind
    assert d["fix"].startswith(OUT_OF_STEP), d["fix"]
    assert "(`for step in range(start, start + 8)`)" in d["fix"], d["fix"]
    assert f"{evaluated} posted at " in d["fix"] and "under `if step % 4 == 0:`" in d["fix"]
    assert "its own data" not in d["fix"]
    assert d["fix_site"]["line"] == 36, d.get("fix_site")


def _src(test: str, *, rank_condition: str | None = None) -> SourceFacts:
    loop = Step("module", 5, "body", "For", 10, header="for step in range(start, 99)")
    line = LineFacts(path=(loop, Step("10:0:body", 3, "body", "If", 14)),
                     rank_condition=rank_condition, gates=(Gate(14, 15, test, "if"),))
    return SourceFacts(files={"job.py": {15: line}})


def test_a_gate_on_the_loops_counter_alone_is_periodic():
    assert periodic_gate(_src("step % 4 == 0"), "job.py", 15) == Gate(14, 15, "step % 4 == 0",
                                                                      "if")
    assert periodic_gate(_src("step % EVAL_EVERY == 0"), "job.py", 15) is not None
    # the rank's data decides it, or no counter is read (a constant is the same every pass)
    assert periodic_gate(_src("val < best and step % 4 == 0"), "job.py", 15) is None
    assert periodic_gate(_src("DEBUG"), "job.py", 15) is None
    # a constant may be the rank's own (``FAULTY = RANK == 3``): the source says so
    assert periodic_gate(_src("FAULTY and step == 3", rank_condition="FAULTY"),
                         "job.py", 15) is None
    assert periodic_gate(_src("step % 4 == 0"), "job.py", 99) is None  # not read: no gate
