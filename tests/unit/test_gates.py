"""The data decision behind a skip (analysis/gates.py): the source's *gates* on the way to a
collective — the ``if`` it sits in, a guard before it that leaves early — and the advice that
names the one a culprit took between its last agreed collective and the one the others wait
in. Recorded on a job written outside the project (an expert-parallel layer that skips its
token exchange when nothing leaves the rank), both roles."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import captured, relocated

from moe_hang.analysis.rules import diagnose
from moe_hang.capture.source import read_facts
from moe_hang.evidence.load import load_capture
from moe_hang.evidence.source import Gate, LineFacts
from moe_hang.evidence.stacks import Frame
from moe_hang.report.words import ReportContext, next_words

JOB = """import torch.distributed as dist

def exchange(x, counts):
    dist.all_to_all_single(out, counts)
    if counts.sum() == 0:
        return x
    if x.numel() > 0:
        dist.all_to_all_single(out, x)
    else:
        dist.barrier()
    return out

def inner():
    if flag:
        return
    def nested():
        dist.all_reduce(t)
    return nested

for step in range(4):
    if step % 2:
        continue
    dist.all_reduce(t)
    if bad:
        raise ValueError("no")
    dist.broadcast(t, 0)
"""


def _facts(tmp_path: Path) -> dict[int, LineFacts]:
    job = tmp_path / "job.py"
    job.write_text(JOB)
    lines = (4, 8, 10, 17, 23, 26)
    return read_facts([Frame(str(job), n, "f") for n in lines]).files[str(job)]


def test_the_gates_on_the_way_to_a_line_nearest_first(tmp_path: Path) -> None:
    f = _facts(tmp_path)
    assert f[4].gates == ()
    assert f[8].gates == (Gate(7, 10, "x.numel() > 0", "if"),
                          Gate(5, 6, "counts.sum() == 0", "return"))
    assert f[10].gates == (Gate(7, 10, "x.numel() > 0", "else"),
                           Gate(5, 6, "counts.sum() == 0", "return"))
    # a nested function's gates stop at its own def: its caller's guards are another call's
    assert f[17].gates == ()
    assert f[23].gates == (Gate(21, 22, "step % 2", "continue"),)
    assert f[26].gates == (Gate(24, 25, "bad", "raise"), Gate(21, 22, "step % 2", "continue"))


TRY_JOB = """import torch.distributed as dist

for step in range(4):
    try:
        loss = model(x)
        loss.backward()
    except RuntimeError as e:
        if "memory" not in str(e):
            raise
        continue
    except ValueError:
        raise
    dist.all_reduce(t)
    try:
        dist.barrier()
    except Exception:
        pass
    dist.broadcast(t, 0)
"""


def test_a_handler_that_leaves_is_a_gate_of_its_body_and_what_follows(tmp_path: Path) -> None:
    """``except RuntimeError: ... continue`` (an out-of-memory batch skipped): where the body
    raises, neither the rest of it nor what follows runs in that pass. A handler that raises
    or falls through leaves no rank alive past it."""
    job = tmp_path / "job.py"
    job.write_text(TRY_JOB)
    f = read_facts([Frame(str(job), n, "f") for n in (6, 13, 15, 18)]).files[str(job)]
    oom = Gate(7, 10, "RuntimeError", "except-continue")
    assert f[6].gates == (oom,)
    assert f[13].gates == (oom,)
    assert f[15].gates == (oom,)
    assert f[18].gates == (oom,)


def test_gates_travel_with_the_capture_and_older_captures_have_none(tmp_path: Path) -> None:
    lf = _facts(tmp_path)[8]
    assert LineFacts.from_dict(lf.to_dict()) == lf
    old = lf.to_dict()
    del old["gates"]
    assert LineFacts.from_dict(old) == dataclasses.replace(lf, gates=())


def _fix(fixtures: Path, text: str) -> str:
    """``text`` with the recorded job's directory left out, as a report run there shows it."""
    return text.replace(str(fixtures / "gate_jobs") + "/", "")


def _run(fixtures: Path, tmp_path: Path, name: str) -> Path:
    return relocated(fixtures / name, tmp_path / "run", "/tmp/newuser3",
                     str(fixtures / "gate_jobs"))


@pytest.mark.parametrize("name, culprit, other", [("gate_return_1", 1, 0),
                                                  ("gate_return_0", 0, 1)])
def test_the_branch_a_culprit_took_past_the_exchange_is_named(fixtures, tmp_path, name,
                                                              culprit, other):
    """Two ranks; each step exchanges token counts (``all_to_all_single`` at :30), then skips
    the token exchange (:35) where nothing leaves the rank (``if remote == 0: return`` at
    :32). The culprit's router keeps every token local at step 3: it goes on to the
    gradient all-reduce (:55) while the other waits in the exchange."""
    d = diagnose(captured(load_capture(_run(fixtures, tmp_path, name))))
    assert (d.verdict, d.culprit_ranks) == ("desync", [culprit]), d.summary
    fix = _fix(fixtures, d.fix)
    assert fix.startswith(f"Rank {culprit} skipped the all_to_all at ep_train.py:35 "
                          "exchange: the one way past it the source shows is `if remote == 0: "
                          f"return` (ep_train.py:32), taken by rank {culprit}, not by rank "
                          f"{other} (counted from its last collective, at ep_train.py:30 "
                          "exchange)."), fix
    assert d.fix_site is not None and (d.fix_site.line, d.fix_site.function) == (32, "exchange")
    assert d.to_dict()["fix_site"]["line"] == 32
    got = next_words(d, ReportContext(command="watch", title="moe-hang watch"))
    assert got is not None and got[0].endswith("ep_train.py:32"), got
    assert got[1] == f"the branch rank {culprit} took"


@pytest.mark.parametrize("name, culprit, other", [("gate_continue_1", 1, 0),
                                                  ("gate_continue_0", 0, 1)])
def test_a_lap_cut_short_by_continue_is_named_where_gloo_aborted(fixtures, tmp_path, name,
                                                                 culprit, other):
    """Data parallel by hand: each step all-reduces its token count (:18), then ``if
    x.shape[0] == 0: continue`` (:19), then the gradients (:25). The culprit's batch is
    empty at step 5: its next token count meets the others' gradient and gloo aborts it
    (SIGABRT, 64 bytes where 4 were expected)."""
    d = diagnose(captured(load_capture(_run(fixtures, tmp_path, name))))
    assert (d.verdict, d.culprit_ranks) == ("desync", [culprit]), d.summary
    fix = _fix(fixtures, d.fix)
    assert fix.startswith(f"Rank {culprit} skipped the all_reduce at skip_step.py:25 "
                          "<module>: the one way past it the source shows is `if x.shape[0] == "
                          f"0: continue` (skip_step.py:19), taken by rank {culprit}, not by "
                          f"rank {other} (counted from its last collective, at skip_step.py:18 "
                          "<module>)."), fix
    assert d.fix_site is not None and d.fix_site.line == 19


def test_without_the_gates_the_advice_stays_what_the_collectives_say(fixtures, tmp_path):
    """A capture made before the source stored gates: no branch is named, nothing else
    changes."""
    ev = load_capture(_run(fixtures, tmp_path, "gate_return_1"))
    assert ev.source is not None
    for lines in ev.source.files.values():
        for n, lf in lines.items():
            lines[n] = dataclasses.replace(lf, gates=())
    d = diagnose(ev)
    assert (d.verdict, d.culprit_ranks, d.fix_site) == ("desync", [1], None)
    assert _fix(fixtures, d.fix).startswith(
        "Make rank 1 post the collective at ep_train.py:35 exchange too"), d.fix


def test_two_ways_past_are_both_named_and_no_line_is_chosen(fixtures, tmp_path):
    ev = load_capture(_run(fixtures, tmp_path, "gate_return_1"))
    assert ev.source is not None
    job = next(f for f in ev.source.files if f.endswith("ep_train.py"))
    lf = ev.source.files[job][35]
    ev.source.files[job][35] = dataclasses.replace(
        lf, gates=(Gate(34, 34, "x.numel() == 0", "return"), *lf.gates))
    d = diagnose(ev)
    assert d.fix_site is None
    fix = _fix(fixtures, d.fix)
    assert "the source shows 2 ways past it (`if x.numel() == 0: return` (ep_train.py:34); " \
        "`if remote == 0: return` (ep_train.py:32)), and rank 1 took one that rank 0 did " \
        "not (counted from its last collective, at ep_train.py:30 exchange)." in fix, fix


def test_an_if_around_it_is_passed_by_its_test_not_taken(fixtures, tmp_path):
    """``if remote > 0:`` around the exchange (the same job written the other way): the
    culprit's test was false."""
    ev = load_capture(_run(fixtures, tmp_path, "gate_return_1"))
    assert ev.source is not None
    job = next(f for f in ev.source.files if f.endswith("ep_train.py"))
    lf = ev.source.files[job][35]
    ev.source.files[job][35] = dataclasses.replace(lf, gates=(Gate(33, 36, "remote > 0", "if"),))
    d = diagnose(ev)
    fix = _fix(fixtures, d.fix)
    assert "the one way past it the source shows is `if remote > 0:` around it " \
        "(ep_train.py:33), false on rank 1, true on rank 0 (counted from" in fix, fix
    assert d.fix_site is not None and d.fix_site.line == 33
