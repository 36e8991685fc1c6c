"""Stacks alone, a module-level training loop py-spy reads no counter of: line numbers order
statements only within one lap, and what the stacks show across a lap reads two ways (fresh
fuzz seed 47190263, jobs 2 and 8, recorded captures, both roles)."""

from __future__ import annotations

import pytest
from conftest import captured, relocated

from moe_hang.analysis.rules import diagnose
from moe_hang.analysis.source import holds, taken_only_by
from moe_hang.evidence.load import load_capture

JOBS = "/tmp/fz47/jobs"


def _diagnose(fixtures, tmp_path, name):
    run = relocated(fixtures / name, tmp_path / "run", JOBS,
                    str(fixtures / "fuzz47190263_jobs"))
    return diagnose(captured(load_capture(run))).to_dict()


@pytest.mark.parametrize("name, culprit", [("stacks_extra_lap_0", 5),
                                           ("stacks_extra_lap_1", 0)])
def test_a_silent_extra_leaves_its_rank_a_lap_behind_and_the_rank_is_named(
        fixtures, tmp_path, name, culprit):
    """A 4x2 mesh: the culprit posts one more size-1 all-reduce on the default group, which
    pairs silently with the others' loss all-reduce; it waits in its own loss all-reduce
    (:56) while its tp peer waits in the next step's tp all-reduce (:46) and six ranks in
    their dp all-reduces (:49). Behind every other camp on a collective every rank owes:
    "seven skipped it" and "it posted an extra" read the same stacks; the one rank is named
    by count, and the tp peer (held up in between) is counted with the rest. Was: the seven
    others, "they went past what the others wait in"."""
    d = _diagnose(fixtures, tmp_path, name)
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [culprit], "majority"), d["summary"]
    site = {x["rank"]: x["callsite"]["line"] for x in d["ranks"]}
    assert site[culprit] == 56
    assert d["fix"].startswith(f"Rank {culprit} posted its collective at"), d["fix"]


@pytest.mark.parametrize("name, culprit, peer", [("stacks_pipeline_lap_0", 3, 2),
                                                 ("stacks_pipeline_lap_1", 1, 0)])
def test_a_pipeline_rank_that_skipped_waits_a_lap_on_in_its_recv(
        fixtures, tmp_path, name, culprit, peer):
    """A 4-stage pipeline: the culprit skips the step's loss all-reduce (:53) and goes on to
    the next step's recv (:44) from its peer, which waits with the others in that
    all-reduce. The recv's line comes earlier in the loop body than the peer's: the lines
    say it is a lap on (it went round past the peer's collective), so the peer owes it no
    send. Was: the peer named, "went on past the send it owed". Nor is `if RANK > 0` a
    branch only the culprit takes: another rank above 0 waits at :53."""
    d = _diagnose(fixtures, tmp_path, name)
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [culprit]), d["summary"]
    site = {x["rank"]: x["callsite"]["line"] for x in d["ranks"]}
    assert (site[culprit], site[peer]) == (44, 53)
    assert "RANK > 0" not in d["fix"], d["fix"]


@pytest.mark.parametrize("cond, ranks", [
    ("if RANK > 0", [False, True, True, True]),
    ("if not (rank == 0)", [False, True, True, True]),
    ("if dist.get_rank() in (1, 3)", [False, True, False, True]),
    ("if self.rank != 3", [True, True, True, False]),
    ("if rank % 2 == 0 and step == 3", [None, False, None, False]),
    ("if rank == 1 or step == 3", [None, True, None, None]),
    ("if is_main_process", [None] * 4),  # a flag, not the rank's number
    ("if local_rank == 0", [None] * 4),  # a node's own numbering
    ("if RANK == WORLD - 1", [None] * 4),
    ("if (rank // 2, rank % 2) == (1, 0)", [False, False, True, False]),  # tuples, not sets
    ("if rank in [0, 1] + [3]", [True, True, False, True]),
    ("if rank < (1, 2)", [None] * 4),
])
def test_a_rank_condition_is_evaluated_for_each_rank_where_the_rank_decides(cond, ranks):
    assert [holds(cond, r) for r in range(4)] == ranks


def test_a_branch_others_take_too_is_no_branch_only_the_culprit_takes():
    assert taken_only_by("if RANK > 0", [3], [0]) is True
    assert taken_only_by("if RANK > 0", [3], [0, 1, 2]) is False
    assert taken_only_by("if rank != 3", [0, 1], [3]) is True
    assert taken_only_by("if rank != 3", [3], [0]) is False
    assert taken_only_by("if FAULTY and step == 2", [5], [0, 1]) is True  # not decided


TP = "/tmp/newuser"  # where the captures were recorded (a job written for a new-user trial)


def _tp(fixtures, tmp_path, name):
    run = relocated(fixtures / name, tmp_path / "run", TP, str(fixtures / "tp_pairs_jobs"))
    return diagnose(captured(load_capture(run))).to_dict()


@pytest.mark.parametrize("name, lone", [("tp_extra_1", 0), ("tp_extra_2", 3)])
def test_a_lap_ahead_on_a_subgroup_against_several_lagging_ranks_is_not_counted(
        fixtures, tmp_path, name, lone):
    """Tensor-parallel pairs, a module-level loop: one rank posts an extra world all-reduce
    (pairing silently), so its tp partner, a lap on, waits in the pair's all-reduce (:18)
    while the other three wait in the world one (:23). The stacks are those of the partner
    having skipped the world all-reduce: which of the three lagging ranks is its partner
    the stacks do not say, nor whether it skipped or its partner posted one more. Was: the
    partner named, *likely* (by count, and by the lap alone). Now: a hang whose culprit this
    capture cannot name, and what would (the recorder, under watch)."""
    d = _tp(fixtures, tmp_path, name)
    assert (d["verdict"], d["culprit_ranks"]) == ("hang", []), d["summary"]
    assert "moe-hang watch" in d["summary"] and "at 2 lines" in d["summary"], d["summary"]
    site = {x["rank"]: x["callsite"]["line"] for x in d["ranks"]}
    assert site[lone] == 18 and {v for r, v in site.items() if r != lone} == {23}


@pytest.mark.parametrize("name, skipper", [("tp_skip_0", 0), ("tp_skip_3", 3)])
def test_the_same_stacks_with_the_skip_under_a_rank_condition_name_the_skipper(
        fixtures, tmp_path, name, skipper):
    """The same stacks where the source shows why: the world all-reduce (:21) runs under
    `if not (rank == debug_rank and step == 2)`, a branch that leaves ranks out around the
    collective every rank owes. The source names the rank outside it (was: the branch
    voided, its camp being on a subgroup — but the condition is on the other camp's
    collective, the every-rank one)."""
    d = _tp(fixtures, tmp_path, name)
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [skipper], "source"), d["summary"]
    others = "ranks " + ("1-3" if skipper == 0 else "0-2")
    assert f"that {others} wait in" in d["fix"], d["fix"]


@pytest.mark.parametrize("name, skipper", [("tp_skip_0", 0), ("tp_skip_3", 3)])
def test_next_opens_the_condition_the_skipper_does_not_take(fixtures, tmp_path, name, skipper):
    """The fix is at the ``if`` that leaves the skipper out (:20), not at the line it waits
    at: ``next:`` opens it, and says what it is to that rank."""
    from moe_hang.report.words import ReportContext, next_words

    run = relocated(fixtures / name, tmp_path / "run", TP, str(fixtures / "tp_pairs_jobs"))
    (run / "source.json").unlink()  # read now, as a capture made today stores it
    d = diagnose(captured(load_capture(run)))
    assert d.fix_site is not None and (d.fix_site.file.endswith("train3.py"),
                                       d.fix_site.line) == (True, 20), d.fix_site
    what, why = next_words(d, ReportContext("diagnose", "moe-hang diagnose"))
    assert what.endswith("train3.py:20") and why == f"the condition rank {skipper} does not take"
    again = type(d).from_dict(d.to_dict())  # as another node prints it
    assert (again.fix_site, again.fix_site_why) == (d.fix_site, d.fix_site_why)
