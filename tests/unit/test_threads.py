"""A metrics thread posting on a group of its own: one rank's thread posts one collective more
(an extra item queued) or one fewer (an item not queued) than the others'. Where a rank's
thread for that group has ended (its id, or its name, is no longer among its threads), it
will never post there again: it is not held up, and the ranks that did post are counted
against those that never will. Both roles (the culprit must swap)."""

from __future__ import annotations

import pytest
from conftest import captured

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.flight_recorder import Collective, FRDump, PgStatus
from moe_hang.evidence.model import Evidence, RankEvidence
from moe_hang.evidence.stacks import Frame, ThreadStack
from moe_hang.evidence.vocab import JobState

TORCH = "/x/site-packages/torch/distributed/distributed_c10d.py"
JOB = """import threading
import torch.distributed as dist
METRICS = dist.new_group(list(range(WORLD)))
def log_metrics():
    while (item := Q.get()) is not None:
        dist.all_reduce(item, group=METRICS)  # line 6
T = threading.Thread(target=log_metrics, name="metrics")
for step in range(4):
    dist.all_reduce(stats)  # line 9
    Q.put(stats)
Q.put(None)
T.join()  # line 12
dist.barrier()  # line 13
"""
MAIN, LOGGER = "1000", "2000"


def _stack(job, where: str, metrics_alive: bool) -> list[ThreadStack]:
    main = ([Frame(TORCH, 9, "barrier"), Frame(str(job), 13, "<module>")] if where == "barrier"
            else [Frame("/usr/lib/python3.11/threading.py", 1139, "_wait_for_tstate_lock"),
                  Frame(str(job), 12, "<module>")])
    threads = [ThreadStack("MainThread", main, thread_id=MAIN, is_main=True)]
    if metrics_alive:
        threads.append(ThreadStack("metrics", [Frame(TORCH, 9, "all_reduce"),
                                               Frame(str(job), 6, "log_metrics")],
                                   thread_id=LOGGER))
    return threads


@pytest.mark.parametrize("odd", [0, 2])
def test_stacks_alone_the_rank_whose_metrics_thread_ended_lacks_its_collective(tmp_path, odd):
    """Three ranks' metrics threads wait in their group's all-reduce; the fourth has no
    metrics thread any more (it queued one item fewer) and waits in the final barrier."""
    job = tmp_path / "train.py"
    job.write_text(JOB)
    ranks = {r: RankEvidence(rank=r, alive=True, progressed=False,
                             threads=_stack(job, "barrier" if r == odd else "join",
                                            metrics_alive=r != odd)) for r in range(4)}
    d = diagnose(captured(Evidence(ranks=ranks, world_size=4, job=JobState.STALLED)))
    assert (d.verdict, d.culprit_ranks) == ("desync", [odd]), d.summary


@pytest.mark.parametrize("odd", [1, 3])
def test_a_thread_that_posted_one_more_than_every_ended_thread_posted_the_extra(tmp_path, odd):
    """Recorders with thread ids: every rank's main thread posted four all-reduces; the odd
    rank's metrics thread posted a fifth on its group, which no other rank's (ended) thread
    ever will; its main thread waits in join, the others in the barrier."""
    job = tmp_path / "train.py"
    job.write_text(JOB)

    def rank(r: int) -> RankEvidence:
        entries, rid = [], 0
        n_metrics = 5 if r == odd else 4
        for step in range(1, 5):
            rid += 1
            entries.append(Collective(pg="0", seq=step, op="all_reduce", input_sizes=[[4]],
                                      dtypes=["Float"], record_id=rid, time_created_ns=rid,
                                      completed=True, thread_id=MAIN,
                                      frames=[Frame(str(job), 9, "<module>")]))
            rid += 1
            entries.append(Collective(pg="2", seq=step, op="all_reduce", input_sizes=[[2]],
                                      dtypes=["Float"], record_id=rid, time_created_ns=rid,
                                      completed=True, thread_id=LOGGER,
                                      frames=[Frame(str(job), 6, "log_metrics")]))
        status = {"0": PgStatus(4, 4), "2": PgStatus(n_metrics, 4)}
        if r == odd:
            entries.append(Collective(pg="2", seq=5, op="all_reduce", input_sizes=[[2]],
                                      dtypes=["Float"], record_id=rid + 1,
                                      time_created_ns=rid + 1, completed=False,
                                      thread_id=LOGGER,
                                      frames=[Frame(str(job), 6, "log_metrics")]))
        else:
            entries.append(Collective(pg="0", seq=5, op="barrier", input_sizes=[],
                                      dtypes=[], record_id=rid + 1, time_created_ns=rid + 1,
                                      completed=False, thread_id=MAIN,
                                      frames=[Frame(str(job), 13, "<module>")]))
            status["0"] = PgStatus(5, 4)
        fr = FRDump(entries=entries, pg_status=status,
                    pg_ranks={"0": tuple(range(4)), "2": tuple(range(4))}, backend="gloo")
        return RankEvidence(rank=r, alive=True, progressed=False, fr=fr,
                            threads=_stack(job, "join" if r == odd else "barrier",
                                           metrics_alive=r == odd))

    ranks = {r: rank(r) for r in range(4)}
    d = diagnose(captured(Evidence(ranks=ranks, world_size=4, job=JobState.STALLED)))
    assert (d.verdict, d.culprit_ranks) == ("desync", [odd]), d.summary
    assert "log_metrics" in d.fix and "posted 5 for its main loop's 4 laps (one more)" in d.fix, \
        d.fix
