"""The fast subset of the accuracy corpus (cases.py, ``fast=True``), through the same code as
``scripts/corpus.py``: each case runs the real CLI on a real torchrun job and must be fully
right; a failure lists the fields that differed. Their mirrored twins (the ranks' roles
swapped: the culprit must swap) run too; ``CORPUS_MIRROR=0`` leaves them out. The whole
corpus: ``python scripts/corpus.py`` (``make corpus``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import harness  # noqa: E402
from cases import CASES, Case  # noqa: E402

FAST = [c for c in CASES if c.fast]
MIRROR = os.environ.get("CORPUS_MIRROR", "1") != "0"
RUNS = [(c, env, mirrored) for c in FAST for env, mirrored in harness.runs_of(c, MIRROR)]


def _id(run: tuple[Case, object, bool]) -> str:
    return run[0].name + ("-mirrored" if run[2] else "")


@pytest.mark.corpus
@pytest.mark.parametrize("run", [pytest.param(r, id=_id(r), marks=pytest.mark.timeout(
    r[0].timeout_s + 30)) for r in RUNS])
def test_fast_case(run: tuple[Case, harness.Env, bool], tmp_path: Path) -> None:
    case, env, mirrored = run
    s = harness.run_and_score(case, env, mirrored, tmp_path / "run")
    if s.skipped:
        pytest.skip(s.skipped)
    assert not s.outcome.survivors, f"processes survived: {s.outcome.survivors}"
    wrong = {k: v for k, v in s.checks.items() if v not in (harness.OK, harness.NOT_CHECKED)}
    assert s.ok or wrong, s.checks
    assert not wrong, (f"{s.label}: {wrong}\n  got: {s.got}\n  run directory: "
                       f"{s.outcome.out_dir}")


def test_ground_truth_is_well_formed() -> None:
    """Every marker a case names exists exactly once in its job, every mirrored twin swaps
    at least one role, and no job imports moe_hang."""
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))
    for c in CASES:
        job = harness.JOBS / c.job
        assert job.exists(), c.job
        assert "moe_hang" not in job.read_text(), f"{c.job} imports moe_hang"
        harness.markers(job)  # raises on a duplicate
        for env, _mirrored in harness.runs_of(c, True):
            exp = harness.expected_for(c, env)
            for ex in exp.lines:
                if ex.site.marker is not None:
                    harness.resolve_site(ex.site, job)
            assert all(0 <= r < c.nproc for r in exp.culprits), c.name
        if c.mirror is not None:
            assert any(c.env.get(k) != v for k, v in c.mirror.items()), c.name
    assert sum(c.fast for c in CASES) >= 5


def test_a_field_left_unchecked_is_not_a_pass() -> None:
    """A problem case that states nothing about the lines or the advice cannot come out
    "fully right": the run says which field went unchecked."""
    case = next(c for c in CASES if c.name == "size_mismatch")
    bare = Case(case.name, case.job, case.nproc, case.verdicts, env=case.env,
                culprits=case.culprits)
    got = harness.CaseResult(exit_code=3, diagnosis={
        "verdict": sorted(case.verdicts)[0], "culprit_ranks": sorted(case.culprits(case.env)),
        "fix": "", "summary": "", "ranks": []})
    s = harness.score(bare, dict(case.env), False, got)
    assert not s.ok
    assert s.checks["lines"] == s.checks["advice"] == harness.NO_EXPECTATION
    full = harness.score(case, dict(case.env), False, got)
    assert full.checks["lines"] != harness.NO_EXPECTATION


def _raise_diagnosis(case: Case, env: harness.Env, culprits: list[int]) -> dict[str, object]:
    """A diagnosis of raise_in_rank that is right on every field but the culprits."""
    job = harness.JOBS / case.job
    lines = harness.markers(job)
    c = int(env["CULPRIT_RANK"])
    ranks = [{"rank": r, "callsite": {"file": str(job),
                                      "line": lines["raise" if r == c else "allreduce"]}}
             for r in range(case.nproc)]
    return {"verdict": "crash", "culprit_ranks": culprits, "fix": "", "ranks": ranks,
            "summary": "rank raised ValueError", "culprit_basis": "exception",
            "certainty": "definite"}


def test_a_two_node_run_is_right_only_when_every_node_is() -> None:
    case = next(c for c in CASES if c.name == "raise_in_rank")
    env = dict(case.env)
    right = _raise_diagnosis(case, env, [int(env["CULPRIT_RANK"])])
    wrong = _raise_diagnosis(case, env, [0, 1])
    both = harness.CaseResult(exit_code=3, nodes=[
        harness.CaseResult(exit_code=3, diagnosis=right),
        harness.CaseResult(exit_code=3, diagnosis=right)])
    assert harness.score(case, env, False, both).ok
    one = harness.CaseResult(exit_code=3, nodes=[
        harness.CaseResult(exit_code=3, diagnosis=right),
        harness.CaseResult(exit_code=3, diagnosis=wrong)])
    s = harness.score(case, env, False, one)
    assert not s.ok and s.checks["culprit"].startswith("node 1: ") and s.checks["lines"] == "ok"


def test_fix_none_is_a_miss_when_any_advice_is_given() -> None:
    case = Case("healthy_fast", "healthy_fast.py", 2, frozenset({"healthy", "straggler"}),
                fix_none=True)
    quiet = harness.CaseResult(exit_code=0, diagnosis={"verdict": "healthy", "fix": ""})
    loud = harness.CaseResult(exit_code=0, diagnosis={"verdict": "healthy",
                                                      "fix": "Cast to one dtype."})
    assert harness.score(case, {}, False, quiet).ok
    assert not harness.score(case, {}, False, loud).ok
    hint = harness.CaseResult(exit_code=0, diagnosis={"verdict": "straggler", "fix": "Look."})
    assert harness.score(case, {}, False, hint).ok  # a straggler may point at the slow rank
