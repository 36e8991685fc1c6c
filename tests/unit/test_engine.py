"""The verdict engine's rules on hand-built evidence: root cause first, culprit from evidence
(and the culprit swaps when the ranks' roles do), cycles, advice from the same facts."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from conftest import captured

from moe_hang.analysis.rules import diagnose as _diagnose
from moe_hang.analysis.source import (
    Order,
    common_loop,
    excludes_ranks,
    left_loop,
    on_default_group,
    order,
    rank_condition,
)
from moe_hang.capture.source import read_facts
from moe_hang.evidence.calls import P2PCall
from moe_hang.evidence.errors import is_consequence, log_tracebacks
from moe_hang.evidence.flight_recorder import Collective
from moe_hang.evidence.model import Evidence, RankError, RankEvidence
from moe_hang.evidence.probe_records import Heartbeat, PostedRecord
from moe_hang.evidence.source import SourceFacts
from moe_hang.evidence.stacks import Frame, ThreadStack

TORCH = "/x/site-packages/torch/distributed/distributed_c10d.py"


def diagnose(ev):
    """The diagnosis of a capture made here (its source read, as watch does)."""
    return _diagnose(captured(ev))


def _job(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "job.py"
    p.write_text(textwrap.dedent(body))
    return p


def _line(path: Path, needle: str) -> int:
    return next(i for i, ln in enumerate(path.read_text().splitlines(), 1) if needle in ln)


def _facts(path: Path, *lines: int) -> SourceFacts:
    """What a capture stores of these lines of ``path`` (read where the file is)."""
    return read_facts(Frame(str(path), n, "f") for n in lines)


def _stack(*frames: tuple[str, int, str], active: bool = False,
           p2p: P2PCall | None = None) -> list[ThreadStack]:
    return [ThreadStack("MainThread", [Frame(*f) for f in frames], active=active, is_main=True,
                        p2p=p2p)]


def _ev(*ranks: RankEvidence, job: str = "stalled") -> Evidence:
    return Evidence(ranks={r.rank: r for r in ranks}, world_size=len(ranks), job=job)


# ---------------------------------------------------------------------------- evidence


def test_tracebacks_in_the_job_log_and_which_are_consequences():
    log = textwrap.dedent("""\
        [rank1]: Traceback (most recent call last):
        [rank1]:   File "/job/train.py", line 40, in <module>
        [rank1]:     step(batch)
        [rank1]:   File "/job/train.py", line 22, in step
        [rank1]:     raise ValueError("bad batch: NaN in labels")
        [rank1]: ValueError: bad batch: NaN in labels
        [rank0]: Traceback (most recent call last):
        [rank0]:   File "/job/train.py", line 24, in step
        [rank0]:     dist.all_reduce(t)
        [rank0]: RuntimeError: [pair.cc:534] Connection closed by peer [127.0.0.1]:5000
        """)
    tb = log_tracebacks(log)
    assert tb[1].type == "ValueError" and tb[1].message == "bad batch: NaN in labels"
    assert tb[1].frames[0] == Frame("/job/train.py", 22, "step")  # innermost first
    assert not is_consequence(tb[1]) and is_consequence(tb[0])
    assert is_consequence(RankError("RuntimeError", "Timed out waiting 5000ms for recv "
                                                    "operation to complete"))
    ddp = RankError("RuntimeError", "Expected to have finished reduction in the prior "
                                    "iteration before starting a new one.")
    assert not is_consequence(ddp)


def test_program_order_comes_from_the_source(tmp_path):
    job = _job(tmp_path, """\
        def f(rank, tokens):
            if rank == 0:
                a()  # A0
                b()  # B0
            else:
                b()  # B1
                a()  # A1
            if tokens:
                dispatch()  # D
            barrier()  # BAR
        """)
    ln = {k: _line(job, f"# {k}") for k in ("A0", "B0", "B1", "A1", "D", "BAR")}
    src = _facts(job, *ln.values())
    assert order(src, str(job), ln["A0"], ln["B1"]) is Order.EXCLUSIVE
    assert order(src, str(job), ln["A0"], ln["B0"]) is Order.A_FIRST
    assert order(src, str(job), ln["D"], ln["BAR"]) is Order.A_FIRST
    assert order(src, str(job), ln["BAR"], ln["D"]) is Order.B_FIRST
    assert order(src, str(tmp_path / "gone.py"), 1, 2) is Order.UNKNOWN
    assert order(SourceFacts(), str(job), ln["A0"], ln["B0"]) is Order.UNKNOWN  # not read


def test_line_order_inside_a_loop_holds_for_one_iteration_only(tmp_path):
    """In ``for step: all_reduce(a); all_gather(b)`` the all-reduce of step k+1 runs after
    the all-gather of step k: the loop that holds both lines is named, so the caller knows
    their order says nothing across iterations."""
    job = _job(tmp_path, """\
        for step in range(8):  # LOOP
            dist.all_reduce(x)  # AR
            if tokens:
                dist.all_gather(out, x)  # AG
        dist.barrier()  # BAR
        """)
    ln = {k: _line(job, f"# {k}") for k in ("LOOP", "AR", "AG", "BAR")}
    src = _facts(job, *ln.values())
    assert order(src, str(job), ln["AR"], ln["AG"]) is Order.A_FIRST
    assert common_loop(src, str(job), ln["AR"], ln["AG"]) == ln["LOOP"]
    assert common_loop(src, str(job), ln["AR"], ln["BAR"]) is None
    assert common_loop(src, str(job), ln["LOOP"], ln["AR"]) is None  # the header: not inside


def test_a_rank_condition_says_whether_it_names_who_runs_or_who_skips(tmp_path):
    """``if rank == 0`` names the ranks that run its body (an extra there); ``if rank != 3``
    and an ``else`` name the ranks that skip it."""
    job = _job(tmp_path, """\
        if rank == 0:
            evaluate()  # ONLY
        else:
            train()  # ELSE
        if rank != 3:
            reduce()  # NOT3
        if not (bad_rank and step == 3):
            broadcast()  # NOTBAD
        if rank not in skip and step > 0:
            gather()  # NOTIN
        """)
    lines = {k: _line(job, f"# {k}") for k in ("ONLY", "ELSE", "NOT3", "NOTBAD", "NOTIN")}
    src = _facts(job, *lines.values())
    got = {k: rank_condition(src, str(job), n) for k, n in lines.items()}
    assert got["ONLY"] == "if rank == 0" and got["NOT3"] == "if rank != 3"
    assert {k: excludes_ranks(c) for k, c in got.items() if c} == {
        "ONLY": False, "ELSE": True, "NOT3": True, "NOTBAD": True, "NOTIN": True}
    assert excludes_ranks("if not (rank != 3)") is False


def test_a_rank_past_a_loop_another_is_still_in_left_it(tmp_path):
    job = _job(tmp_path, """\
        for step, batch in enumerate(mine):  # LOOP
            with ctx():
                loss = model(batch)
                loss.backward()  # BWD
        if rank == 0:
            report()  # IF
        dist.all_reduce(val)  # VAL
        while busy():  # WHILE
            poll()  # POLL
        """)
    ln = {k: _line(job, f"# {k}") for k in ("LOOP", "BWD", "IF", "VAL", "WHILE", "POLL")}
    src = _facts(job, *ln.values())
    assert left_loop(src, str(job), ln["VAL"], ln["BWD"]) == ln["LOOP"]
    assert left_loop(src, str(job), ln["IF"], ln["BWD"]) == ln["LOOP"]
    assert left_loop(src, str(job), ln["BWD"], ln["VAL"]) is None  # behind, not past
    assert left_loop(src, str(job), ln["WHILE"], ln["VAL"]) is None  # no loop holds VAL
    assert left_loop(src, str(job), ln["VAL"], ln["LOOP"]) is None  # at the loop's own line
    assert left_loop(src, str(job), ln["POLL"], ln["BWD"]) == ln["LOOP"]
    assert left_loop(src, str(tmp_path / "gone.py"), 9, 3) is None


# ---------------------------------------------------------------------------- the rules


@pytest.mark.parametrize("culprit", [0, 1])
def test_the_earliest_root_cause_exception_wins(culprit):
    """The ValueError is the root cause; the peer's 'Connection closed' is its consequence,
    even when it was recorded later or earlier."""
    other = 1 - culprit
    raised = RankEvidence(rank=culprit, alive=False, exit_code=1, error=RankError(
        "ValueError", "bad batch: NaN in labels",
        [Frame("/job/train.py", 22, "step"), Frame("/job/train.py", 40, "<module>")], 100.0))
    victim = RankEvidence(rank=other, alive=False, exit_code=1, error=RankError(
        "RuntimeError", "Connection closed by peer", [Frame(TORCH, 9, "all_reduce")], 99.0))
    d = diagnose(_ev(raised, victim, job="failed"))
    assert (d.verdict, d.culprit_ranks, d.culprit_basis, d.certainty) == (
        "crash", [culprit], "exception", "definite")
    assert "ValueError: bad batch" in d.summary and "train.py:22" in d.summary
    assert d.rank(culprit).callsite == Frame("/job/train.py", 22, "step")
    assert "skip" not in d.fix.lower()


@pytest.mark.parametrize("sender", [0, 1])
def test_recv_from_a_rank_that_never_sent_names_that_rank(tmp_path, sender):
    job = _job(tmp_path, """\
        import torch.distributed as dist
        def main(rank, peer):
            if rank == RECEIVER:
                dist.recv(t, src=peer)  # RECV
            dist.all_reduce(t)  # AR
        """)
    recv_at, ar_at = _line(job, "# RECV"), _line(job, "# AR")
    receiver = 1 - sender
    r_recv = RankEvidence(rank=receiver, alive=True, progressed=False, threads=_stack(
        (TORCH, 5, "recv"), (str(job), recv_at, "main"), p2p=P2PCall("recv", sender)))
    fr_ar = Collective(pg="0", seq=3, op="all_reduce", input_sizes=[[4]], completed=False,
                       frames=[Frame(TORCH, 9, "all_reduce"), Frame(str(job), ar_at, "main")])
    r_ar = RankEvidence(rank=sender, alive=True, progressed=False, threads=_stack(
        (TORCH, 9, "all_reduce"), (str(job), ar_at, "main")),
        records=[PostedRecord(seq=3, op="all_reduce", pg="0", input_sizes=[[4]],
                              frames=fr_ar.frames)])
    r_recv.records = [PostedRecord(seq=2, op="all_reduce", pg="0", input_sizes=[[4]])]
    d = diagnose(_ev(r_recv, r_ar))
    assert d.rule == "wait-for cycle" and d.culprit_ranks == [sender], d.summary
    assert d.culprit_basis == "program_order" and d.certainty == "definite"
    assert f"recv from rank {sender}" in d.summary


def test_two_ranks_receiving_from_each_other_is_a_deadlock_naming_both(tmp_path):
    job = _job(tmp_path, """\
        def stage(rank):
            dist.recv(t, src=1 - rank)  # RECV
            dist.send(t, dst=1 - rank)
        """)
    at = _line(job, "# RECV")
    ranks = [RankEvidence(rank=r, alive=True, progressed=False, threads=_stack(
        (TORCH, 5, "recv"), (str(job), at, "stage"), p2p=P2PCall("recv", 1 - r)))
        for r in (0, 1)]
    d = diagnose(_ev(*ranks))
    assert (d.verdict, d.culprit_ranks, d.culprit_basis) == ("hang", [0, 1], "cycle")
    assert "Deadlock" in d.summary and "sends first" in d.fix


@pytest.mark.parametrize("skipper", [0, 1])
def test_same_op_from_another_line_is_a_skip_not_a_dtype_mismatch(tmp_path, skipper):
    """Stale all-to-all split counts: one rank skipped the count exchange and posted the token
    all-to-all at the same seq (same op, other dtype): it is further along the same code."""
    job = _job(tmp_path, """\
        def dispatch(x, counts):
            if refresh:
                counts = exchange(counts)  # COUNTS
            return all_to_all(x, counts)  # TOKENS
        """)
    counts_at, tokens_at = _line(job, "# COUNTS"), _line(job, "# TOKENS")

    def rank(r: int) -> RankEvidence:
        at = tokens_at if r == skipper else counts_at
        dtype = "torch.float32" if r == skipper else "torch.int64"
        frames = [Frame(TORCH, 7, "all_to_all_single"), Frame(str(job), at, "dispatch")]
        return RankEvidence(rank=r, alive=True, progressed=False, threads=_stack(*(
            (f.file, f.line, f.function) for f in frames)), records=[PostedRecord(
                seq=3, op="all_to_all", pg="0", input_sizes=[[2]], dtype=dtype,
                frames=frames)], heartbeat=Heartbeat.parse(
                    {"rank": r, "pg_status": {"0": {"enqueued": 3, "completed": 2}}}))

    d = diagnose(_ev(rank(0), rank(1)))
    assert d.verdict == "desync" and d.culprit_ranks == [skipper], d.summary
    assert d.culprit_basis == "program_order"
    assert "dtype" not in d.fix.lower()
    assert f"rank {skipper}" in d.fix.lower()


@pytest.mark.parametrize("sleeper", [0, 1])
def test_a_rank_blocked_outside_collectives_is_waited_for_not_the_transport(sleeper):
    waiter = 1 - sleeper
    asleep = RankEvidence(rank=sleeper, alive=True, progressed=False, threads=_stack(
        ("/job/loader.py", 8, "next_batch"), ("/job/train.py", 30, "<module>")))
    blocked = RankEvidence(rank=waiter, alive=True, progressed=False, threads=_stack(
        (TORCH, 9, "all_reduce"), ("/job/train.py", 33, "<module>")))
    d = diagnose(_ev(asleep, blocked))
    assert (d.verdict, d.culprit_ranks, d.culprit_basis, d.certainty) == (
        "hang", [sleeper], "waited_for", "uncertain")
    assert "NCCL_DEBUG" not in d.fix and "transport" not in d.fix
    assert "loader.py:8" in d.summary


def test_size_advice_names_varlen_only_for_a_dtensor_gather():
    def rank(r: int, rows: int, via_dtensor: bool) -> RankEvidence:
        frames = [Frame(TORCH, 3, "all_gather_into_tensor")]
        if via_dtensor:
            frames.append(Frame("/x/site-packages/torch/distributed/tensor/_api.py", 7,
                                "full_tensor"))
        frames.append(Frame("/job/train.py", 12, "gather"))
        return RankEvidence(rank=r, alive=True, progressed=False, records=[PostedRecord(
            seq=2, op="all_gather", pg="0", input_sizes=[[rows, 4]], frames=frames)])

    plain = diagnose(_ev(rank(0, 16, False), rank(1, 32, False)))
    assert plain.verdict == "desync" and plain.first_divergence is not None
    assert plain.first_divergence.kind == "size_mismatch"
    assert "varlen" not in plain.fix.lower() and "16×4" in plain.fix
    dtensor = diagnose(_ev(rank(0, 16, True), rank(1, 32, True)))
    assert "VarlenDispatch" in dtensor.fix and dtensor.fix_code


def test_a_completed_seq_from_two_code_paths_is_not_a_divergence():
    """``if rank == 0: dist.barrier() else: dist.barrier()``: different lines, one collective;
    they line up again afterwards, so the divergence is where they really differ."""
    def rank(r: int) -> RankEvidence:
        first = Frame("/job/train.py", 10 if r == 0 else 12, "<module>")
        then = Frame("/job/train.py", 20, "<module>")
        return RankEvidence(rank=r, alive=True, progressed=False, records=[
            PostedRecord(seq=1, op="barrier", pg="0", frames=[Frame(TORCH, 1, "barrier"),
                                                              first]),
            PostedRecord(seq=2, op="all_reduce", pg="0", input_sizes=[[4 if r == 0 else 8]],
                         frames=[Frame(TORCH, 2, "all_reduce"), then])])

    d = diagnose(_ev(rank(0), rank(1)))
    assert d.first_divergence is not None and d.first_divergence.seq == 2
    assert d.first_divergence.kind == "size_mismatch"


@pytest.mark.parametrize("culprit", [0, 1])
def test_a_cross_group_order_inversion_is_a_cycle_blamed_by_history(tmp_path, culprit):
    """Every step reduces over dp then ep; at the last step one rank takes a branch that does
    ep first. Each waits in a different group for the other (a cycle); the branches are
    exclusive, so program order cannot tell — earlier steps can: the culprit broke them."""
    job = _job(tmp_path, """\
        for step in range(5):
            if rank == culprit and step == 3:
                dist.all_reduce(e, group=ep)  # EP_FIRST
                dist.all_reduce(d, group=dp)
            else:
                dist.all_reduce(d, group=dp)  # DP
                dist.all_reduce(e, group=ep)  # EP
        """)
    ep_first, dp_at, ep_at = (_line(job, f"# {k}") for k in ("EP_FIRST", "DP", "EP"))

    def rec(seq: int, pg: str, line: int, t: float) -> PostedRecord:
        return PostedRecord(seq=seq, op="all_reduce", pg=pg,
                            input_sizes=[[16 if pg == "1" else 8]], time=t,
                            frames=[Frame(TORCH, 9, "all_reduce"),
                                    Frame(str(job), line, "<module>")])

    def rank(r: int) -> RankEvidence:
        past = [x for s in range(3) for x in (rec(s + 1, "1", dp_at, 10.0 * s + 1),
                                               rec(s + 1, "2", ep_at, 10.0 * s + 2))]
        now = rec(4, "2", ep_first, 41.0) if r == culprit else rec(4, "1", dp_at, 41.0)
        at = ep_first if r == culprit else dp_at
        mine = "2" if r == culprit else "1"
        return RankEvidence(rank=r, alive=True, progressed=False, records=[*past, now],
                            groups={"1": [0, 1], "2": [0, 1]},
                            heartbeat=Heartbeat.parse({"rank": r, "pg_status": {
                                pg: {"enqueued": 4 if pg == mine else 3, "completed": 3}
                                for pg in ("1", "2")}}),
                            threads=_stack((TORCH, 9, "all_reduce"), (str(job), at, "<module>")))

    d = diagnose(_ev(rank(0), rank(1)))
    assert d.rule == "wait-for cycle" and d.verdict == "desync", d.summary
    assert (d.culprit_ranks, d.culprit_basis) == ([culprit], "history")
    assert "same order" in d.fix


def test_several_root_causes_with_nothing_to_order_them_are_all_named():
    def raised(r: int, seen_at: int | None) -> RankEvidence:
        return RankEvidence(rank=r, alive=False, exit_code=1, error=RankError(
            "KeyError", f"'batch{r}'", [Frame("/job/train.py", 10 + r, "step")],
            source="job log", seen_at=seen_at))

    both = diagnose(_ev(raised(0, None), raised(1, None), job="failed"))
    assert (both.culprit_ranks, both.culprit_basis) == ([0, 1], "exception")
    assert "which came first is not recorded" in both.summary
    # the log printed rank 1's traceback first
    ordered = diagnose(_ev(raised(0, 40), raised(1, 12), job="failed"))
    assert ordered.culprit_ranks == [1]


@pytest.mark.parametrize("same_line", [True, False])
def test_stacks_in_two_collectives_blame_only_what_program_order_decides(same_line):
    """From stacks alone (no recorder): ranks in different collectives. When their lines are
    not ordered (exclusive branches, or no shared frame), both are named, never the one with
    the higher rank number."""
    def rank(r: int, op: str, line: int, fn: str) -> RankEvidence:
        return RankEvidence(rank=r, alive=True, progressed=False, threads=_stack(
            (TORCH, 3, op), ("/nowhere/a.py" if same_line else f"/nowhere/{fn}.py", line, fn)))

    d = diagnose(_ev(rank(0, "all_gather", 5, "f"), rank(1, "barrier", 9, "g")))
    assert d.verdict == "desync" and d.culprit_ranks == [0, 1], d.summary
    assert d.culprit_basis == "ambiguous"


@pytest.mark.parametrize("first", [0, 1])
def test_one_op_at_two_lines_is_a_desync_only_where_one_line_runs_first(tmp_path, first):
    """From stacks alone: every rank in all_reduce, at two lines. Where one runs before the
    other in the same code, the ranks at the later line went past it (mirrored: the culprit
    swaps); in exclusive branches the two calls may be the same collective, so nothing is
    claimed — and no "matching order and sizes" either, which only a recorder could show."""
    job = tmp_path / "train.py"
    job.write_text("import torch.distributed as dist\n"
                   "for step in range(5):\n"
                   "    dist.all_reduce(a)\n"             # line 3
                   "    dist.all_reduce(b)\n"             # line 4
                   "    if dist.get_rank() == 0:\n"
                   "        dist.all_reduce(c)\n"         # line 6
                   "    else:\n"
                   "        dist.all_reduce(c)\n")        # line 8

    def rank(r: int, line: int) -> RankEvidence:
        return RankEvidence(rank=r, alive=True, progressed=False, threads=_stack(
            (TORCH, 3, "all_reduce"), (str(job), line, "<module>")))

    lines = {first: 3, 1 - first: 4}
    d = diagnose(_ev(*(rank(r, lines[r]) for r in (0, 1))))
    assert (d.verdict, d.culprit_ranks, d.culprit_basis) == ("desync", [1 - first],
                                                             "program_order"), d.summary
    assert d.summary.startswith("Ranks wait in all_reduce at different lines")
    assert "skipped it or posted it on another group" in d.fix
    branches = diagnose(_ev(rank(0, 6), rank(1, 8)))
    assert branches.verdict != "desync" and branches.culprit_ranks == [], branches.summary
    assert "matching order" not in branches.summary


@pytest.mark.parametrize("leaver", [0, 1])
def test_a_rank_held_after_it_raised_is_failed_not_moving(leaver):
    """Multi-node watch holds a rank that raised (its probe waits in the exception hook for
    the capture): its process is alive and its wait may look like motion, but it has failed
    where it raised. Here it died of the connection its peer closed by leaving early: the
    verdict is the clean exit, never 'every rank moving' (fuzz seed 699437, job 016)."""
    raised = 1 - leaver
    held = RankEvidence(
        rank=raised, alive=True, progressed=True, held=True,
        error=RankError("RuntimeError", "[pair.cc:537] Read error [127.0.0.1]:31639: "
                        "Connection reset by peer", frames=[Frame(TORCH, 9, "broadcast"),
                                                            Frame("/job/t.py", 30, "<module>")]),
        threads=_stack((TORCH, 9, "broadcast"), ("/job/t.py", 30, "<module>")))
    left = RankEvidence(rank=leaver, alive=False, exit_code=0)
    d = diagnose(_ev(held, left, job="failed"))
    assert (d.rule, d.verdict, d.culprit_ranks) == ("rank left early", "rank_died", [leaver]), \
        d.summary


@pytest.mark.parametrize("sleeper", [0, 1])
def test_a_timeout_waiting_for_a_rank_outside_collectives_names_that_rank(sleeper):
    """gloo's timeout ended the waiting rank (a consequence, in a collective) while the other
    was still reading data: the one it waited for is named, from where each was."""
    waiter = 1 - sleeper
    asleep = RankEvidence(rank=sleeper, alive=True, progressed=False, threads=_stack(
        ("/job/loader.py", 8, "next_batch"), ("/job/train.py", 30, "<module>")))
    timed_out = RankEvidence(
        rank=waiter, alive=False, exit_code=1,
        error=RankError("RuntimeError", "Timed out waiting 30000ms for recv operation to "
                        "complete", frames=[Frame(TORCH, 9, "all_reduce"),
                                            Frame("/job/train.py", 33, "<module>")]))
    d = diagnose(_ev(asleep, timed_out, job="failed"))
    assert d.rule == "timed out waiting for a rank outside collectives", d.summary
    assert (d.verdict, d.culprit_ranks, d.certainty) == ("hang", [sleeper], "likely")
    assert f"Rank {waiter} failed waiting" in d.summary and "loader.py:8" in d.summary


def test_only_consequences_on_record_name_no_culprit():
    """Both ranks died of a closed connection and nothing else is known: no culprit, and
    the advice is how to record what diverged, not a guess."""
    closed = [RankEvidence(rank=r, alive=False, exit_code=1, error=RankError(
        "RuntimeError", "[pair.cc:534] Connection closed by peer [127.0.0.1]:5000"))
        for r in (0, 1)]
    d = diagnose(_ev(*closed, job="failed"))
    assert d.rule == "failed with consequences only", d.summary
    assert (d.verdict, d.culprit_ranks, d.certainty) == ("crash", [], "uncertain")
    assert "no rank raised an error of its own" in d.summary and "watch" in d.fix


def test_the_source_says_whether_a_collective_runs_on_every_rank(tmp_path):
    """``dist.all_reduce(x)`` is the default group's; ``group=`` (or a positional group, or
    ``**kw``) is not known to be; a line with no collective call says nothing."""
    job = _job(tmp_path, """\
        dist.all_reduce(metrics)  # WORLD
        dist.all_reduce(metrics, group=sub)  # SUB
        dist.all_gather_into_tensor(out, mine,
                                    group=LOG)  # SPLIT
        dist.barrier()  # BAR
        dist.all_reduce(x, dist.ReduceOp.SUM, sub)  # POS
        dist.broadcast(x, 0, **kw)  # KW
        y = x + 1  # NONE
        """)
    lines = {k: _line(job, f"# {k}") for k in ("WORLD", "SUB", "SPLIT", "BAR", "POS", "KW",
                                                "NONE")}
    src = _facts(job, *lines.values())
    got = {k: on_default_group(src, str(job), n) for k, n in lines.items()}
    assert got == {"WORLD": True, "SUB": False, "SPLIT": False, "BAR": True, "POS": None,
                   "KW": False, "NONE": None}
    assert on_default_group(src, str(tmp_path / "gone.py"), 1) is None
