"""How far round a loop each rank is, from what its recorder holds; and the other corpus
shapes of the model's last pass (docs/DESIGN.md §8), each both ways round.

A module-level loop has no counter py-spy can show. Two ranks at two of its lines are one
iteration apart or a lap; the latest seq each posted from each line of the loop says which
(the later rank alone posted from the lines up to its own in this iteration; a lap on, the
earlier one alone from the rest).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from conftest import captured

from moe_hang.analysis.program import Program
from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.calls import P2PCall
from moe_hang.evidence.flight_recorder import Collective, FRDump, PgStatus
from moe_hang.evidence.model import Evidence, RankEvidence, SizeAbort
from moe_hang.evidence.stacks import Frame, ThreadStack
from moe_hang.evidence.vocab import JobState

TORCH = "/x/site-packages/torch/distributed/distributed_c10d.py"
# every step the receiver takes a tensor from the sender, then both all-reduce; at step 2
# the sender has nothing to send and goes on to the all-reduce
P2P_JOB = """import torch.distributed as dist
rank = dist.get_rank()

for step in range(4):
    x = make(step)
    if rank == SENDER and step != 2:
        dist.send(x, RECEIVER)
    elif rank == RECEIVER:
        dist.recv(x, SENDER)  # line 9
    dist.all_reduce(x)  # line 10
"""


def _ar(job: Path, seq: int, done: bool, frames: bool = True) -> Collective:
    return Collective(pg="0", seq=seq, op="all_reduce", pg_desc="default_pg",
                      input_sizes=[[4, 8]], dtypes=["Float"], record_id=seq,
                      time_created_ns=seq, completed=done,
                      frames=[Frame(TORCH, 3, "all_reduce"), Frame(str(job), 10, "<module>")]
                      if frames else [])


def _p2p_rank(r: int, job: Path, waiting_in_recv: bool, peer: int,
              frames: bool = True) -> RankEvidence:
    n = 2 if waiting_in_recv else 3
    entries = [_ar(job, s, done=s < 3, frames=frames) for s in range(1, n + 1)]
    fr = FRDump(entries=entries, pg_status={"0": PgStatus(enqueued=n, completed=2)})
    if waiting_in_recv:
        stack = [Frame(TORCH, 7, "recv"), Frame(str(job), 9, "<module>")]
        p2p = P2PCall("recv", peer)
    else:
        stack = [Frame(TORCH, 3, "all_reduce"), Frame(str(job), 10, "<module>")]
        p2p = None
    return RankEvidence(rank=r, alive=True, progressed=False, fr=fr,
                        threads=[ThreadStack("MainThread", stack, is_main=True, p2p=p2p)])


@pytest.mark.parametrize("sender", [0, 1])
def test_the_recorder_says_both_are_in_one_iteration_the_sender_skipped_its_send(
        tmp_path, sender):
    """The receiver waits in recv (line 9; gloo's recorder keeps no p2p entry); the sender in
    its third all-reduce (line 10), the receiver's last from there its second: one
    iteration, and the sender went past the send it owed."""
    job = tmp_path / "p2p.py"
    job.write_text(P2P_JOB)
    receiver = 1 - sender
    ev = Evidence(ranks={sender: _p2p_rank(sender, job, False, receiver),
                         receiver: _p2p_rank(receiver, job, True, sender)},
                  world_size=2, job=JobState.STALLED)
    d = diagnose(captured(ev))
    assert (d.culprit_ranks, d.culprit_basis) == ([sender], "program_order"), d.summary
    assert "send" in d.fix


def test_without_frames_in_the_recorder_the_lap_is_not_known(tmp_path):
    """The same, from recorders that kept no frames (a plain job's, before its capture): the
    two lines are one iteration apart or a lap, and nothing says which."""
    job = tmp_path / "p2p.py"
    job.write_text(P2P_JOB)
    ev = Evidence(ranks={1: _p2p_rank(1, job, False, 0, frames=False),
                         0: _p2p_rank(0, job, True, 1, frames=False)},
                  world_size=2, job=JobState.STALLED)
    d = diagnose(captured(ev))
    assert d.culprit_ranks == [0, 1], d.summary


# every step the ranks all-gather their metrics, then meet at a barrier; one rank skips the
# all-gather once (a branch that leaves it out)
GATHER_JOB = """import torch.distributed as dist
rank = dist.get_rank()

for step in range(4):
    if not (rank == CULPRIT and step == 2):
        dist.all_gather_into_tensor(out, metrics)  # line 6
    dist.barrier()  # line 7
"""


@pytest.mark.parametrize("culprit", [0, 1])
def test_stacks_alone_the_rank_at_the_unconditional_collective_was_left_out(tmp_path,
                                                                            culprit):
    """No recorder, no counter: the lines tie as one iteration or a lap. The all-gather
    runs under a branch that leaves ranks out, the barrier under none: the rank in the
    barrier is the one left out."""
    job = tmp_path / "gather.py"
    job.write_text(GATHER_JOB)

    def rank(r: int, in_barrier: bool) -> RankEvidence:
        op, line = ("barrier", 7) if in_barrier else ("all_gather_into_tensor", 6)
        frames = [Frame(TORCH, 5, op), Frame(str(job), line, "<module>")]
        return RankEvidence(rank=r, alive=True, progressed=False,
                            threads=[ThreadStack("MainThread", frames, is_main=True)])

    ev = Evidence(ranks={culprit: rank(culprit, True), 1 - culprit: rank(1 - culprit, False)},
                  world_size=2, job=JobState.STALLED)
    d = diagnose(captured(ev))
    assert (d.culprit_ranks, d.culprit_basis) == ([culprit], "source"), d.summary


def _c(seq: int, op: str, sizes: list[list[int]], frames: list[Frame]) -> Collective:
    return Collective(pg="0", seq=seq, op=op, input_sizes=sizes, dtypes=["Float"],
                      record_id=seq, time_created_ns=seq, completed=True, frames=frames)


def test_a_path_seen_followed_once_leaves_it_to_the_shapes_every_rank_saw():
    """One rank's recorder kept frames, the other's not: the path (gather -> backward
    all-reduce) was seen followed once, by one rank; the shapes (all-gather 4x8 ->
    all-reduce 8x8) by both. What never followed the gather is said by the shapes."""
    job = "/job/train.py"
    g, b = [Frame(job, 19, "forward")], [Frame(job, 25, "backward")]
    with_frames = [_c(1, "all_gather", [[4, 8]], g), _c(2, "all_reduce", [[8, 8]], b),
                   _c(3, "all_reduce", [[1]], [Frame(job, 40, "<module>")]),
                   _c(4, "all_gather", [[4, 8]], g)]
    bare = [_c(c.seq, c.op, c.input_sizes, []) for c in with_frames]
    p = Program()
    for run in (with_frames, bare):
        p.learn(run)
    loss = _c(5, "all_reduce", [[1]], [Frame(job, 40, "<module>")])
    assert p.follows(with_frames[3], loss) is False
    assert p.follows(with_frames[3], _c(5, "all_reduce", [[8, 8]], b)) is True


def test_of_two_runs_as_long_the_one_with_paths_is_kept_whichever_rank_comes_first():
    job = "/job/train.py"
    framed = [_c(s, op, [[8]], [Frame(job, 10 + s % 2, "<module>")])
              for s, op in enumerate(["all_reduce", "barrier"] * 3, start=1)]
    bare = [_c(c.seq, c.op, c.input_sizes, []) for c in framed]
    for runs in ((framed, bare), (bare, framed)):
        p = Program()
        for run in runs:
            p.learn_period(run)
        assert all(c.frames for c in p.runs["0"])


PG_TIMEOUT_JOB = """import torch.distributed as dist
rank = dist.get_rank()
experts = dist.new_group()

for step in range(4):
    if not (rank == SKIPPER and step == 2):
        dist.all_reduce(grad)  # line 7
    dist.all_gather_into_tensor(out, part, group=experts)  # line 8
"""


@pytest.mark.parametrize("skipper", [0, 2])
def test_ranks_a_timeout_ended_in_the_collective_the_skipper_owed_are_not_culprits(
        tmp_path, skipper):
    """A 5 s process-group timeout: the skipper is in the expert all-gather, the others in
    the all-reduce it skipped, until the timeout raised in every rank. The others are absent
    from the all-gather because they were held in the all-reduce: one culprit."""
    job = tmp_path / "timeout.py"
    job.write_text(PG_TIMEOUT_JOB)

    def c(pg: str, seq: int, op: str, line: int, done: bool) -> Collective:
        return Collective(pg=pg, seq=seq, op=op, pg_desc="default_pg" if pg == "0" else "",
                          input_sizes=[[16]] if pg == "0" else [[4]], dtypes=["Float"],
                          record_id=2 * seq + (pg == "1"), time_created_ns=2 * seq,
                          completed=done)  # a plain job's recorder: no frames

    def rank(r: int) -> RankEvidence:
        entries = []
        for seq in (1, 2):
            entries += [c("0", seq, "all_reduce", 7, True), c("1", seq, "all_gather", 8, True)]
        if r == skipper:
            entries.append(c("1", 3, "all_gather", 8, False))
            status = {"0": PgStatus(2, 2), "1": PgStatus(3, 2)}
        else:
            entries.append(c("0", 3, "all_reduce", 7, False))
            status = {"0": PgStatus(3, 2), "1": PgStatus(2, 2)}
        return RankEvidence(rank=r, alive=False, exit_code=1 if r != skipper else -15,
                            fr=FRDump(entries=entries, pg_status=status))

    ev = Evidence(ranks={r: rank(r) for r in range(3)}, world_size=3, job=JobState.FAILED)
    d = diagnose(captured(ev))
    assert d.culprit_ranks == [skipper], d.summary


DDP_UNEVEN_JOB = """import torch.distributed as dist
rank = dist.get_rank()

for xb in batches[rank]:  # one fewer on SHORT
    loss = model(xb).sum()
    dist.all_reduce(grads)  # line 6
val = loss.detach()
dist.all_reduce(val)  # line 8
"""


@pytest.mark.parametrize("short", [0, 1])
def test_two_lines_that_met_at_one_seq_are_two_collectives_not_two_shapes(tmp_path, short):
    """The short rank left the loop and all-reduces its validation loss (1 element) where
    the other all-reduces its gradients (1153): gloo aborts the short rank (more bytes than
    it expected). The sizes differ because the collectives do: padding would not fix it."""
    job = tmp_path / "uneven.py"
    job.write_text(DDP_UNEVEN_JOB)
    grads = [Frame(TORCH, 3, "all_reduce"), Frame(str(job), 6, "<module>")]
    val = [Frame(TORCH, 3, "all_reduce"), Frame(str(job), 8, "<module>")]

    def ar(seq: int, size: int, frames: list[Frame], done: bool) -> Collective:
        return Collective(pg="0", seq=seq, op="all_reduce", pg_desc="default_pg",
                          input_sizes=[[size]], dtypes=["Float"], record_id=seq,
                          time_created_ns=seq, completed=done, frames=frames,
                          source="posted_log" if frames else "flight_recorder")

    other = 1 - short
    ranks = {
        # gloo let the survivor through (it received less than it expected); it failed on
        other: RankEvidence(rank=other, alive=False, exit_code=1,
                            fr=FRDump(entries=[ar(s, 1153, grads, True) for s in range(1, 6)],
                                      pg_status={"0": PgStatus(5, 5)})),
        # the aborted rank's posted log (frames taken at its abort)
        short: RankEvidence(
            rank=short, alive=False, exit_code=-signal.SIGABRT,
            posted_log=[*(ar(s, 1153, grads, True) for s in range(1, 5)),
                        ar(5, 1, val, False)],
            log_status={"0": PgStatus(5, 4)},
            fatal=("Fatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call "
                   f'first):\n  File "{TORCH}", line 3 in all_reduce\n'
                   f'  File "{job}", line 8 in <module>\n'))}
    d = diagnose(captured(Evidence(ranks=ranks, world_size=2, job=JobState.FAILED,
                                   size_abort=SizeAbort(received=1153 * 4, expected=4))))
    assert d.culprit_ranks == [short], d.summary
    assert "left the loop" in d.fix and "pad" not in d.fix, d.fix


def _summary_of_a_rank_gone_past(moved: int, now: tuple[str, str, int], now_line: int,
                                 other_line: int) -> str:
    """The summary of a size mismatch at seq 3 of group 1: ``moved`` (5 elements) has no
    line for it and is now in ``now`` (op, group, seq) at ``now_line``; the other (3
    elements) is still in it at ``other_line``."""
    from moe_hang.analysis.diagnosis import (
        Divergence,
        MismatchKind,
        RankCollective,
        RankReport,
    )
    from moe_hang.analysis.explain import desync_summary

    job = "/job/train.py"
    other = 1 - moved
    div = Divergence("1", 3, MismatchKind.SIZE, members=[0, 1], per_rank={
        moved: RankCollective("all_gather", "1", 3, [[5]]),
        other: RankCollective("all_gather", "1", 3, [[3]],
                              callsite=Frame(job, other_line, "<module>"))})
    op, pg, seq = now
    reports = {
        moved: RankReport(moved, collective=RankCollective(op, pg, seq, [[1]]),
                          callsite=Frame(job, now_line, "<module>")),
        other: RankReport(other, collective=div.per_rank[other],
                          callsite=Frame(job, other_line, "<module>"))}
    return desync_summary(div, reports, [moved], {})


@pytest.mark.parametrize("past", [0, 1])
def test_a_rank_past_the_divergence_is_not_said_to_have_posted_it_where_it_is_now(past):
    """gloo let one rank through a mismatched all-gather (it received less than it
    expected); its recorder kept no frames and its stack is at the next collective's line.
    That line is not where it posted the all-gather: the summary does not say so."""
    text = _summary_of_a_rank_gone_past(past, ("broadcast", "0", 6), 58, 56)
    assert "train.py:58" not in text, text


@pytest.mark.parametrize("extra", [0, 1])
def test_a_rank_whose_line_is_unknown_is_not_given_the_others_line(extra):
    """One rank's extra all-gather (5 elements, from a helper) paired with the other's
    metrics all-gather (3, line 63); the extra's recorder kept no frames, and the rank is now
    in the next all-gather at line 63: nothing says it posted seq 3 there."""
    text = _summary_of_a_rank_gone_past(extra, ("all_gather", "1", 4), 63, 63)
    assert f"rank {extra} all_gather(5) at" not in text, text
    # the line is the other rank's own, not one for both
    assert f"rank {1 - extra} all_gather(3) at " in text and text.count("train.py:63") == 1, text


@pytest.mark.parametrize("extra", [0, 1])
def test_an_extra_of_unknown_line_gets_both_advices_and_no_line(tmp_path, extra):
    """The same through the whole analysis: gloo aborted the other rank (it received more
    than it expected); the extra's rank got through, its recorder without frames, and died
    in the next all-gather at line 63."""
    job = tmp_path / "pipe.py"
    job.write_text("\n" * 70)
    at63 = [Frame(TORCH, 3, "all_gather_into_tensor"), Frame(str(job), 63, "<module>")]

    def ag(seq: int, n: int, frames: list[Frame], done: bool, source: str) -> Collective:
        return Collective(pg="1", seq=seq, op="all_gather", input_sizes=[[n]], dtypes=["Float"],
                          record_id=seq, time_created_ns=seq, completed=done, frames=frames,
                          source=source)

    other = 1 - extra
    ranks = {
        extra: RankEvidence(
            rank=extra, alive=False, exit_code=1,
            fr=FRDump(entries=[ag(1, 3, [], True, "flight_recorder"),
                               ag(2, 3, [], True, "flight_recorder"),
                               ag(3, 5, [], True, "flight_recorder"),
                               ag(4, 3, [], False, "flight_recorder")],
                      pg_status={"1": PgStatus(4, 3)}),
            threads=[ThreadStack("MainThread", at63, is_main=True)]),
        other: RankEvidence(
            rank=other, alive=False, exit_code=-signal.SIGABRT,
            posted_log=[ag(1, 3, at63, True, "posted_log"), ag(2, 3, at63, True, "posted_log"),
                        ag(3, 3, at63, False, "posted_log")],
            log_status={"1": PgStatus(3, 2)},
            fatal=("Fatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call "
                   f'first):\n  File "{TORCH}", line 3 in all_gather_into_tensor\n'
                   f'  File "{job}", line 63 in <module>\n'))}
    d = diagnose(captured(Evidence(ranks=ranks, world_size=2, job=JobState.FAILED,
                                   size_abort=SizeAbort(received=5 * 2 * 4, expected=3 * 2 * 4))))
    fd = d.first_divergence
    assert fd is not None and fd.seq == 3, d.summary
    mine = fd.per_rank.get(extra)
    assert mine is not None and mine.callsite is None, mine  # not line 63: it went past it
    assert d.culprit_ranks == [extra], d.summary
    assert "pad to a common size" not in d.fix and "another line" in d.fix, d.fix


def test_a_count_of_one_against_one_says_nothing():
    """The majority rung abstains on a tie: one rank against one names neither (before, it
    said no to the reading it was asked first, and another rung's silence let the other
    reading through — a two-node metrics thread's extra blamed the rank without it)."""
    from moe_hang.analysis.ladder import Edit, Reading, majority

    for edit in (Edit.EXTRA, Edit.SKIP, Edit.CHANGE):
        assert majority(Reading((0,), (1,), edit), None) is None  # type: ignore[arg-type]
    assert majority(Reading((0,), (1, 2), Edit.EXTRA), None) is True  # type: ignore[arg-type]
    assert majority(Reading((0, 1), (2,), Edit.EXTRA), None) is False  # type: ignore[arg-type]


@pytest.mark.parametrize("name, quiet", [("metrics_gather_skip_1", 1),
                                         ("metrics_gather_skip_0", 0)])
def test_a_lone_vote_from_a_line_a_branch_may_skip_decides_nothing(fixtures, name, quiet):
    """A module-level loop posts its gradient all-reduces (line 21) every step and an
    ``all_gather_object`` of the metrics (line 28) under ``if step % 4 == 3 and metrics:``.
    One rank had no metrics at step 7 and skipped the gather: it waits in step 8's
    all-reduce at the earlier line. The only vote the recorders give on the lap is line
    28's — the skipped line itself — so it decides nothing; the tentative program (one
    4-step period seen, begun again) expects the gather there. Was: the rank that posted
    the gather blamed, "left the loop", both roles. Recorded under ``moe-hang watch``
    (``metrics_gather_skip_jobs/``, a new user's trial)."""
    from moe_hang.evidence.load import load_capture

    d = diagnose(load_capture(fixtures / name)).to_dict()
    assert (d["verdict"], d["culprit_ranks"]) == ("desync", [quiet]), d["summary"]
    assert "`if step % 4 == 3 and metrics:`" in d["fix"], d["fix"]
    assert f"false on rank {quiet}" in d["fix"], d["fix"]
