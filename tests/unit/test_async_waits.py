"""Waiting on a collective posted earlier is waiting in a collective (issue 28): NCCL ranks
never block inside the collective call; they enqueue it and block later, in ``work.wait()``,
``.item()``, a synchronize. From stacks alone the main thread's innermost frame is then the
job's own line, and the source says that line waits. Each case both ways round."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import captured

from moe_hang.analysis.rules import diagnose
from moe_hang.capture.source import read_facts
from moe_hang.evidence.load import load_captures
from moe_hang.evidence.model import Evidence, RankEvidence
from moe_hang.evidence.stacks import Frame, ThreadStack
from moe_hang.evidence.vocab import JobState

TORCH = "/x/site-packages/torch/distributed/distributed_c10d.py"
# every step posts its all-reduce async, computes, and waits at the end of the step; one
# rank drops one post (step 2) and so reaches the final barrier one collective early
JOB = """import torch.distributed as dist
rank = dist.get_rank()
for step in range(4):
    if not (rank == DROP and step == 2):
        work = dist.all_reduce(g, async_op=True)
    h = compute(h)
    work.wait()
dist.barrier()
"""


def _job(tmp_path: Path) -> Path:
    job = tmp_path / "train.py"
    job.write_text(JOB)
    return job


def _rank(r: int, *frames: tuple[str, int, str], moving: bool = False) -> RankEvidence:
    return RankEvidence(rank=r, alive=True, progressed=moving,
                        threads=[ThreadStack("MainThread", [Frame(*f) for f in frames],
                                             active=moving, is_main=True)])


def _diagnose(*ranks: RankEvidence):  # type: ignore[no-untyped-def]
    ev = Evidence(ranks={r.rank: r for r in ranks}, world_size=len(ranks),
                  job=JobState.STALLED)
    return diagnose(captured(ev))


def test_the_capture_reads_which_lines_wait(tmp_path):
    f = tmp_path / "waits.py"
    f.write_text("work.wait()\n"
                 "torch.cuda.synchronize()\n"
                 "print(loss.item())\n"
                 "h = compute(h)\n"
                 "wait()\n")
    facts = read_facts([Frame(str(f), n, "<module>") for n in range(1, 6)])
    got = {n: lf.waits for n, lf in facts.files[str(f)].items()}
    assert got == {1: "wait", 2: "synchronize", 3: "item", 4: None, 5: None}
    # which call posted what a wait waits on: the last assignment of its name before it
    job = _job(tmp_path)
    linked = read_facts([Frame(str(job), 7, "<module>")])
    wait, post = linked.line(str(job), 7), linked.line(str(job), 5)
    assert wait is not None and wait.posted == (5, "all_reduce")
    assert post is not None and post.rank_condition is not None  # the posting line too
    # stored with the capture, and read back
    from moe_hang.evidence.source import SourceFacts
    again = SourceFacts.from_dict(facts.to_dict())
    assert again.line(str(f), 1) is not None and again.line(str(f), 1).waits == "wait"


@pytest.mark.parametrize("drop", [0, 1])
def test_a_rank_in_work_wait_is_in_a_collective_the_one_past_the_loop_is_named(
        tmp_path, drop):
    """Before: "rank 1 is outside any collective" and the rank in the wait was blamed."""
    job = _job(tmp_path)
    other = 1 - drop
    d = _diagnose(_rank(drop, (TORCH, 9, "barrier"), (str(job), 8, "<module>")),
                  _rank(other, (str(job), 7, "<module>")))
    assert (d.verdict, d.culprit_ranks) == ("desync", [drop]), d.summary
    # its line is where it posted what it waits on; the branch that left the culprit out
    assert f"Rank {other} waits at" in d.summary and "train.py:5" in d.summary, d.summary
    assert "`if not (rank == DROP and step == 2)`" in d.fix, d.fix


@pytest.mark.parametrize("slow", [0, 1])
def test_a_rank_computing_while_the_other_waits_on_its_handle_is_a_straggler(tmp_path, slow):
    job = _job(tmp_path)
    d = _diagnose(_rank(slow, (str(job), 6, "<module>"), moving=True),
                  _rank(1 - slow, (str(job), 7, "<module>")))
    assert d.verdict in ("straggler", "healthy"), d.summary
    assert d.culprit_ranks in ([], [slow]), d.summary


def test_every_rank_in_its_wait_is_said_as_such(tmp_path):
    job = _job(tmp_path)
    d = _diagnose(_rank(0, (str(job), 7, "<module>")), _rank(1, (str(job), 7, "<module>")))
    assert d.verdict == "hang" and d.culprit_ranks == [], d.summary
    assert "all_reduce" in d.summary and "unknown" not in d.summary


def test_a_wait_whose_post_the_source_does_not_show_is_said_as_such(tmp_path):
    """``works[-1].wait()``: the source does not say which call posted it."""
    job = tmp_path / "train.py"
    job.write_text(JOB.replace("        work = dist.all_reduce(g, async_op=True)",
                               "        works.append(dist.all_reduce(g, async_op=True))")
                   .replace("    work.wait()", "    works[-1].wait()"))
    d = _diagnose(_rank(0, (TORCH, 9, "barrier"), (str(job), 8, "<module>")),
                  _rank(1, (str(job), 7, "<module>")))
    assert d.verdict == "desync" and d.culprit_ranks == [0], d.summary
    assert "posted earlier" in d.summary and "unknown" not in d.summary


def test_a_rank_that_moved_past_its_wait_is_not_waiting(tmp_path):
    """Seen at the wait's line in one sample but moving: not held there."""
    job = _job(tmp_path)
    d = _diagnose(_rank(0, (TORCH, 9, "barrier"), (str(job), 8, "<module>")),
                  _rank(1, (str(job), 7, "<module>"), moving=True))
    assert d.verdict != "desync", d.summary


def test_which_post_a_wait_is_on_when_the_handle_is_assigned_more_than_once(tmp_path):
    """``h = None`` then ``if overlap: h = all_reduce(...)``: the initializer is no post, the
    wait is on the all-reduce; two exclusive branches that each post: the source cannot say
    which post. The sampling window asks only whether a line waits on a collective: a wait
    on a post (either branch's), or a device's synchronize (not a stream's)."""
    from moe_hang.capture.source import waits_on_collective

    f = tmp_path / "overlap.py"
    f.write_text("h = None\n"                                         # 1
                 "if overlap:\n"                                      # 2
                 "    h = dist.all_reduce(g, async_op=True)\n"        # 3
                 "y = compute(x)\n"                                   # 4
                 "if h is not None:\n"                                # 5
                 "    h.wait()\n"                                     # 6
                 "if odd:\n"                                          # 7
                 "    w = dist.all_gather(out, g, async_op=True)\n"   # 8
                 "else:\n"                                            # 9
                 "    w = dist.all_reduce(g, async_op=True)\n"        # 10
                 "w.wait()\n"                                         # 11
                 "torch.cuda.synchronize()\n"                         # 12
                 "stream.synchronize()\n"                             # 13
                 "done.wait()\n")                                     # 14
    facts = read_facts([Frame(str(f), n, "<module>") for n in (6, 11)])
    assert facts.line(str(f), 6).posted == (3, "all_reduce")  # type: ignore[union-attr]
    assert facts.line(str(f), 11).posted is None  # type: ignore[union-attr]
    assert [n for n in range(1, 15) if waits_on_collective(str(f), n)] == [6, 11, 12]


WAITS = """import threading
import torch
import torch.distributed as dist
done = threading.Event()
work = dist.all_reduce(g, async_op=True)
work.wait()
done.wait()
for w in pending:
    w.wait()
torch.cuda.synchronize()
torch.cuda.current_stream().synchronize()
print(loss.item())
"""


def test_whether_a_wait_is_on_collectives_is_one_fact_with_its_doubt(tmp_path):
    """One fact, read once, for the progress window and the analysis alike: True on a
    collective's handle or a device's synchronize; False on an Event or a stream; None
    where the source does not say (a handle taken from a list, a tensor's read-back)."""
    from moe_hang.capture.source import waits_on_collective
    from moe_hang.evidence.source import SourceFacts

    f = tmp_path / "waits.py"
    f.write_text(WAITS)
    facts = read_facts([Frame(str(f), n, "<module>") for n in (6, 7, 9, 10, 11, 12)])
    got = {n: lf.wait_on for n, lf in facts.files[str(f)].items() if lf.waits}
    assert got == {6: True, 7: False, 9: None, 10: True, 11: False, 12: None}
    again = SourceFacts.from_dict(facts.to_dict())
    assert {n: again.line(str(f), n).wait_on for n in got} == got  # type: ignore[union-attr]
    # a handle the source cannot name is not said to be no collective's
    g = tmp_path / "helpers.py"
    g.write_text("import torch.distributed as dist\n"
                 "h = reduce_async(x)\n"
                 "h.wait()\n"
                 "fut = dist.all_reduce(x, async_op=True).get_future()\n"
                 "fut.wait()\n"
                 "get_accelerator().synchronize()\n"
                 "ev.synchronize()\n")
    more = read_facts([Frame(str(g), n, "<module>") for n in (3, 5, 6, 7)])
    assert {n: lf.wait_on for n, lf in more.files[str(g)].items() if lf.waits} == {
        3: None, 5: None, 6: None, 7: None}
    # the window takes only what is sure: a healthy job's wait is never a stall's
    assert [waits_on_collective(str(f), n) for n in sorted(got)] == [
        True, False, False, True, False, False]


@pytest.mark.parametrize("waiter", [0, 1])
def test_a_rank_blocked_on_its_own_event_is_outside_every_collective(tmp_path, waiter):
    """A rank at ``done.wait()`` on a ``threading.Event`` the source shows: not in a
    collective (it waits on its own thread), so the rank in the all-reduce waits for it.
    Was: both "in a collective", op unknown."""
    job = tmp_path / "train.py"
    job.write_text(WAITS)
    d = _diagnose(_rank(waiter, (str(job), 7, "<module>")),
                  _rank(1 - waiter, (TORCH, 9, "all_reduce"), (str(job), 5, "<module>")))
    r = {x.rank: x for x in d.ranks}
    assert r[waiter].state != "in_collective", d.summary
    assert r[1 - waiter].state == "in_collective", d.summary
    assert d.culprit_ranks == [waiter], d.summary


LIST_JOB = """import torch.distributed as dist
for step in range(4):
    pending = []
    if not (rank == DROP and step == 2):
        pending.append(dist.all_reduce(ntok, async_op=True))
    pending.append(dist.all_reduce(acc, async_op=True))
    {before}pending.append(dist.all_gather_into_tensor(out, x, async_op=True))
    {after}for work in pending:
        work.wait()
dist.barrier()
"""


@pytest.mark.parametrize(("before", "after", "want"), [
    ("", "", (7, "all_gather_into_tensor")),
    # the last append under a branch the wait is outside of: the last one run is not known
    ("if step:\n        ", "", None),
    # a collective posted between the last append and the wait is the newest, not the append
    ("", "dist.barrier()\n    ", None),
    # a handle of something else in the list: which is waited on the source does not say
    ("pending.append(threading.Event())\n    ", "", None),
])
def test_a_wait_on_a_lists_handles_knows_the_last_collective_appended(tmp_path, before, after,
                                                                      want):
    f = tmp_path / "train.py"
    f.write_text(LIST_JOB.format(before=before, after=after))
    wait_line = next(n for n, s in enumerate(f.read_text().splitlines(), 1) if "work.wait()" in s)
    facts = read_facts([Frame(str(f), wait_line, "<module>")])
    lf = facts.line(str(f), wait_line)
    assert lf is not None and lf.waits == "wait" and lf.posted is None
    assert lf.appended_last == want
    if want is not None:  # stored with the capture, and read back
        back = type(facts).from_dict(facts.to_dict())
        assert back.line(str(f), wait_line).appended_last == want


def test_appends_in_a_hook_run_when_it_is_called_not_in_the_texts_order(tmp_path):
    f = tmp_path / "train.py"
    f.write_text("pending = []\n"
                 "def sync(p):\n"
                 "    pending.append(dist.all_reduce(p.grad, async_op=True))\n"
                 "for step in range(4):\n"
                 "    loss.backward()\n"
                 "    for w in pending:\n"
                 "        w.wait()\n")
    lf = read_facts([Frame(str(f), 7, "<module>")]).line(str(f), 7)
    assert lf is not None and lf.waits == "wait" and lf.appended_last is None


@pytest.mark.parametrize(("name", "skipper"), [("async_list_wait_0", 0),
                                             ("async_list_wait_4", 4)])
def test_a_skip_read_from_counts_without_call_sites_is_at_the_loops_branch(fixtures, name,
                                                                          skipper):
    """A 6-stage pipeline beside a busy neighbour under watch (fuzz seed 40271193 job 94,
    both roles): one rank skipped its async token all-reduce (46) once, the size-1
    all-reduces paired silently, and it sits in the final barrier (60) as the number the
    others wait in at their loss (57). No dump answered, so the recorders (the probe's
    periodic saves) carry no call sites; py-spy has the others at ``work.wait()`` (59) in
    ``for work in pending``.

    The others' line: each one's one pending all-reduce is its newest, so it is the last
    handle appended, the loss's (57; was 59). The skip: the rank left the loop for good, its
    barrier right after it, so in its last pass it posted the loss as one less; a rank behind
    by passes would be two less (each pass posts two on the world group up to 57). It
    posted fewer before 57, and the loop's one call on the group under a branch is 46 (was:
    the barrier against the loss at seq 15 and the generic order advice)."""
    from moe_hang.evidence.load import load_capture
    from moe_hang.report.words import rank_phrase
    diag = diagnose(load_capture(fixtures / name))
    d = diag.to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [skipper]), d["summary"]
    # the culprit's line on the first screen says which one it never posted: the line
    assert rank_phrase(diag, skipper).startswith("never posted all_reduce default_pg at "), \
        rank_phrase(diag, skipper)
    assert ":46 " in rank_phrase(diag, skipper), rank_phrase(diag, skipper)
    lines = {r["rank"]: r["callsite"]["line"] for r in d["ranks"]}
    assert lines == {r: 60 if r == skipper else 57 for r in range(6)}, lines
    assert "(a skip)" in d["summary"], d["summary"]
    div = d["first_divergence"]
    assert div["seq"] is None and div["per_rank"][str(skipper)] is None, div
    assert {c["callsite"]["line"] for r, c in div["per_rank"].items()
            if int(r) != skipper} == {46}, div
    assert "posted fewer collectives on default_pg" in d["fix"] and ":46" in d["fix"], d["fix"]




COMP_JOB = """import torch.distributed as dist
for step in range(4):
    {build}
    {between}for w in works:
        w.wait()
dist.barrier()
"""


@pytest.mark.parametrize(("build", "between", "want"), [
    ("works = [dist.all_reduce(g, async_op=True) for g in grads]", "", (3, "all_reduce")),
    # something else added to the list: which handle the wait is on the source does not say
    ("works = [dist.all_reduce(g, async_op=True) for g in grads]",
     "works.append(threading.Event())\n    ", None),
    # two branches build it from two calls: which one's handle is waited on is not known
    ("if step:\n        works = [dist.all_reduce(g, async_op=True) for g in grads]\n"
     "    else:\n        works = [dist.broadcast(g, 0, async_op=True) for g in grads]", "", None),
    # built empty, one call appended in a loop over the parameters: that call's line
    ("works = []\n    for g in grads:\n        works.append(dist.all_reduce(g, async_op=True))",
     "", (5, "all_reduce")),
    # a list of something else
    ("works = [threading.Event() for g in grads]", "", None),
])
def test_a_wait_on_a_list_one_collective_call_built_is_on_that_calls_line(tmp_path, build,
                                                                         between, want):
    """``works = [dist.all_reduce(g, async_op=True) for g in grads]``, then ``for w in
    works: w.wait()``: every handle was posted at the comprehension's line, whichever is
    waited on — the wait's post and a wait on collectives (the progress window's too)."""
    f = tmp_path / "train.py"
    f.write_text(COMP_JOB.format(build=build, between=between))
    wait_line = next(n for n, s in enumerate(f.read_text().splitlines(), 1) if "w.wait()" in s)
    lf = read_facts([Frame(str(f), wait_line, "<module>")]).line(str(f), wait_line)
    assert lf is not None and lf.waits == "wait"
    assert lf.posted == want
    assert lf.wait_on is (True if want is not None else None)


@pytest.mark.parametrize(("name", "skipper"), [("listcomp_wait_skip_1", 1),
                                             ("listcomp_wait_skip_0", 0)])
def test_ranks_waiting_on_a_lists_handles_are_at_the_comprehension_that_posted_them(
        fixtures, name, skipper):
    """A job written for the occasion (3 ranks, stacks alone, ``diagnose``): gradients
    all-reduced async by one list comprehension, waited in ``for w in works: w.wait()``; one
    rank's non-finite loss skips a batch (``continue``) and it ends in the final barrier while
    the others wait on their handles. Was: their op unknown, "which ones: their Flight
    Recorders", one sentence per rank."""
    d = diagnose(load_captures([fixtures / name]))
    assert (d.verdict, d.culprit_ranks) == ("desync", [skipper]), d.summary
    others = sorted({0, 1, 2} - {skipper})
    at = {r.rank: (r.collective.op if r.collective else None,
                   r.callsite.line if r.callsite else None) for r in d.ranks}
    assert at[skipper] == ("barrier", 33) and all(at[r] == ("all_reduce", 27) for r in others)
    ranks = f"Ranks {others[0]}, {others[1]}"
    assert f"{ranks} wait at nanskip.py:29 <module> on what they posted at nanskip.py:27" \
        in re.sub(r"\S*/", "", d.summary), d.summary
