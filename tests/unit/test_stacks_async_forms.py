"""Every rule that can fire on stacks alone, on the NCCL form too (issue 28, item 3): the
ranks post with ``async_op=True`` and block later at a wait of their own line
(``work.wait()``, ``torch.cuda.synchronize()``), and each may run a spinning helper thread
(on CPU in every sample, as a CUDA host thread spin-waits on a hung kernel). Each case runs
mirrored: the ranks' roles swap, and the culprit with them.

Stacks alone is what ``moe-hang diagnose PID`` sees without the probe and without Flight
Recorder dumps: each rank's py-spy stack, whether it moved across the window, its counters,
which ranks have no process, the job's source (and on a job over several nodes, which ranks
no watcher answered for); watch sampling a job without its probe sees the same (``sampled``,
and ``held`` once --hang-after passes). The rules that can fire on that, read from
``rules.RULES`` and the facts they test:

- ``stack_desync``, ``outside``, ``straggler``, ``moving``, ``unseen``, ``all_in_one``,
  ``inconclusive``: the stacks, movement and counters;
- ``killed``: a rank with no process (diagnose marks it ``alive=False``, no exit code);
- ``unreached``: ranks of other nodes nobody answered for;
- ``held``: watch by sampling, past --hang-after, over an uncertain rule below it;
- ``cycle``: only from point-to-point edges py-spy's ``--locals`` names (``stack.p2p``).
  Not on the async form: a rank at ``req.wait()`` of an ``irecv`` has no c10d frame, so no
  peer (``waitfor._p2p_of`` needs ``stack.p2p``), and ``isend``/``irecv`` are not
  ``source_calls.COLLECTIVE_CALLS``, so its wait's op is "unknown": no test here.

Every other rule needs what stacks do not give: a recorder's or the probe's records
(``desync``, ``p2p``, ``dumps_completed``; ``transport`` also needs NCCL named by one, or
RAS), an exception, an exit code or the probe's exit beat (``root_cause``, ``size_abort``,
``left_early``, ``finishing``, ``monitored_barrier``, ``timed_out``; ``consequences`` and
``failed_elsewhere`` need a failed rank, and on stacks alone that is one with no process,
which ``killed`` takes first), the launcher's exit (``launcher_died``), a completed job
(``finished``) or NCCL RAS reports (``ras_*``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import captured
from test_async_waits import JOB, TORCH, _job, _rank

from moe_hang.analysis.diagnosis import Diagnosis, MismatchKind, RankReport
from moe_hang.analysis.rules import diagnose
from moe_hang.capture.window import progressed
from moe_hang.evidence.activity import Activity
from moe_hang.evidence.model import Evidence, RankEvidence, Unreached
from moe_hang.evidence.stacks import Frame, ThreadStack, parse_pyspy
from moe_hang.evidence.vocab import JobState

# JOB (tests/unit/test_async_waits.py): line 5 posts the step's all-reduce async (not on
# rank DROP at step 2), line 6 computes, line 7 waits on the handle, line 8 is the barrier
POST, COMPUTE, WAIT, BARRIER = 5, 6, 7, 8
THREADING = "/usr/lib/python3.11/threading.py"
LOADER = "/job/loader.py"
HELD = "no progress on any rank for 300 s (--hang-after)"
# diagnose's counters of a gloo rank blocked for the whole window (analysis/activity.py)
STUCK = Activity(window_s=1.0, wakeups=8, syscalls=0, io_bytes=0, attaches=4,
                 backends=("gloo",))

# JOB with NCCL's other way of waiting: a synchronize, whose line names no post
SYNC_JOB = """import torch
import torch.distributed as dist
rank = dist.get_rank()
for step in range(4):
    if not (rank == DROP and step == 2):
        dist.all_reduce(g, async_op=True)
    h = compute(h)
    torch.cuda.synchronize()
dist.barrier()
"""
SYNC_WAIT, SYNC_BARRIER = 8, 9

# both sides wait at their own lines: the odd rank posted an all-gather of its own (line 8)
# and waits on it (9); the other waits on the next step's all-reduce (posted 4, waited 6)
BOTH_JOB = """import torch.distributed as dist
rank = dist.get_rank()
for step in range(4):
    work = dist.all_reduce(g, async_op=True)
    h = compute(h)
    work.wait()
    if rank == ODD and step == 2:
        gathered = dist.all_gather(out, h, async_op=True)
        gathered.wait()
dist.barrier()
"""


def _write(tmp_path: Path, text: str) -> str:
    job = tmp_path / "train.py"
    job.write_text(text)
    return str(job)


def _spinning(ev: RankEvidence) -> RankEvidence:
    """The rank with a helper thread on CPU in every sample, as a CUDA host thread
    spin-waits on a hung kernel (what the project's CPU jobs run to simulate one)."""
    assert ev.threads is not None
    ev.threads.append(ThreadStack("cuda-spin", [
        Frame("/job/spin.py", 12, "spin"), Frame(THREADING, 1010, "run"),
        Frame(THREADING, 1073, "_bootstrap_inner"), Frame(THREADING, 1030, "_bootstrap")],
        thread_id="140200", active=True))
    return ev


def _form(ev: RankEvidence, spin: bool) -> RankEvidence:
    return _spinning(ev) if spin else ev


def _outside(r: int, job: str) -> RankEvidence:
    """Blocked off CPU outside any collective (a data loader's lock) at the compute line."""
    return RankEvidence(rank=r, alive=True, progressed=False, threads=[ThreadStack(
        "MainThread", [Frame(LOADER, 8, "next_batch"), Frame(job, COMPUTE, "<module>")],
        active=False, is_main=True)])


def _diag(*ranks: RankEvidence, job: JobState = JobState.RUNNING,
          world: int | None = None, **kw: object) -> Diagnosis:
    """What ``diagnose PID`` concludes (the job RUNNING), with the job's source read."""
    ev = Evidence(ranks={r.rank: r for r in ranks}, world_size=world or len(ranks), job=job,
                  **kw)  # type: ignore[arg-type]
    return diagnose(captured(ev))


def _report(d: Diagnosis, r: int) -> RankReport:
    rep = d.rank(r)
    assert rep is not None, r
    return rep


def _waits_on(d: Diagnosis, r: int, op: str, line: int) -> None:
    """Rank r is in collective ``op`` at ``line``: the post's, where the source names the
    collective its wait waits on; else the wait's own."""
    rep = _report(d, r)
    assert rep.state == "in_collective", (r, rep.state, d.summary)
    assert rep.collective is not None and rep.collective.op == op, (r, rep.collective)
    assert rep.callsite is not None and rep.callsite.line == line, (r, rep.callsite)


FORMS = [pytest.param(False, id="wait"), pytest.param(True, id="wait+spin")]


# ------------------------------------------------------------------------ stack_desync

@pytest.mark.parametrize("spin", FORMS)
@pytest.mark.parametrize("odd", [0, 1])
def test_stack_desync_both_ranks_waiting_at_their_own_lines(tmp_path, odd, spin):
    """Neither stack is in a collective call: the odd rank waits on the all-gather only it
    posted, the other on its all-reduce. Different ops can never pair; the branch only the
    odd rank takes posted the extra."""
    job = _write(tmp_path, BOTH_JOB)
    d = _diag(_form(_rank(odd, (job, 9, "<module>")), spin),
              _form(_rank(1 - odd, (job, 6, "<module>")), spin))
    assert (d.rule_id, d.verdict, d.culprit_ranks, d.culprit_basis) == (
        "stack_desync", "desync", [odd], "source"), d.summary
    _waits_on(d, odd, "all_gather", 8)
    _waits_on(d, 1 - odd, "all_reduce", 4)
    assert d.first_divergence is not None and d.first_divergence.kind == MismatchKind.OP


@pytest.mark.parametrize("spin", FORMS)
@pytest.mark.parametrize("drop", [0, 1])
def test_stack_desync_a_synchronize_past_an_unnamed_post(tmp_path, drop, spin):
    """The waiting rank is in ``torch.cuda.synchronize()``: the source names no post, so its
    op is unknown; the rank that dropped a post is in the barrier past the loop, which every
    iteration's synchronize runs before (the one-way case of test_async_waits, mirrored)."""
    job = _write(tmp_path, SYNC_JOB)
    d = _diag(_form(_rank(drop, (TORCH, 9, "barrier"), (job, SYNC_BARRIER, "<module>")), spin),
              _form(_rank(1 - drop, (job, SYNC_WAIT, "<module>")), spin))
    assert (d.rule_id, d.verdict, d.culprit_ranks, d.culprit_basis) == (
        "stack_desync", "desync", [drop], "program_order"), d.summary
    _waits_on(d, drop, "barrier", SYNC_BARRIER)
    _waits_on(d, 1 - drop, "unknown", SYNC_WAIT)  # no line invented for what it waits on


# ------------------------------------------------------------ outside, held, straggler

@pytest.mark.parametrize("spin", FORMS)
@pytest.mark.parametrize("sleeper", [0, 1])
def test_outside_a_rank_off_every_collective_while_the_other_waits_on_its_handle(
        tmp_path, sleeper, spin):
    """Only the rank at ``work.wait()`` is in a collective: the other, blocked in its data
    loader, is the one waited for (without the wait read as one, both are "outside")."""
    job = str(_job(tmp_path))
    d = _diag(_form(_outside(sleeper, job), spin), _form(_rank(1 - sleeper, (job, WAIT,
                                                                             "<module>")), spin))
    assert (d.rule_id, d.verdict, d.culprit_ranks, d.culprit_basis, d.certainty) == (
        "outside", "hang", [sleeper], "waited_for", "uncertain"), d.summary
    assert _report(d, sleeper).state == "idle"
    _waits_on(d, 1 - sleeper, "all_reduce", POST)


@pytest.mark.parametrize("spin", FORMS)
@pytest.mark.parametrize("sleeper", [0, 1])
def test_held_the_stall_outside_collectives_past_hang_after_is_a_hang(tmp_path, sleeper, spin):
    """Watch sampling a job without its probe: the same stall, lived with until
    --hang-after passed, is a hang naming the rank outside."""
    job = str(_job(tmp_path))
    d = _diag(_form(_outside(sleeper, job), spin),
              _form(_rank(1 - sleeper, (job, WAIT, "<module>")), spin),
              job=JobState.STALLED, sampled=True, held=HELD)
    assert (d.rule_id, d.verdict, d.culprit_ranks, d.culprit_basis) == (
        "held", "hang", [sleeper], "waited_for"), d.summary
    _waits_on(d, 1 - sleeper, "all_reduce", POST)


@pytest.mark.parametrize("spin", FORMS)
@pytest.mark.parametrize("slow", [0, 1])
def test_straggler_a_rank_computing_while_the_other_waits_on_its_handle(tmp_path, slow, spin):
    """The rank still computing is the straggler, the one at its wait is in the all-reduce
    (test_async_waits accepts healthy too: here the rule and the rank lines are pinned)."""
    job = str(_job(tmp_path))
    d = _diag(_form(_rank(slow, (job, COMPUTE, "<module>"), moving=True), spin),
              _form(_rank(1 - slow, (job, WAIT, "<module>")), spin))
    assert (d.rule_id, d.verdict, d.culprit_ranks, d.culprit_basis) == (
        "straggler", "straggler", [slow], "waited_for"), d.summary
    assert _report(d, slow).state == "computing"
    _waits_on(d, 1 - slow, "all_reduce", POST)


# --------------------------------------------------------------- killed, unreached

@pytest.mark.parametrize("spin", FORMS)
@pytest.mark.parametrize("gone", [0, 1])
def test_killed_a_rank_with_no_process_while_the_other_waits_on_its_handle(
        tmp_path, gone, spin):
    job = str(_job(tmp_path))
    missing = RankEvidence(rank=gone, alive=False,
                           notes=["no process found for this rank on this machine"])
    d = _diag(missing, _form(_rank(1 - gone, (job, WAIT, "<module>")), spin))
    assert (d.rule_id, d.verdict, d.culprit_ranks, d.culprit_basis) == (
        "killed", "rank_died", [gone], "exited"), d.summary
    _waits_on(d, 1 - gone, "all_reduce", POST)


@pytest.mark.parametrize("spin", FORMS)
@pytest.mark.parametrize("node", [0, 1])
def test_unreached_ranks_at_their_waits_wait_on_the_node_nobody_answered_for(
        tmp_path, node, spin):
    """A job over two nodes, diagnosed on one whose ranks are both at ``work.wait()``: they
    wait in a collective of the default group, whose other members nothing is known of."""
    job = str(_job(tmp_path))
    mine = [2 * node, 2 * node + 1]
    other = [r for r in range(4) if r not in mine]
    d = _diag(*(_form(_rank(r, (job, WAIT, "<module>")), spin) for r in mine), world=4,
              unreached=Unreached(other, local_world=2, hosts={str(1 - node): "vm-b"}))
    assert (d.rule_id, d.verdict, d.culprit_ranks) == ("unreached", "hang", []), d.summary
    for r in mine:
        _waits_on(d, r, "all_reduce", POST)
    assert all(_report(d, r).state == "unknown" for r in other)


# ------------------------------------------- moving, unseen, all_in_one, inconclusive

@pytest.mark.parametrize("spin", FORMS)
@pytest.mark.parametrize("at_wait", [0, 1])
def test_moving_a_rank_seen_at_its_wait_that_moved_is_not_waiting(tmp_path, at_wait, spin):
    """Both ranks moved between samples; one was at its wait's line in the last one."""
    job = str(_job(tmp_path))
    d = _diag(_form(_rank(at_wait, (job, WAIT, "<module>"), moving=True), spin),
              _form(_rank(1 - at_wait, (job, COMPUTE, "<module>"), moving=True), spin))
    assert (d.rule_id, d.verdict, d.culprit_ranks) == ("moving", "healthy", []), d.summary
    assert _report(d, at_wait).state != "in_collective"


@pytest.mark.parametrize("spinner", [0, 1])
def test_unseen_every_rank_at_its_wait_and_nothing_says_whether_it_moves(tmp_path, spinner):
    """diagnose without counters: every rank sits at its wait in every sample, one with a
    spinning thread — nothing tells a collective that never completes from a new one each
    time, so no verdict either way."""
    job = str(_job(tmp_path))
    d = _diag(*(_form(_rank(r, (job, WAIT, "<module>")), r == spinner) for r in (0, 1)))
    assert (d.rule_id, d.verdict, d.culprit_ranks) == ("unseen", "inconclusive", []), \
        d.summary
    for r in (0, 1):
        _waits_on(d, r, "all_reduce", POST)


@pytest.mark.parametrize("form", ["work.wait", "synchronize"])
@pytest.mark.parametrize("spinner", [0, 1])
def test_all_in_one_every_rank_at_its_wait_and_its_counters_stuck(tmp_path, spinner, form):
    """diagnose on gloo, every rank's main thread at its wait, not woken all window: the
    counters say stuck — read only for ranks in a collective, so the wait must be one."""
    if form == "work.wait":
        job, line, op, posted = str(_job(tmp_path)), WAIT, "all_reduce", POST
    else:
        job, line, op, posted = _write(tmp_path, SYNC_JOB), SYNC_WAIT, "unknown", SYNC_WAIT
    ranks = []
    for r in (0, 1):
        ev = _form(_rank(r, (job, line, "<module>")), r == spinner)
        ev.activity = STUCK
        ranks.append(ev)
    d = _diag(*ranks)
    assert (d.rule_id, d.verdict, d.culprit_ranks) == ("all_in_one", "hang", []), d.summary
    for r in (0, 1):
        _waits_on(d, r, op, posted)


# the handle is assigned in two exclusive branches: on the odd rank at step 2 from an
# all-gather (line 5), else from an all-reduce (line 7); every rank waits at line 9
BRANCHES_JOB = """import torch.distributed as dist
rank = dist.get_rank()
for step in range(4):
    if rank == ODD and step == 2:
        work = dist.all_gather(out, g, async_op=True)
    else:
        work = dist.all_reduce(g, async_op=True)
    h = compute(h)
    work.wait()
dist.barrier()
"""


@pytest.mark.parametrize("odd", [0, 1])
def test_all_in_one_a_handle_two_branches_assign_names_no_post(tmp_path, odd):
    """Both ranks at ``work.wait()`` (same stacks), their counters stuck: which collective
    each waits on, the source cannot say (the odd rank's all-gather, or an all-reduce), so
    no rank's line may be one post's — "the verdict must not invent a line for it" (the
    corpus' async_sync_helper_attach)."""
    job = _write(tmp_path, BRANCHES_JOB.replace("ODD", str(odd)))
    ranks = []
    for r in (0, 1):
        ev = _rank(r, (job, 9, "<module>"))
        ev.activity = STUCK
        ranks.append(ev)
    d = _diag(*ranks)
    assert (d.rule_id, d.verdict, d.culprit_ranks) == ("all_in_one", "hang", []), d.summary
    for r in (0, 1):
        _waits_on(d, r, "unknown", 9)


@pytest.mark.parametrize("spin", FORMS)
@pytest.mark.parametrize("unreadable", [0, 1])
def test_inconclusive_one_stack_unreadable_the_other_at_its_wait(tmp_path, unreadable, spin):
    job = str(_job(tmp_path))
    d = _diag(RankEvidence(rank=unreadable, alive=True, stack_error="py-spy: permission denied"),
              _form(_rank(1 - unreadable, (job, WAIT, "<module>")), spin))
    assert (d.rule_id, d.verdict, d.culprit_ranks) == ("inconclusive", "inconclusive", []), \
        d.summary
    assert _report(d, unreadable).state == "unknown"
    _waits_on(d, 1 - unreadable, "all_reduce", POST)


# ------------------------------------------------ what the capture measures of a spinner

def _pyspy(main: list[tuple[str, int, str]], spin: bool) -> list[dict[str, object]]:
    """One ``py-spy dump --json`` sample: the main thread off CPU at ``main`` (innermost
    first), and with ``spin`` a thread on CPU."""
    threads: list[dict[str, object]] = [{
        "thread_name": "MainThread", "thread_id": 1, "pid": 100, "os_thread_id": 100,
        "active": False, "frames": [{"filename": f, "line": n, "name": fn} for f, n, fn in main]}]
    if spin:
        threads.append({"thread_name": "cuda-spin", "thread_id": 2, "pid": 100,
                        "os_thread_id": 101, "active": True, "frames": [
                            {"filename": "/job/spin.py", "line": 12, "name": "spin"},
                            {"filename": THREADING, "line": 1010, "name": "run"}]})
    return threads


def _captured_rank(r: int, main: list[tuple[str, int, str]], spin: bool) -> RankEvidence:
    """The rank as diagnose's window records it: the same sample throughout (its main
    thread never moved), its process keeping a core busy where its helper spins."""
    sample = _pyspy(main, spin)
    moved = progressed(sample, sample, cpu_cores=1.0 if spin else 0.0)
    return RankEvidence(rank=r, alive=True, progressed=moved, threads=parse_pyspy(sample))


# (docs/DESIGN.md §9: in a collective, CPU is no sign of progress; a wait on collectives
# posted earlier is in them)


@pytest.mark.parametrize("drop", [0, 1])
def test_a_spinning_thread_keeps_the_rank_that_dropped_a_post_named(tmp_path, drop):
    """As in test_async_waits, and the waiting rank's helper spins: its spin is no progress,
    so the rank past the loop is still the one named (the window read the spin as progress:
    a straggler, the rank at its wait named)."""
    job = str(_job(tmp_path))
    d = _diag(_captured_rank(drop, [(TORCH, 9, "barrier"), (job, BARRIER, "<module>")], True),
              _captured_rank(1 - drop, [(job, WAIT, "<module>")], True))
    assert (d.rule_id, d.verdict, d.culprit_ranks) == ("stack_desync", "desync", [drop]), \
        d.summary


@pytest.mark.parametrize("spinners", [(0,), (1,), (0, 1)], ids=["rank0", "rank1", "both"])
def test_a_spinning_thread_does_not_make_a_rank_at_its_wait_move(tmp_path, spinners):
    """Every rank at ``work.wait()`` in every sample, the spinners' processes busy: nothing
    moved, so no verdict either way (as without the spinners; the window read the spin as
    progress: a straggler named, and with both spinning a hung job called healthy)."""
    job = str(_job(tmp_path))
    d = _diag(*(_captured_rank(r, [(job, WAIT, "<module>")], r in spinners) for r in (0, 1)))
    assert (d.rule_id, d.verdict, d.culprit_ranks) == ("unseen", "inconclusive", []), \
        d.summary


def test_without_a_spinner_the_capture_sees_the_wait_unmoved(tmp_path):
    """The control for the two above: the same samples without the spinner read as unmoved,
    and the rank at its wait is in its all-reduce."""
    job = str(_job(tmp_path))
    d = _diag(*(_captured_rank(r, [(job, WAIT, "<module>")], False) for r in (0, 1)))
    assert (d.rule_id, d.verdict, d.culprit_ranks) == ("unseen", "inconclusive", []), \
        d.summary
    assert JOB.splitlines()[WAIT - 1].strip() == "work.wait()"
    for r in (0, 1):
        _waits_on(d, r, "all_reduce", POST)
