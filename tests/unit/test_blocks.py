"""Ranks aligned by what they posted, not by sequence numbers (analysis/blocks.py), and an
aborted rank placed where all its evidence agrees (analysis/reconcile.py) — on hand-built
recorder evidence shaped like real jobs, every asymmetric case also mirrored."""

from __future__ import annotations

import signal
import textwrap
from pathlib import Path

import pytest
from conftest import captured

from moe_hang.analysis.rules import diagnose as _diagnose
from moe_hang.evidence.flight_recorder import Collective, FRDump, PgStatus
from moe_hang.evidence.model import Evidence, RankEvidence, SizeAbort
from moe_hang.evidence.probe_records import Heartbeat
from moe_hang.evidence.stacks import Frame
from moe_hang.evidence.vocab import JobState

TORCH = "/x/site-packages/torch/distributed/distributed_c10d.py"
FSDP = "/x/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_state.py"

TRAIN = """\
import torch.distributed as dist

def evaluate(model, batch):
    with torch.no_grad():
        return model(batch)          # eval

def main(rank, model, loader):
    for step, batch in enumerate(loader):
        loss = model(batch).sum()    # forward
        loss.backward()              # backward
        if rank == 0:
            evaluate(model, batch)   # only rank 0 evaluates
        dist.all_reduce(loss)        # loss
"""


def diagnose(ev):
    """The diagnosis of a capture made here (its source read, as watch does)."""
    return _diagnose(captured(ev))


def _line(src: str, needle: str) -> int:
    return next(i for i, ln in enumerate(src.splitlines(), 1) if needle in ln)


def _job(tmp_path: Path) -> tuple[str, dict[str, int]]:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(TRAIN))
    return str(path), {k: _line(TRAIN, f"# {k}") for k in
                       ("eval", "forward", "backward", "only rank 0 evaluates", "loss")}


def _coll(seq: int, op: str, rows: int, frames: list[Frame], done: bool | None) -> Collective:
    return Collective(pg="0", seq=seq, op=op, input_sizes=[[rows, 8]], dtypes=["Float"],
                      time_created_ns=1000 * seq, completed=done, record_id=seq,
                      frames=frames)


def _dump(colls: list[Collective], world: int = 2) -> FRDump:
    done = max((c.seq for c in colls if c.completed), default=0)
    return FRDump(colls, {"0": PgStatus(max(c.seq for c in colls), done)},
                  pg_ranks={"0": tuple(range(world))}, backend="gloo")


def _rank(r: int, colls: list[Collective]) -> RankEvidence:
    return RankEvidence(rank=r, alive=True, progressed=False, fr=_dump(colls))


@pytest.mark.parametrize("evaluator", [0, 1])
def test_a_rank_only_evaluation_is_an_extra_on_that_rank(tmp_path: Path, evaluator: int):
    """FSDP2, no experts: one rank runs an evaluation forward between two steps. Its
    all-gathers pair silently with the other's training ones (same sizes); the block is
    found where it started, from code never posted before, under a rank condition."""
    path, at = _job(tmp_path)

    def fwd(line: int, fn: str = "main") -> list[Frame]:
        outer = [Frame(path, at["only rank 0 evaluates"], "main")] if fn == "evaluate" \
            else []
        return [Frame(FSDP, 9, "_pre_forward"), Frame(path, line, fn), *outer]

    bwd = [Frame(FSDP, 9, "post_backward"), Frame(path, at["backward"], "main")]
    def step(s: int) -> list[Collective]:  # one training step's four collectives
        return [_coll(s + 1, "all_gather", 16, fwd(at["forward"]), True),
                _coll(s + 2, "all_gather", 32, fwd(at["forward"]), True),
                _coll(s + 3, "reduce_scatter", 64, bwd, True),
                _coll(s + 4, "all_reduce", 1, [Frame(TORCH, 9, "all_reduce"),
                                               Frame(path, at["loss"], "main")], True)]

    step0 = step(0) + step(4)  # two steps agreed: the program is known
    ev_extra = [_coll(9, "all_gather", 16, fwd(at["eval"], "evaluate"), True),
                _coll(10, "all_gather", 32, fwd(at["eval"], "evaluate"), True),
                _coll(11, "all_gather", 16, fwd(at["forward"]), True),
                _coll(12, "all_gather", 32, fwd(at["forward"]), False)]
    plain = [_coll(9, "all_gather", 16, fwd(at["forward"]), True),
             _coll(10, "all_gather", 32, fwd(at["forward"]), True),
             _coll(11, "reduce_scatter", 64, bwd, True),
             _coll(12, "all_reduce", 1, [Frame(TORCH, 9, "all_reduce"),
                                         Frame(path, at["loss"], "main")], False)]
    other = 1 - evaluator
    ranks = {evaluator: _rank(evaluator, step0 + ev_extra), other: _rank(other, step0 + plain)}
    d = diagnose(Evidence(ranks=ranks, world_size=2))
    fd = d.first_divergence
    assert d.verdict == "desync" and d.culprit_ranks == [evaluator], d.summary
    assert fd is not None and (fd.seq, fd.kind) == (9, "extra_collective")
    assert d.culprit_basis == "history"
    assert f"Rank {evaluator} posted 2 all_gathers from evaluate() at" in d.summary
    assert f"that rank {other} never posted" in d.summary and "if rank == 0" in d.summary
    culprit_site = fd.per_rank[evaluator].callsite
    assert culprit_site is not None and culprit_site.line == at["eval"]
    assert "expert" not in d.fix
    assert "every rank" in d.fix


@pytest.mark.parametrize("skipper", [0, 1])
def test_a_skipped_collective_that_every_step_posted_is_a_skip(tmp_path: Path, skipper: int):
    path, at = _job(tmp_path)
    f_line = [Frame(TORCH, 9, "all_reduce"), Frame(path, at["loss"], "main")]
    g_line = [Frame(TORCH, 9, "all_gather"), Frame(path, at["forward"], "main")]
    steady = [_coll(1, "all_gather", 4, g_line, True), _coll(2, "all_reduce", 1, f_line, True),
              _coll(3, "all_gather", 4, g_line, True), _coll(4, "all_reduce", 1, f_line, True)]
    full = [*steady, _coll(5, "all_gather", 4, g_line, True),
            _coll(6, "all_reduce", 1, f_line, False)]
    short = [*steady, _coll(5, "all_reduce", 1, f_line, True),
             _coll(6, "all_gather", 4, g_line, False)]
    ranks = {skipper: _rank(skipper, short), 1 - skipper: _rank(1 - skipper, full)}
    d = diagnose(Evidence(ranks=ranks, world_size=2))
    assert d.verdict == "desync" and d.culprit_ranks == [skipper], d.summary
    assert d.first_divergence is not None and d.first_divergence.seq == 5
    assert d.culprit_basis == "history"
    assert f"Rank {skipper} skipped an all_gather" in d.summary


def test_with_no_history_and_no_condition_both_are_named(tmp_path: Path):
    """Two ranks, the first step: one posted a collective the other did not, and nothing
    says whether that is an extra or a skip."""
    path, at = _job(tmp_path)
    f_line = [Frame(TORCH, 9, "all_reduce"), Frame(path, at["loss"], "main")]
    g_line = [Frame(TORCH, 9, "all_gather"), Frame(path, at["forward"], "main")]
    a = [_coll(1, "all_gather", 4, g_line, True), _coll(2, "all_reduce", 1, f_line, False)]
    b = [_coll(1, "all_reduce", 1, f_line, True), _coll(2, "all_gather", 4, g_line, False)]
    d = diagnose(Evidence(ranks={0: _rank(0, a), 1: _rank(1, b)}, world_size=2))
    assert d.culprit_ranks == [0, 1] and d.culprit_basis == "ambiguous", d.summary
    assert "either" in d.summary and "says which" in d.summary


@pytest.mark.parametrize("aborted", [0, 1])
def test_an_aborted_rank_is_placed_where_its_count_and_stack_agree(tmp_path: Path,
                                                                   aborted: int):
    """Automodel's GroupedExpertsLoRA before the fix: both ranks post the token all-gather
    from one line with different row counts; the rank with more rows receives fewer bytes
    than its buffer and goes on to the routing-weights all-gather (its next seq); the other
    aborts (SIGABRT: no recorder dump). Its heartbeat says 13 completed, its fatal stack is at
    the token gather: seq 14, a size mismatch — not a rank missing at seq 15."""
    lora = str(tmp_path / "lora_experts.py")
    Path(lora).write_text("\n" * 200)
    x_gather = [Frame(TORCH, 9, "all_gather_into_tensor"), Frame(lora, 184, "forward")]
    w_gather = [Frame(TORCH, 9, "all_gather_into_tensor"), Frame(lora, 187, "forward")]
    other = [Frame(TORCH, 9, "all_reduce"), Frame(lora, 120, "forward")]
    history = [_coll(s, "all_reduce", 1, other, True) for s in range(1, 14)]
    survivor = 1 - aborted
    ranks = {
        survivor: _rank(survivor, [*history, _coll(14, "all_gather", 401, x_gather, True),
                                   _coll(15, "all_gather", 401, w_gather, False)]),
        aborted: RankEvidence(
            rank=aborted, alive=False, exit_code=-signal.SIGABRT,
            heartbeat=Heartbeat.parse({"rank": aborted, "pg_status": {
                "0": {"enqueued": 13, "completed": 13}}}),
            fatal=("Fatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call "
                   f'first):\n  File "{TORCH}", line 9 in all_gather_into_tensor\n'
                   f'  File "{lora}", line 184 in forward\n'))}
    abort = SizeAbort(received=401 * 8 * 4, expected=68 * 8 * 4)
    d = diagnose(Evidence(ranks=ranks, world_size=2, job=JobState.FAILED, size_abort=abort))
    fd = d.first_divergence
    assert d.rule == "gloo size abort" and d.verdict == "desync", d.summary
    assert fd is not None and (fd.seq, fd.kind) == (14, "size_mismatch"), d.summary
    mine = fd.per_rank[aborted]
    assert mine is not None and mine.input_sizes == [[68, 8]]
    assert "lora_experts.py:184" in d.summary
    assert f"gloo aborted rank {aborted}" in d.summary


@pytest.mark.parametrize("open_op", ["all_gather", "all_reduce"])
def test_a_position_its_own_stack_contradicts_is_never_used(tmp_path: Path, open_op: str):
    """The dead rank completed seq 1 and died in an all-gather at line 40; its peer waits in
    seq 2 from line 30. Every collective needs every member, so it died in seq 2: the same op
    from another line is the desync itself, and it is placed there with its own line. Where
    the peer's open collective is another op, its stack contradicts that position: it is not
    placed, and the disagreement is said."""
    lora = str(tmp_path / "job.py")
    Path(lora).write_text("\n" * 50)
    at30 = [Frame(TORCH, 9, "all_gather_into_tensor"), Frame(lora, 30, "step")]
    ranks = {
        0: _rank(0, [_coll(1, "all_gather", 4, at30, True),
                     _coll(2, open_op, 4, at30, False)]),
        1: RankEvidence(rank=1, alive=False, exit_code=-signal.SIGABRT,
                        heartbeat=Heartbeat.parse({"rank": 1, "pg_status": {
                            "0": {"enqueued": 1, "completed": 1}}}),
                        fatal=("Fatal Python error: Aborted\n\nCurrent thread 0x1 (most "
                               f'recent call first):\n  File "{TORCH}", line 9 in '
                               f'all_gather_into_tensor\n  File "{lora}", line 40 in step\n'))}
    d = diagnose(Evidence(ranks=ranks, world_size=2, job=JobState.FAILED))
    placed = [c for c in (d.first_divergence.per_rank.values() if d.first_divergence else [])
              if c is not None and c.source == "reconciled"]
    if open_op == "all_gather":
        assert d.first_divergence is not None and d.first_divergence.seq == 2, d.summary
        assert [(c.op, c.callsite.line if c.callsite else None) for c in placed] == [
            ("all_gather", 40)], d.summary
    else:
        assert any("disagree" in e for e in d.evidence), d.evidence
        assert not placed


def test_a_saved_recorder_and_a_fresher_heartbeat_give_the_dead_rank_its_history(
        tmp_path: Path):
    """The probe saves the recorder every few seconds (rank{R}.fr.saved.pkl): what a rank
    gloo aborted leaves. Its entries end a few collectives before the abort; its heartbeat
    says how far it got since; its stack where it died: all three agree on seq 14."""
    lora = str(tmp_path / "lora_experts.py")
    Path(lora).write_text("\n" * 200)
    x_gather = [Frame(TORCH, 9, "all_gather_into_tensor"), Frame(lora, 184, "forward")]
    w_gather = [Frame(TORCH, 9, "all_gather_into_tensor"), Frame(lora, 187, "forward")]
    other = [Frame(TORCH, 9, "all_reduce"), Frame(lora, 120, "forward")]
    history = [_coll(s, "all_reduce", 1, other, True) for s in range(1, 14)]
    saved = [_coll(s, "all_reduce", 1, [], s < 10) for s in range(1, 11)]  # no stacks
    ranks = {
        0: _rank(0, [*history, _coll(14, "all_gather", 401, x_gather, True),
                     _coll(15, "all_gather", 401, w_gather, False)]),
        1: RankEvidence(
            rank=1, alive=False, exit_code=-signal.SIGABRT, fr=_dump(saved), fr_saved=True,
            heartbeat=Heartbeat.parse({"rank": 1, "pg_status": {
                "0": {"enqueued": 13, "completed": 13}}}),
            fatal=("Fatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call "
                   f'first):\n  File "{TORCH}", line 9 in all_gather_into_tensor\n'
                   f'  File "{lora}", line 184 in forward\n'))}
    d = diagnose(Evidence(ranks=ranks, world_size=2, job=JobState.FAILED,
                          size_abort=SizeAbort(received=401 * 8 * 4, expected=68 * 8 * 4)))
    fd = d.first_divergence
    assert fd is not None and (fd.seq, fd.kind) == (14, "size_mismatch"), d.summary
    assert fd.per_rank[1] is not None and fd.per_rank[1].input_sizes == [[68, 8]]
