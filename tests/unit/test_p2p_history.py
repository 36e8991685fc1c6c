"""A pipeline on gloo, whose recorder keeps no send or recv: the stage that skipped its send
went on to the step's all-reduce while its peer waits in the recv. The program is learned
from collectives only, so that a recv was "never seen after" the last all-reduce says
nothing: the order of the lines decides (the sender is past the send it owed), both
directions of the pipeline (the culprit must swap)."""

from __future__ import annotations

import pytest
from conftest import captured

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.calls import P2PCall
from moe_hang.evidence.flight_recorder import Collective, FRDump, PgStatus
from moe_hang.evidence.model import Evidence, RankEvidence
from moe_hang.evidence.stacks import Frame, ThreadStack
from moe_hang.evidence.vocab import JobState

TORCH = "/x/site-packages/torch/distributed/distributed_c10d.py"
JOB = """import torch.distributed as dist
for step in range(5):
    if RANK == RECEIVER:
        dist.recv(x, SENDER)  # line 4
    h = stage(x)
    if RANK == SENDER:
        if not (FAULTY and step == 3):
            dist.send(h, RECEIVER)  # line 8
    dist.all_reduce(stats)  # line 9
    dist.broadcast(stop, 0)  # line 10
"""


@pytest.mark.parametrize("sender", [0, 1])
def test_a_stage_past_the_send_it_owed_is_named_not_the_one_in_the_recv(tmp_path, sender):
    job = tmp_path / "pipe.py"
    job.write_text(JOB)
    receiver = 1 - sender

    def rank(r: int) -> RankEvidence:
        ops = ["all_reduce", "broadcast"] * 3
        entries = [Collective(pg="0", seq=s, op=op, input_sizes=[[4]], dtypes=["Float"],
                              record_id=s, time_created_ns=s, completed=True)
                   for s, op in enumerate(ops, start=1)]
        if r == sender:  # it skipped the send and posted the all-reduce
            entries.append(Collective(pg="0", seq=7, op="all_reduce", input_sizes=[[4]],
                                      dtypes=["Float"], record_id=7, time_created_ns=7,
                                      completed=False))
            frames = [Frame(TORCH, 9, "all_reduce"), Frame(str(job), 9, "<module>")]
        else:
            frames = [Frame(TORCH, 9, "recv"), Frame(str(job), 4, "<module>")]
        fr = FRDump(entries=entries, pg_status={"0": PgStatus(len(entries), 6)},
                    pg_ranks={"0": (0, 1)}, backend="gloo")
        # the recv's peer: py-spy's locals, or the probe's sample
        p2p = P2PCall("recv", sender) if r == receiver else None
        return RankEvidence(rank=r, alive=True, progressed=False, fr=fr, threads=[
            ThreadStack("MainThread", frames, is_main=True, p2p=p2p)])

    ev = Evidence(ranks={0: rank(0), 1: rank(1)}, world_size=2, job=JobState.STALLED)
    d = diagnose(captured(ev))
    assert d.culprit_ranks == [sender], d.summary


SKIP_JOB = """import torch.distributed as dist
for step in range(5):
    if RANK == RECEIVER:
        dist.recv(x, SENDER)  # line 4
    h = stage(x)
    if RANK == SENDER:
        dist.send(h, RECEIVER)  # line 7
    dist.all_reduce(stats)  # line 8
    if not (FAULTY and step == 3):
        dist.broadcast(stop, 0)  # line 10
"""


@pytest.mark.parametrize("sender", [0, 1])
def test_a_stage_in_a_send_is_past_its_last_recorded_collective(tmp_path, sender):
    """The sender skipped the step's broadcast and waits in the next step's send: its
    recorder's last entry (the all-reduce) is older than where it is, so it is not "behind"
    the broadcast its peer waits in — it skipped it."""
    job = tmp_path / "pipe.py"
    job.write_text(SKIP_JOB)
    receiver = 1 - sender

    def rank(r: int) -> RankEvidence:
        ops = ["all_reduce", "broadcast"] * 3 + ["all_reduce"]
        entries = [Collective(pg="0", seq=s, op=op, input_sizes=[[4]], dtypes=["Float"],
                              record_id=s, time_created_ns=s, completed=True)
                   for s, op in enumerate(ops, start=1)]
        if r == receiver:
            entries.append(Collective(pg="0", seq=8, op="broadcast", input_sizes=[[4]],
                                      dtypes=["Float"], record_id=8, time_created_ns=8,
                                      completed=False))
            frames = [Frame(TORCH, 9, "broadcast"), Frame(str(job), 10, "<module>")]
            p2p = None
        else:
            frames = [Frame(TORCH, 9, "send"), Frame(str(job), 7, "<module>")]
            p2p = P2PCall("send", receiver)
        fr = FRDump(entries=entries, pg_status={"0": PgStatus(len(entries), 7)},
                    pg_ranks={"0": (0, 1)}, backend="gloo")
        return RankEvidence(rank=r, alive=True, progressed=False, fr=fr, threads=[
            ThreadStack("MainThread", frames, is_main=True, p2p=p2p)])

    ev = Evidence(ranks={0: rank(0), 1: rank(1)}, world_size=2, job=JobState.STALLED)
    d = diagnose(captured(ev))
    assert d.culprit_ranks == [sender], d.summary
