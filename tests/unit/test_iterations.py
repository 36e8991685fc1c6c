"""Which iteration each rank is in, and what the program posts next when the history is
short: a rank that leaves a loop early (``return`` inside ``train_epoch``) sits at a *later*
line of the outer loop than the rank still inside it, and from lines alone that is a tie
with a lap (the other skipped the later line and went round). py-spy's locals of the job's
own loop counters (``epoch``) and, with a recorder, the agreed run's one step begun again
decide it; both ways round (the culprit must swap)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import captured

from moe_hang.analysis.program import Program
from moe_hang.analysis.rules import diagnose
from moe_hang.capture.pyspy import strip_locals
from moe_hang.evidence.flight_recorder import Collective, FRDump, PgStatus
from moe_hang.evidence.model import Evidence, RankEvidence
from moe_hang.evidence.stacks import Frame, ThreadStack, parse_pyspy
from moe_hang.evidence.vocab import JobState

TORCH = "/x/site-packages/torch/distributed/distributed_c10d.py"
JOB = """import torch.distributed as dist


def train_epoch(me, epoch):
    for step in range(4):
        if me == EARLY and epoch == 1 and step == 2:
            return
        dist.all_reduce(t)  # line 8


def loop(me):
    for epoch in range(3):
        train_epoch(me, epoch)  # line 13
        dist.barrier()  # line 14
"""


def _pyspy(job: Path, inside: bool, epoch: int, token: str = "s3cret") -> list[dict]:
    """py-spy dump --json --locals of one rank: inside train_epoch's all-reduce (line 8) or
    in the barrier (line 14), with locals the capture must drop (a string, a non-loop int)."""
    loop_frame = {"filename": str(job), "name": "loop", "line": 13 if inside else 14,
                  "locals": [{"name": "epoch", "repr": str(epoch)},
                             {"name": "me", "repr": "0"},
                             {"name": "token", "repr": repr(token)}]}
    frames = [{"filename": TORCH, "name": "all_reduce" if inside else "barrier", "line": 9}]
    if inside:
        frames.append({"filename": str(job), "name": "train_epoch", "line": 8,
                       "locals": [{"name": "step", "repr": "2"},
                                  {"name": "n_bytes", "repr": "4096"}]})
    frames += [loop_frame, {"filename": str(job), "name": "<module>", "line": 20}]
    return [{"thread_name": "MainThread", "thread_id": 1, "pid": 7, "os_thread_id": 7,
             "active": False, "frames": frames}]


def test_the_capture_keeps_only_the_loop_counters_of_the_jobs_own_frames(tmp_path):
    job = tmp_path / "train.py"
    job.write_text(JOB)
    kept = strip_locals(_pyspy(job, inside=True, epoch=1))
    names = {f["name"]: [v["name"] for v in f.get("locals", [])] for f in kept[0]["frames"]}
    # ``me`` is kept as it may be the rank (rankid's names); ``token`` never is
    assert names["loop"] == ["epoch"] and names["train_epoch"] == ["step"]
    assert "s3cret" not in repr(kept)
    threads = parse_pyspy(kept)
    assert threads[0].counters[Frame(str(job), 13, "loop")] == {"epoch": 1}


def _rank(r: int, job: Path, inside: bool, epoch: int) -> RankEvidence:
    threads = parse_pyspy(strip_locals(_pyspy(job, inside, epoch)))
    return RankEvidence(rank=r, alive=True, progressed=False, threads=threads)


def _periods(ops: list[str]) -> dict[str, int]:
    run = [_c(s, op) for s, op in enumerate(ops, start=1)]
    p = Program()
    p.learn(run)
    p.learn_period(run)
    return p.periods


def test_a_warm_up_of_two_steps_then_three_steps_gives_the_step():
    """DDP: the parameter broadcasts, the first backward's bucket, the bucket rebuild, then
    (bucket, bucket, loss) a step: the warm-up is two steps long, the steps after it three
    and a bit — the step is known. Was: no period (one step of warm-up only), and the rank
    that ran one more micro-batch was not the one named."""
    b, loss = "all_reduce", "all_gather"  # two collectives that differ, as bucket and loss
    warm = ["broadcast", "barrier", "broadcast", b, "barrier", "broadcast"]
    assert _periods([*warm, b, loss, b, b, loss, b, b, loss, b, b]) == {"0": 3}
    # a stretch no longer than what came before it is no step yet
    assert _periods([*warm, b, loss, b, b, loss, b]) == {}
    # four equal collectives that end one step of an FSDP job: no step of one or two
    assert _periods(["all_gather"] * 4 + ["reduce_scatter"] * 4) == {}


def _two_ranks(ops: list[tuple[str, int, int]], last: tuple[tuple[str, int, int], ...]
               ) -> Evidence:
    """Two ranks that agreed on ``ops`` (op, size, line) and then posted ``last[r]``."""
    torch_file = "/x/site-packages/torch/distributed/distributed_c10d.py"

    def rank(r: int) -> RankEvidence:
        entries = [Collective(pg="0", seq=s, op=op, input_sizes=[[n]], dtypes=["Float"],
                              record_id=s, time_created_ns=1000 * s, completed=True)
                   for s, (op, n, _line) in enumerate([*ops, last[r]], start=1)]
        entries[-1].completed = False
        fr = FRDump(entries=entries, pg_status={"0": PgStatus(enqueued=len(entries),
                                                              completed=len(entries) - 1)})
        op, _n, line = last[r]
        frames = [Frame(torch_file, 9, op), Frame("/nowhere/train.py", line, "loop")]
        return RankEvidence(rank=r, alive=True, progressed=False, fr=fr,
                            threads=[ThreadStack("MainThread", frames, is_main=True)])

    return Evidence(ranks={0: rank(0), 1: rank(1)}, world_size=2, job=JobState.STALLED)


@pytest.mark.parametrize("extra", [0, 1])
def test_a_loop_whose_count_changes_from_step_to_step_is_no_step(extra):
    """Two micro-batches at step 1, eleven (agreed) at step 2, then one rank a twelfth
    where the other posts the loss: eleven equal collectives after a warm-up are no step of
    one, and an MoE step whose expert loop ran (B, C) twice and then five times is no step
    of two — neither says which rank ran one more pass. Found by a review: the warm-up
    rule took them for steps and blamed the rank that left the loop, in either role."""
    bc, bar, b, loss = ("broadcast", 4, 5), ("barrier", 1, 6), ("all_reduce", 1089, 18), \
        ("all_reduce", 1, 21)
    ddp = [bc, bar, bc, b, bar, bc, b, b, loss] + [b] * 11
    last = (b, loss) if extra == 0 else (loss, b)
    d = diagnose(captured(_two_ranks(ddp, last)))
    assert (d.verdict, d.culprit_ranks, d.culprit_basis) == ("desync", [0, 1], "ambiguous")
    x, a, bb, c, dd = ("broadcast", 4, 3), ("all_reduce", 1, 10), ("all_gather", 64, 12), \
        ("reduce_scatter", 32, 13), ("all_reduce", 1089, 15)
    moe = [x, a, bb, c, bb, c, dd, a] + [bb, c] * 5
    last = (bb, dd) if extra == 0 else (dd, bb)
    d = diagnose(captured(_two_ranks(moe, last)))
    assert (d.verdict, d.culprit_ranks, d.culprit_basis) == ("desync", [0, 1], "ambiguous")


@pytest.mark.parametrize("early", [0, 1])
def test_stacks_alone_the_loop_counter_says_who_left_the_epoch_early(tmp_path, early):
    """One epoch: the rank in the barrier left train_epoch early. A lap apart (the barrier
    rank an epoch behind): the rank inside train_epoch skipped that barrier."""
    job = tmp_path / "train.py"
    job.write_text(JOB)
    other = 1 - early
    ev = Evidence(ranks={early: _rank(early, job, inside=False, epoch=1),
                         other: _rank(other, job, inside=True, epoch=1)},
                  world_size=2, job=JobState.STALLED)
    d = diagnose(captured(ev))
    assert (d.verdict, d.culprit_ranks, d.culprit_basis) == ("desync", [early],
                                                             "program_order"), d.summary
    ev = Evidence(ranks={early: _rank(early, job, inside=False, epoch=0),
                         other: _rank(other, job, inside=True, epoch=1)},
                  world_size=2, job=JobState.STALLED)
    d = diagnose(captured(ev))
    assert (d.verdict, d.culprit_ranks) == ("desync", [other]), d.summary


def test_stacks_alone_without_counters_the_tie_is_said(tmp_path):
    job = tmp_path / "train.py"
    job.write_text(JOB)

    def bare(r: int, inside: bool) -> RankEvidence:
        frames = [Frame(TORCH, 9, "all_reduce" if inside else "barrier")]
        if inside:
            frames.append(Frame(str(job), 8, "train_epoch"))
        frames.append(Frame(str(job), 13 if inside else 14, "loop"))
        return RankEvidence(rank=r, alive=True, progressed=False,
                            threads=[ThreadStack("MainThread", frames, is_main=True)])

    d = diagnose(captured(Evidence(ranks={0: bare(0, True), 1: bare(1, False)}, world_size=2,
                                   job=JobState.STALLED)))
    assert (d.verdict, d.culprit_ranks, d.culprit_basis) == ("desync", [0, 1], "ambiguous")


def _c(seq: int, op: str) -> Collective:
    return Collective(pg="0", seq=seq, op=op, input_sizes=[[8]], dtypes=["Float"],
                      record_id=seq, time_created_ns=1000 * seq)


def test_the_agreed_runs_one_step_begun_again_says_what_comes_next():
    """Four all-reduces and a barrier, then two all-reduces: one step and the start of the
    next — too short for a period (two whole steps), enough for a tentative one."""
    run = [_c(s, op) for s, op in enumerate(["all_reduce"] * 4 + ["barrier"]
                                            + ["all_reduce"] * 2, start=1)]
    p = Program()
    p.learn(run)
    p.learn_period(run)
    assert p.expected(_c(8, "barrier")) is None
    got = p.tentative(_c(8, "barrier"))
    assert got is not None and got.op == "all_reduce"
    assert p.tentative(_c(10, "x")) is not None and p.tentative(_c(10, "x")).op == "barrier"
    # a run that repeats nothing says nothing
    q = Program()
    q.learn_period([_c(1, "all_reduce"), _c(2, "barrier"), _c(3, "all_gather")])
    assert q.tentative(_c(4, "barrier")) is None


@pytest.mark.parametrize("early", [0, 1])
def test_with_a_recorder_the_short_history_names_the_rank_that_left_early(early):
    """Recorders without frames (a plain job), stacks without counters: the lines tie, the
    agreed run (AR×4, barrier, AR, AR) says seq 8 is an all-reduce: the barrier is early."""
    other = 1 - early
    ops = ["all_reduce"] * 4 + ["barrier"] + ["all_reduce"] * 2

    def rank(r: int, last: str) -> RankEvidence:
        entries = [_c(s, op) for s, op in enumerate([*ops, last], start=1)]
        for c in entries[:-1]:
            c.completed = True
        entries[-1].completed = False
        fr = FRDump(entries=entries, pg_status={"0": PgStatus(enqueued=8, completed=7)})
        frames = [Frame(TORCH, 9, last), Frame("/nowhere/train.py", 14 if last == "barrier"
                                               else 13, "loop")]
        return RankEvidence(rank=r, alive=True, progressed=False, fr=fr,
                            threads=[ThreadStack("MainThread", frames, is_main=True)])

    ev = Evidence(ranks={early: rank(early, "barrier"), other: rank(other, "all_reduce")},
                  world_size=2, job=JobState.STALLED)
    d = diagnose(captured(ev))
    assert (d.verdict, d.culprit_ranks, d.culprit_basis) == (
        "desync", [early], "program_order"), d.summary


def test_two_threads_post_independently_only_one_threads_order_is_learned():
    """A rank's main thread posts all-reduces on the default group while a metrics thread
    posts on a group of its own: in record order they interleave differently every step
    (the threads race), so only each thread's own order says what follows what."""
    from moe_hang.analysis.facts import facts
    from moe_hang.analysis.readings import before

    def rank(r: int) -> RankEvidence:
        entries, rid = [], 0
        for step in range(4):
            # the race: the metrics thread's collective lands before or after the main one's
            pair = [("0", step + 1, "all_reduce", "main"), ("2", step + 1, "all_reduce", "log")]
            if (step + r) % 2:
                pair.reverse()
            for pg, seq, op, tid in pair:
                rid += 1
                entries.append(Collective(pg=pg, seq=seq, op=op, input_sizes=[[4]],
                                          dtypes=["Float"], record_id=rid, completed=True,
                                          time_created_ns=rid, thread_id=tid))
        fr = FRDump(entries=entries, pg_status={"0": PgStatus(4, 4), "2": PgStatus(4, 4)})
        return RankEvidence(rank=r, alive=True, progressed=False, fr=fr)

    f = facts(Evidence(ranks={0: rank(0), 1: rank(1)}, world_size=2, job=JobState.STALLED))
    orders = f.views.thread_orders(0)
    assert sorted({c.pg for c in t} == {"0"} or {c.pg for c in t} == {"2"}
                  for t in orders) == [True, True]
    main_last = f.views[0].tl.by_pg["0"][4]
    prev = before(0, main_last, f.views)
    assert prev is not None and (prev.pg, prev.seq) == ("0", 3)
    # across groups, only a thread's own succession is learned: main -> metrics never
    # followed (in record order it did, every other step)
    assert f.program.follows(f.views[0].tl.by_pg["0"][3], f.views[0].tl.by_pg["2"][4],
                             posted=True) is False
