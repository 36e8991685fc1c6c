"""A rank's line is where its pending collective was posted, by whichever thread posted it:
the main thread's stack never places a collective one of the job's other threads posted
(moe_hang.analysis.timeline), and the main thread's id travels with its sample, across
nodes too (moe_hang.runtime.coord)."""

from __future__ import annotations

import pytest

from moe_hang.analysis.rankstate import rank_view
from moe_hang.evidence.flight_recorder import Collective, FRDump, PgStatus
from moe_hang.evidence.model import RankEvidence
from moe_hang.evidence.probe_records import Heartbeat
from moe_hang.evidence.stacks import Frame, ThreadStack, other_thread
from moe_hang.evidence.vocab import RankState
from moe_hang.runtime import coord
from moe_hang.runtime.coord import NodeSummary

JOB = "/srv/job/train.py"
LIB = "/usr/lib/python3.11/threading.py"
MAIN, METRICS = "140000000000001", "140000000000002"


def _rank(poster_frames: list[Frame]) -> RankEvidence:
    """A live, still rank: its main thread in ``LOGGER.join()`` (:76), its other thread
    (``poster_frames``) the one that posted the pending all-reduce on group 7, which the
    recorder keeps no frames of (NCCL: posted, the thread went on)."""
    pending = Collective(pg="7", seq=6, op="all_reduce", completed=False,
                         thread_id=METRICS, time_created_ns=1)
    main = ThreadStack("MainThread", [Frame(LIB, 1139, "_wait_for_tstate_lock"),
                                      Frame(LIB, 1119, "join"), Frame(JOB, 76, "<module>")],
                       thread_id=MAIN, active=False, is_main=True)
    return RankEvidence(rank=0, alive=True, progressed=False,
                        fr=FRDump(entries=[pending], pg_status={"7": PgStatus(6, 5)}),
                        threads=[main, ThreadStack("metrics", poster_frames,
                                                   thread_id=METRICS, active=False)])


def test_a_job_threads_collective_is_not_placed_by_the_main_threads_stack() -> None:
    v = rank_view(_rank([Frame("/usr/lib/python3.11/queue.py", 171, "get"),
                         Frame(JOB, 48, "log_metrics")]))
    assert v.state == RankState.IN_COLLECTIVE and v.current is not None
    assert v.site is None  # not :76: where it was posted, only its frames would say


def test_a_collective_the_autograd_engine_posted_is_at_the_main_threads_line() -> None:
    """DDP's buckets on a GPU: posted from the autograd engine's thread, which has no line of
    the job's; the main thread's line (here :76) is the one the user wrote."""
    v = rank_view(_rank([Frame("/x/site-packages/torch/autograd/graph.py", 1, "_engine")]))
    assert v.site == Frame(JOB, 76, "<module>")


@pytest.mark.parametrize(("a", "b", "other"), [
    ("140000000000001", hex(140000000000001), False),  # decimal (recorder) and hex (faulthandler)
    (MAIN, METRICS, True), ("", METRICS, False), (None, METRICS, False), ("x", METRICS, False)])
def test_thread_ids_compare_across_their_spellings(a: str | None, b: str, other: bool) -> None:
    assert other_thread(a, b) is other


def test_the_main_threads_id_crosses_nodes_with_its_sample() -> None:
    hb = {"rank": 3, "pid": 9, "time": 1.0, "main_frame": [[JOB, 76, "<module>"]],
          "main_thread": MAIN, "pg_status": {}}
    s = coord.summarize_heartbeats({3: hb}, node="1", moving={3: False}, kind="capture")
    again = NodeSummary.from_json(s.to_json())
    assert again.ranks[0].main_thread == MAIN
    parsed = Heartbeat.parse(coord.to_heartbeats([again])[3])
    assert parsed is not None and parsed.main_thread == MAIN
    assert Heartbeat.parse({"rank": 1}).main_thread is None  # a probe of before


def test_a_main_thread_inside_the_same_op_does_not_place_another_threads_collective() -> None:
    """Only the probe's sample of the main thread (a remote rank): it is inside an all-reduce
    (:20), and the rank's earliest pending collective is an all-reduce its metrics thread
    posted on group 7. The main thread's line is its own all-reduce's, not the thread's."""
    theirs = Collective(pg="7", seq=6, op="all_reduce", completed=False, thread_id=METRICS,
                        time_created_ns=1)
    mine = Collective(pg="0", seq=9, op="all_reduce", completed=False, thread_id=MAIN,
                      time_created_ns=2)
    hb = Heartbeat(rank=0, main_thread=MAIN, main_frame=[
        ["/x/site-packages/torch/distributed/distributed_c10d.py", 3252, "all_reduce"],
        [JOB, 20, "<module>"]])
    ev = RankEvidence(rank=0, alive=True, progressed=False, heartbeat=hb,
                      fr=FRDump(entries=[theirs, mine],
                                pg_status={"7": PgStatus(6, 5), "0": PgStatus(9, 8)}))
    v = rank_view(ev)
    assert v.current is theirs and v.site is None
    hb.main_thread = None  # a probe of before: which thread the sample is, unknown
    assert rank_view(ev).site == Frame(JOB, 20, "<module>")
