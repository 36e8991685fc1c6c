"""A rank that left a loop the others are still in: the loop's ways out before its end (its
own ``break``, a ``return``) are read with the capture (``Step.exits``), and the one under a
rank condition only the culprit takes is the decision it made alone. Jobs of a new user's
trial (``early_stop_rank_jobs/``: patience-based early stopping decided on the logging rank,
or on each rank's own loss), recorded under ``moe-hang watch`` on 3 ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import relocated

from moe_hang.analysis.rules import diagnose
from moe_hang.capture.source import read_facts
from moe_hang.evidence.load import load_capture
from moe_hang.evidence.source import SourceFacts
from moe_hang.evidence.stacks import Frame

JOB = '''def train(loader):
    for step, batch in enumerate(loader):
        for micro in batch:
            if micro is None:
                break
            step_on(micro)
        if step > 100:
            return step

        def hook():
            return 1
        while True:
            break
        if done(step):
            break
    for x in range(3):
        pass
'''


def test_a_loops_ways_out_are_its_own_break_and_any_return(tmp_path: Path) -> None:
    """Line 2's loop: the ``return`` (8) and its own ``break`` (15); not the inner loops'
    ``break`` (5, 13), nor the ``return`` of a function defined in it (11). They travel with
    the capture, and their lines are read too (their branches)."""
    job = tmp_path / "job.py"
    job.write_text(JOB)
    src = read_facts([Frame(str(job), 6, "train")])
    outer, inner = src.line(str(job), 6).path[1:3]
    assert (outer.line, outer.exits) == (2, (8, 15))
    assert (inner.line, inner.exits) == (3, (5,))
    assert src.line(str(job), 15) is not None and src.line(str(job), 15).gates[0].test \
        == "done(step)"
    again = SourceFacts.from_dict(json.loads(json.dumps(src.to_dict())))
    assert again.line(str(job), 6).path[1].exits == (8, 15)


@pytest.mark.parametrize("name, lucky", [("early_stop_rank_0", 0), ("early_stop_rank_2", 2)])
def test_a_break_only_the_deciding_rank_takes_is_its_decision_alone(fixtures, name, lucky):
    """``if rank == LOG_RANK:`` around the patience check's ``break``: the rank that left the
    loop took the one way out only it can take. Was: "the ranks ran different numbers of
    iterations ... equal data shards (DistributedSampler)", the wrong fix."""
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [lucky]), d["summary"]
    fix, code = d["fix"], d["fix_code"]
    assert f"Only rank {lucky} takes the one early way out" in fix, fix
    assert "train_stop.py:32 under `if rank == LOG_RANK:` (/tmp/trial4/train_stop.py:26)" \
        in fix, fix
    assert "DistributedSampler" not in fix, fix
    assert f"dist.broadcast(stop, src={lucky})" in code and "break" in code, code


def test_a_break_on_each_ranks_own_data_is_said_beside_the_counts(fixtures):
    """Each rank's own loss decides its ``break``: no rank condition, so the way out is said
    as one of the possibilities beside different counts, never as a decision of one rank."""
    d = diagnose(load_capture(fixtures / "early_stop_local_1")).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [1]), d["summary"]
    fix = d["fix"]
    assert "its one way out before its end: `break` (/tmp/trial4/train_stop_local.py:25) under " \
           "`if bad_epochs >= 2:`" in fix, fix
    assert "different numbers of iterations" in fix and "Only" not in fix, fix


@pytest.mark.parametrize("name, lucky", [("early_stop_stacks_0", 0), ("early_stop_stacks_2", 2)])
def test_stacks_alone_name_the_rank_that_broke_out_not_the_ones_in_backward(
        fixtures, name, lucky):
    """``moe-hang diagnose`` of the same job launched plainly (no recorder, no probe): the
    deciding rank in the final barrier, the others idle inside ``loss.backward()`` — in what
    DDP's hooks posted, not outside every collective. Was: the two in backward blamed ("outside
    any collective ... slow I/O"), then, with them counted in, inconclusive."""
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [lucky], "majority"), d["summary"]
    assert f"Only rank {lucky} takes the one early way out" in d["fix"], d["fix"]
    assert f"dist.broadcast(stop, src={lucky})" in d["fix_code"]


@pytest.mark.parametrize("name, short", [("iter_shard_stacks_2", 2), ("iter_shard_stacks_0", 0)])
def test_stacks_alone_past_a_loop_with_a_way_out_name_it(fixtures, name, short):
    """``moe-hang diagnose`` of tests/corpus/jobs/iter_shard_break.py (hand-sharded samples,
    ``except StopIteration: break``) and its mirror: the short rank in the final barrier, the
    others in the loop's gradient all-reduce. The majority names it; it is past a loop the
    others are still in, which the source shows a way out of before its end: the loop's
    advice with the `break` (was: "every rank must post the same collectives in the same
    order", no loop named)."""
    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [short], "majority"), d["summary"]
    assert f"Rank {short} left the loop at" in d["fix"], d["fix"]
    assert "its one way out before its end: `break`" in d["fix"], d["fix"]
    assert d["fix_site"]["line"] == 34, d["fix_site"]  # the `break`


def test_a_rank_condition_around_the_loop_is_not_the_way_outs_own(fixtures, tmp_path: Path):
    """The same data-decided ``break``, the whole loop under ``if rank in data_ranks:`` (line
    12, before the loop): every rank still in the loop took that condition too, so it says
    nothing of who left — the way out is said beside different counts, never as one rank's
    decision (the review's case)."""
    import shutil

    root = tmp_path / "cap"
    shutil.copytree(fixtures / "early_stop_local_1", root)
    facts = json.loads((root / "source.json").read_text())
    job = next(iter(facts["files"]))
    facts["files"][job]["25"].update(rank_condition="if rank in data_ranks",
                                     rank_condition_line=12)
    (root / "source.json").write_text(json.dumps(facts))
    d = diagnose(load_capture(root)).to_dict()
    assert d["culprit_ranks"] == [1], d["summary"]
    assert "Only" not in d["fix"] and "under `if bad_epochs >= 2:`" in d["fix"], d["fix"]


def _async_skip(fixtures, tmp_path, name):
    return relocated(fixtures / name, tmp_path / "run", "/work/main/runs/fuzz-29471836-j48/jobs",
                     str(fixtures / "async_skip_no_sites_jobs"))


@pytest.mark.parametrize("name, short", [("async_skip_no_sites_7", 7),
                                         ("async_skip_no_sites_1", 1)])
def test_past_the_loop_after_as_many_passes_it_skipped_inside_one(fixtures, tmp_path, name,
                                                                  short):
    """A 4x2 mesh, 8 ranks beside a busy neighbour under watch (async_skip_no_sites_jobs, fuzz
    seed 29471836 job 8, and its mirror): at step 2 one rank skips its async all-reduce of the
    token count (``if not (FAULTY and step == 2):``); the others' logging all-reduces (one
    float each, like it) pair with its next ones silently, so it finishes the loop and waits
    in the final barrier while they wait on the last step's. No probe answered (recorders
    without call sites). Its counts on the tp and dp groups, which every pass posts on before
    the others' line, equal theirs: it made as many passes, so the advice is the skip inside
    a pass and the loop's one default-group call under a branch. Was: "the ranks ran
    different numbers of iterations ... give each the same count", both roles."""
    d = diagnose(load_capture(_async_skip(fixtures, tmp_path, name))).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [short]), d["summary"]
    fix = d["fix"]
    assert "different numbers of iterations" not in fix and "same count" not in fix, fix
    assert "after as many passes: every pass posts on another group at" in fix, fix
    assert "_async_mesh2d.py:51" in fix, fix  # the tp all-reduce: every pass, before theirs
    assert f"Rank {short} posted fewer on default_pg in those passes" in fix, fix
    assert d["fix_site"]["line"] == 49, d["fix_site"]  # the one call under a branch


def test_fewer_passes_on_another_group_keep_the_loop_advice(fixtures, tmp_path):
    """The same capture with the culprit one short on a group every pass posts on: then it
    may have made fewer passes, and the loop's advice (different counts, or one cut short)
    stays."""
    from moe_hang.analysis.facts import desync_divs, facts, situation
    from moe_hang.analysis.loops import advise_loop_left, as_many_passes
    from moe_hang.analysis.passes import loop_left

    f = facts(load_capture(_async_skip(fixtures, tmp_path, "async_skip_no_sites_7")))
    g, b = desync_divs(f)[0]
    s = situation(f, g.div, b.culprits, b.basis)
    loop = loop_left(s, 7)
    assert loop is not None and as_many_passes(s, loop) is not None
    short_one = next(pg for pg in s.enqueued[7] if pg != g.div.pg)
    s.enqueued[7] = {**s.enqueued[7], short_one: s.enqueued[7][short_one] - 1}
    assert as_many_passes(s, loop) is None
    assert "different numbers of iterations" in advise_loop_left(s, loop).text


@pytest.mark.parametrize("name, bad", [("nan_skip_stacks_1", 1), ("nan_skip_stacks_2", 2)])
def test_stacks_alone_past_a_loop_name_the_guard_that_skips_a_pass(fixtures, tmp_path, name,
                                                                   bad):
    """A new user's job (nan_skip_jobs/nan_skip.py: DDP on 3 ranks, ``if not
    torch.isfinite(loss): continue`` before ``loss.backward()``, one rank's batch corrupt at
    step 3), launched plainly and read by ``moe-hang diagnose``, and its mirror: the rank
    that skipped in the final barrier, the others in the last step's backward. No way out
    of the loop before its end, but one past their collective within a pass: the guard, the
    fix's line. Was: "every rank must post the same collectives in the same order", no line
    (under watch, the recorders name the same guard)."""
    run = relocated(fixtures / name, tmp_path / "run", "/tmp/trial",
                    str(fixtures / "nan_skip_jobs"))
    d = diagnose(load_capture(run)).to_dict()
    assert (d["verdict"], d["culprit_ranks"], d["culprit_basis"]) == (
        "desync", [bad], "majority"), d["summary"]
    assert "one way past their collective within a pass (a rank that takes it posts fewer): " \
           "`if not torch.isfinite(loss): continue` (" in d["fix"], d["fix"]
    assert (d["fix_site"]["line"], d["fix_site_why"]) == (23, "the way past their collective")
    # the majority names who deviated, not how: the others each posting one more, paired
    # silently, would leave them in the loop as well
    others = ", ".join(str(r) for r in range(3) if r != bad)
    assert f"or ranks {others} each posted one more that paired silently with one of its" \
        in d["fix"]


def test_counts_posted_after_the_loop_say_nothing_of_its_passes(fixtures, tmp_path):
    """A rank that ran fewer passes and then posted on tp and dp after the loop has their
    counts: where its last collective on such a group came after its last on the
    divergence's group, the counts are not the loop's (the review's counter-case)."""
    from moe_hang.analysis.facts import desync_divs, facts, situation
    from moe_hang.analysis.loops import as_many_passes
    from moe_hang.analysis.passes import loop_left

    f = facts(load_capture(_async_skip(fixtures, tmp_path, "async_skip_no_sites_7")))
    g, b = desync_divs(f)[0]
    s = situation(f, g.div, b.culprits, b.basis)
    loop = loop_left(s, 7)
    assert loop is not None and as_many_passes(s, loop) is not None
    pg = next(p for p, t in s.posted_ns[7].items() if p != g.div.pg)
    s.posted_ns[7] = {**s.posted_ns[7], pg: s.before_ns[7] + 1}
    assert as_many_passes(s, loop) is None


def test_a_test_every_rank_decides_alike_in_a_pass_is_no_way_past():
    """``if step % ACCUM != ACCUM - 1:`` reads the loop's counter and constants: every rank
    takes it alike in one pass, so it cannot make one rank post fewer."""
    from moe_hang.analysis.source import alike_in_a_pass

    assert alike_in_a_pass("step % ACCUM != ACCUM - 1", {"step"})
    assert not alike_in_a_pass("not torch.isfinite(loss)", {"step"})
    assert not alike_in_a_pass("micro is None", {"step"})
