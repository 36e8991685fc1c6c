"""Every rule of the table, by name: the evidence it is made for gives that rule — so it
fires on its evidence, and nothing nearer the top of the table does — and asymmetric cases
run mirrored (the ranks' roles swapped: the culprit must swap). A rule added to the table
without a case here fails :func:`test_every_rule_has_a_case`."""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import captured, make_fr_set

from moe_hang.analysis.advice import KIND_ADVICE
from moe_hang.analysis.diagnosis import MismatchKind
from moe_hang.analysis.explain import KIND_PHRASE
from moe_hang.analysis.rules import RULES
from moe_hang.analysis.rules import diagnose as _diagnose
from moe_hang.commands.diagnose import analyze_paths
from moe_hang.evidence.flight_recorder import Collective, FRDump, PgStatus
from moe_hang.evidence.model import (
    Evidence,
    RankError,
    RankEvidence,
    Restarts,
    SizeAbort,
    Unreached,
)
from moe_hang.evidence.probe_records import Heartbeat
from moe_hang.evidence.routing import RouterCall
from moe_hang.evidence.stacks import Frame, ThreadStack
from moe_hang.evidence.vocab import JobState

TORCH = "/x/site-packages/torch/distributed/distributed_c10d.py"
CONNECTION_CLOSED = "[pair.cc:534] Connection closed by peer [127.0.0.1]:5000"


def diagnose(ev):
    """The diagnosis of a capture made here (its source read, as watch does)."""
    return _diagnose(captured(ev))


def _stack(*frames: tuple[str, int, str], active: bool = False) -> list[ThreadStack]:
    return [ThreadStack("MainThread", [Frame(*f) for f in frames], active=active,
                        is_main=True)]


def _in(op: str, line: int) -> list[ThreadStack]:
    """A main thread blocked in ``op`` posted at /job/train.py:line."""
    return _stack((TORCH, 9, op), ("/job/train.py", line, "<module>"))


def _ev(*ranks: RankEvidence, job: JobState = JobState.STALLED, **kw: object) -> Evidence:
    return Evidence(ranks={r.rank: r for r in ranks}, world_size=len(ranks), job=job,
                    **kw)  # type: ignore[arg-type]


def _stuck(rank: int, threads: list[ThreadStack], **kw: object) -> RankEvidence:
    return RankEvidence(rank=rank, alive=True, progressed=False, threads=threads,
                        **kw)  # type: ignore[arg-type]


def _fr(rank: int, colls: list[tuple[int, str, list[list[int]], bool | None]],
        line: int = 20) -> FRDump:
    """A rank's recorder on the default group: (seq, op, sizes, completed) entries."""
    entries = [Collective(pg="0", seq=s, op=op, input_sizes=sz, dtypes=["Float"],
                          time_created_ns=1000 * s, completed=done, record_id=s,
                          frames=[Frame(TORCH, 9, op), Frame("/job/train.py", line, "step")])
               for s, op, sz, done in colls]
    done = max((s for s, _, _, d in colls if d), default=0)
    return FRDump(entries, {"0": PgStatus(max(s for s, *_ in colls), done)},
                  pg_ranks={"0": (0, 1)}, backend="gloo")


# --------------------------------------------------------------- one case per rule

def _held(culprit: int) -> tuple[Evidence, list[int]]:
    ev, culprits = _stalled_outside(culprit)
    ev.held = "no progress on any rank for 300 s (--hang-after)"
    return ev, culprits


def _finished(_: int) -> tuple[Evidence, list[int]]:
    return _ev(*(RankEvidence(rank=r, alive=False, exit_code=0) for r in (0, 1)),
               job=JobState.COMPLETED), []


def _root_cause(culprit: int) -> tuple[Evidence, list[int]]:
    raised = RankEvidence(rank=culprit, alive=False, exit_code=1, error=RankError(
        "ValueError", "corrupt shard 17", frames=[Frame("/job/train.py", 7, "load")],
        time=1.0))
    peer = RankEvidence(rank=1 - culprit, alive=False, exit_code=1, error=RankError(
        "RuntimeError", CONNECTION_CLOSED, time=2.0))
    return _ev(raised, peer, job=JobState.FAILED), [culprit]


def _size_abort(culprit: int) -> tuple[Evidence, list[int]]:
    # the survivor posted 4x8 at seq 3; the aborted rank got 2x the bytes it expected
    survivor = 1 - culprit
    s = RankEvidence(rank=survivor, alive=True, progressed=False, threads=_in("all_gather", 20),
                     fr=_fr(survivor, [(1, "all_reduce", [[8]], True),
                                       (2, "all_reduce", [[8]], True),
                                       (3, "all_gather", [[4, 8]], False)]))
    aborted = RankEvidence(rank=culprit, alive=False, exit_code=-signal.SIGABRT,
                           fatal='Fatal Python error: Aborted\n\nThread 0x1 (most recent call '
                                 f'first):\n  File "{TORCH}", line 9 in all_gather\n  File '
                                 '"/job/train.py", line 20 in step\n')
    ev = _ev(s, aborted, job=JobState.FAILED, size_abort=SizeAbort(256, 128))
    return ev, [culprit, survivor]  # one line, two sizes, no majority: both named


def _killed(culprit: int) -> tuple[Evidence, list[int]]:
    dead = RankEvidence(rank=culprit, alive=False, exit_code=-signal.SIGKILL)
    return _ev(dead, _stuck(1 - culprit, _in("all_reduce", 30))), [culprit]


def _left(culprit: int) -> tuple[Evidence, list[int]]:
    gone = RankEvidence(rank=culprit, alive=False, exit_code=0)
    return _ev(gone, _stuck(1 - culprit, _in("all_reduce", 30))), [culprit]


def _exit_beat(rank: int, posted: int) -> Heartbeat:
    """The probe's last beat at interpreter exit, with the recorder's final count."""
    return Heartbeat(rank=rank, progress={"phase": "exiting"},
                     pg_status={"0": PgStatus(posted, posted)})


def _waiting_at(rank: int, seq: int) -> RankEvidence:
    return RankEvidence(rank=rank, alive=True, progressed=False, fr=_fr(rank, [
        (s, "all_reduce", [[8]], True) for s in range(1, seq)] + [
        (seq, "all_reduce", [[8]], False)]))


def _finishing(finisher: int) -> tuple[Evidence, list[int]]:
    """The finisher's exit beat counts 5 all-reduces; the other waits in the 5th: it is only
    slower out of it (a healthy job ending one rank at a time)."""
    done = RankEvidence(rank=finisher, alive=False, exit_code=0,
                        heartbeat=_exit_beat(finisher, 5))
    return _ev(done, _waiting_at(1 - finisher, 5)), []


def _left_short(culprit: int) -> tuple[Evidence, list[int]]:
    """Still in its interpreter's exit (alive, no stack), its final count 4 while the other
    waits in the 5th: it left without posting it."""
    going = RankEvidence(rank=culprit, alive=True, heartbeat=_exit_beat(culprit, 4))
    return _ev(going, _waiting_at(1 - culprit, 5)), [culprit]


def _unknown(_: int) -> tuple[Evidence, list[int]]:
    ev = _ev(*(_stuck(r, _in("all_reduce", 30)) for r in (0, 1)))
    ev.world_size = 4
    ev.unreached = Unreached([2, 3], local_world=2, hosts={"1": "gpu-1"})
    return ev, []


def _cycle(culprit: int) -> tuple[Evidence, list[int]]:
    """Each rank waits in a recv from the other (no send posted): every rank on the cycle."""
    from moe_hang.evidence.calls import P2PCall
    ranks = [RankEvidence(rank=r, alive=True, progressed=False, threads=[ThreadStack(
        "MainThread", [Frame(TORCH, 9, "recv"), Frame("/job/train.py", 12, "<module>")],
        is_main=True, p2p=P2PCall("recv", 1 - r))]) for r in (0, 1)]
    return _ev(*ranks), [0, 1]


def _desync(culprit: int) -> tuple[Evidence, list[int]]:
    """At seq 3 the culprit posted a barrier where the others (majority) all-reduce."""
    ranks = []
    for r in range(3):
        last = (3, "barrier", [], False) if r == culprit else (3, "all_reduce", [[8]], False)
        ranks.append(RankEvidence(rank=r, alive=True, progressed=False,
                                  fr=_fr(r, [(1, "all_reduce", [[8]], True),
                                             (2, "all_reduce", [[8]], True), last])))
    for r in ranks:
        assert r.fr is not None
        r.fr.pg_ranks = {"0": (0, 1, 2)}
    return _ev(*ranks), [culprit]


def _stack_desync(culprit: int) -> tuple[Evidence, list[int]]:
    """No recorder: the culprit's stack is in a barrier at line 40, the two others in the
    all-reduce at line 30 (no source: the majority names the one that differs)."""
    ranks = [_stuck(r, _in("barrier", 40) if r == culprit else _in("all_reduce", 30))
             for r in range(3)]
    return _ev(*ranks), [culprit]


def _roots(culprit: int) -> tuple[Evidence, list[int]]:
    """No recorder: three ranks in one broadcast (the default group) at line 30, the
    culprit naming src=2 where the others name src=1 (stacks alone: the majority)."""
    from moe_hang.evidence.calls import RootedCall

    ranks = [_stuck(r, [dataclasses.replace(t, root=RootedCall(
        "broadcast", 2 if r == culprit else 1, "src", True)) for t in _in("broadcast", 30)])
             for r in range(3)]
    return _ev(*ranks), [culprit]


def _unmatched(tmp: Path) -> tuple[Evidence, list[int]]:
    truth = make_fr_set(tmp, "--ranks", "8", "--entries", "40", "--fault", "p2p")
    return _analyzed(tmp), sorted(truth["culprits"])


def _analyzed(path: Path) -> Evidence:
    """What ``analyze`` builds from a dump set (the rule test reads only the evidence)."""
    from moe_hang.evidence.flight_recorder import postmortem
    found = postmortem.find([path])
    return postmortem.evidence(postmortem.load_sets(found.sets, workers=1))


def _launcher_died(_: int) -> tuple[Evidence, list[int]]:
    ev = _ev(*(_stuck(r, _in("all_reduce", 30)) for r in (0, 1)))
    ev.agent_exit_code = -signal.SIGKILL
    return ev, []


def _monitored(culprit: int) -> tuple[Evidence, list[int]]:
    reporter = 1 - culprit
    failed = RankEvidence(rank=reporter, alive=False, exit_code=1, error=RankError(
        "RuntimeError", f"Rank {culprit} failed to pass monitoredBarrier in 5000 ms"))
    slow = _stuck(culprit, _stack(("/job/loader.py", 8, "next_batch"),
                                  ("/job/train.py", 30, "<module>")))
    return _ev(failed, slow, job=JobState.FAILED), [culprit]


def _timed_out(culprit: int) -> tuple[Evidence, list[int]]:
    asleep = _stuck(culprit, _stack(("/job/loader.py", 8, "next_batch"),
                                    ("/job/train.py", 30, "<module>")))
    timed_out = RankEvidence(rank=1 - culprit, alive=False, exit_code=1, error=RankError(
        "RuntimeError", "Timed out waiting 30000ms for recv operation to complete",
        frames=[Frame(TORCH, 9, "all_reduce"), Frame("/job/train.py", 33, "<module>")]))
    return _ev(asleep, timed_out, job=JobState.FAILED), [culprit]


def _consequences(_: int) -> tuple[Evidence, list[int]]:
    closed = [RankEvidence(rank=r, alive=False, exit_code=1,
                           error=RankError("RuntimeError", CONNECTION_CLOSED)) for r in (0, 1)]
    return _ev(*closed, job=JobState.FAILED), []


def _failed_unknowns(node: int) -> tuple[Evidence, list[int]]:
    """Node ``node``'s ranks failed of a closed connection only; the other node's watcher did
    not answer (its store's host had ended): its ranks are unknown, not "no rank raised"."""
    mine = [2 * node, 2 * node + 1]
    closed = [RankEvidence(rank=r, alive=False, exit_code=1,
                           error=RankError("RuntimeError", CONNECTION_CLOSED)) for r in mine]
    other = [r for r in range(4) if r not in mine]
    ev = Evidence(ranks={r.rank: r for r in closed}, world_size=4, job=JobState.FAILED,
                  unreached=Unreached(other, local_world=2, hosts={str(1 - node): "vm-b"}))
    return ev, []


def _moving(_: int) -> tuple[Evidence, list[int]]:
    return _ev(*(RankEvidence(rank=r, alive=True, progressed=True, threads=_in("all_reduce", 30))
                 for r in (0, 1)), job=JobState.RUNNING), []


def _all_completed(tmp: Path) -> tuple[Evidence, list[int]]:
    make_fr_set(tmp, "--ranks", "8", "--entries", "40", "--fault", "none")
    return _analyzed(tmp), []


def _stalled_outside(culprit: int) -> tuple[Evidence, list[int]]:
    asleep = _stuck(culprit, _stack(("/job/loader.py", 8, "next_batch"),
                                    ("/job/train.py", 30, "<module>")))
    return _ev(asleep, _stuck(1 - culprit, _in("all_reduce", 33))), [culprit]


def _straggler(culprit: int) -> tuple[Evidence, list[int]]:
    busy = RankEvidence(rank=culprit, alive=True, progressed=True, threads=_stack(
        ("/job/model.py", 5, "forward"), ("/job/train.py", 30, "<module>"), active=True))
    return _ev(busy, _stuck(1 - culprit, _in("all_reduce", 33))), [culprit]


def _all_in_one(_: int) -> tuple[Evidence, list[int]]:
    return _ev(*(_stuck(r, _in("all_reduce", 30)) for r in (0, 1))), []


def _joining(_: int) -> tuple[Evidence, list[int]]:
    """Both ranks inside init_process_group (gloo connecting them): the group never formed."""
    making = _stack((TORCH, 2169, "_new_process_group_helper"), (TORCH, 1899,
                    "init_process_group"), ("/job/train.py", 8, "<module>"))
    return _ev(*(_stuck(r, making) for r in (0, 1))), []


def _progress_unseen(_: int) -> tuple[Evidence, list[int]]:
    """diagnose on NCCL ranks in one all-reduce in every sample: their counters (zero) cannot
    tell a collective that never completes from a new one each time."""
    from moe_hang.evidence.activity import Activity

    quiet = Activity(window_s=1.0, wakeups=8, syscalls=0, io_bytes=0, attaches=4,
                     backends=("nccl",))
    return _ev(*(_stuck(r, _in("all_reduce", 30), activity=quiet) for r in (0, 1)),
               job=JobState.RUNNING), []


# ------------------------------------------------- NCCL: RAS reports and recorder timing


def _ras_writer():  # tests/unit/fixtures/ras/write_fixtures.py: NCCL's JSON layout
    import importlib.util
    import sys

    from conftest import FIXTURES

    path = FIXTURES / "ras" / "write_fixtures.py"
    spec = importlib.util.spec_from_file_location("ras_write_fixtures", path)
    assert spec and spec.loader
    mod = sys.modules.get("ras_write_fixtures") or importlib.util.module_from_spec(spec)
    if "ras_write_fixtures" not in sys.modules:
        sys.modules["ras_write_fixtures"] = mod
        spec.loader.exec_module(mod)
    return mod


HOST = "10.0.0.1"


def _report(counts: tuple[int, int], ts: str = "2026-03-04 03:00:00", *,
            missing: int | None = None, error: int | None = None) -> str:
    """Two ranks (pids 500, 501 on HOST) of one communicator: AllReduce ``counts``."""
    w = _ras_writer()
    ranks = [w.Rank(r, HOST, 500 + r, r, w.ar(counts[r])) for r in (0, 1) if r != missing]
    if error is not None:
        ranks[error].async_error = 1  # ncclUnhandledCudaError
    gone = [w.Missing(missing, HOST, 500 + missing, missing, dead=True)] \
        if missing is not None else []
    return w.write("2.29.7", 12090, 12090, ts, [w.Comm(0xfeed, (1, 2), 2, ranks, gone)])


def _with_ras(ev: Evidence, *reports: str) -> Evidence:
    from moe_hang.evidence.ras import RasPoll, parse_report
    from moe_hang.evidence.ras_files import attach_ras

    for r, e in ev.ranks.items():
        e.pid, e.host = 500 + r, HOST
    attach_ras(ev, [RasPoll(parse_report(t), f"poll{i}") for i, t in enumerate(reports)])
    return ev


def _synced(culprit: int) -> Evidence:
    """Both ranks blocked at the same line outside any collective (a CUDA sync)."""
    del culprit
    return _ev(*(_stuck(r, _stack(("/job/train.py", 44, "<module>"))) for r in (0, 1)))


def _ras_gone(culprit: int) -> tuple[Evidence, list[int]]:
    return _with_ras(_synced(culprit), _report((7, 7), missing=culprit)), [culprit]


def _ras_error(culprit: int) -> tuple[Evidence, list[int]]:
    return _with_ras(_synced(culprit), _report((7, 7), error=culprit)), [culprit]


def _ras_frozen(culprit: int) -> tuple[Evidence, list[int]]:
    counts = (100, 101) if culprit == 0 else (101, 100)
    return _with_ras(_synced(culprit), _report(counts),
                     _report(counts, "2026-03-04 03:00:05")), [culprit]


def _ras_moving(_: int) -> tuple[Evidence, list[int]]:
    ev = _ev(*(_stuck(r, _in("all_reduce", 30)) for r in (0, 1)))
    return _with_ras(ev, _report((7, 7)), _report((9, 9), "2026-03-04 03:00:05")), []


def _transport(culprit: int) -> tuple[Evidence, list[int]]:
    """NCCL recorder with timing: both ranks posted all_reduce #3 alike; the culprit's kernel
    never started it, the other's did; RAS frozen at equal counts."""
    ranks = []
    for r in (0, 1):
        fr = _fr(r, [(1, "all_reduce", [[8]], True), (2, "all_reduce", [[8]], True),
                     (3, "all_reduce", [[8]], False)])
        fr.backend = "nccl"
        for c in fr.entries:
            c.state = "completed" if c.completed else ("scheduled" if r == culprit
                                                       else "started")
            c.time_started_ns = None if c.state == "scheduled" else 5000 * c.seq
        ranks.append(RankEvidence(rank=r, alive=True, progressed=False, fr=fr))
    ev = _ev(*ranks)
    return _with_ras(ev, _report((7, 7)), _report((7, 7), "2026-03-04 03:00:05")), [culprit]


def _ras_one_poll(culprit: int) -> tuple[Evidence, list[int]]:
    counts = (100, 101) if culprit == 0 else (101, 100)
    return _with_ras(_synced(culprit), _report(counts)), [culprit]


def _ras_clean(_: int) -> tuple[Evidence, list[int]]:
    return _with_ras(Evidence(ranks={}), _report((7, 7))), []


def _inconclusive(_: int) -> tuple[Evidence, list[int]]:
    return _ev(*(RankEvidence(rank=r, alive=True, stack_error="py-spy: permission denied")
                 for r in (0, 1))), []


# name -> (evidence for a culprit, whether the case is asymmetric: run it for both roles)
Case = Callable[[int], tuple[Evidence, list[int]]]
def _threads_fr(rank: int, posts: list[tuple[int, str, int, bool | None]]) -> FRDump:
    """A recorder on the default group, each entry with the thread that posted it: (seq,
    thread, elements, completed); MainThread at train.py:20, the logger at train.py:8."""
    entries = [Collective(pg="0", seq=s, op="all_reduce", input_sizes=[[n]],
                          dtypes=["Float"], time_created_ns=1000 * s, completed=done,
                          record_id=s, thread_name=t, thread_id=str(1 if t == "MainThread" else 2),
                          frames=[Frame(TORCH, 9, "all_reduce"),
                                  Frame("/job/train.py", 20, "step") if t == "MainThread"
                                  else Frame("/job/train.py", 8, "log_loop")])
               for s, t, n, done in posts]
    done = max((s for s, _, _, d in posts if d), default=0)
    return FRDump(entries, {"0": PgStatus(max(s for s, *_ in posts), done)},
                  pg_ranks={"0": (0, 1)}, backend="gloo")


LOG = "Thread-1 (log_loop)"


def _thread_order(helper: int) -> tuple[Evidence, list[int]]:
    """A logger thread all-reduces on the default group beside the training loop: at seq 4
    rank ``helper``'s logger posted first, the other's training step."""
    agreed = [(1, "MainThread", 64, True), (2, LOG, 4, True), (3, "MainThread", 64, True)]
    ranks = []
    for r in (0, 1):
        t = LOG if r == helper else "MainThread"
        ranks.append(_stuck(r, _in("all_reduce", 8 if r == helper else 20),
                            fr=_threads_fr(r, [*agreed, (4, t, 4 if r == helper else 64,
                                                         False)])))
    return _ev(*ranks), [0, 1]


CASES: dict[str, tuple[Case, bool]] = {
    "stall held past --hang-after": (_held, True),
    "every rank finished": (_finished, False),
    "root-cause exception": (_root_cause, True),
    "two threads post on one group": (_thread_order, True),
    "gloo size abort": (_size_abort, False),
    "rank killed or gone": (_killed, True),
    "rank left early": (_left, True),
    "NCCL rank gone (RAS)": (_ras_gone, True),
    "NCCL error on a rank (RAS)": (_ras_error, True),
    "waits on unknown ranks": (_unknown, False),
    "wait-for cycle": (_cycle, False),
    "collective desync": (_desync, True),
    "desync from stacks": (_stack_desync, True),
    "members name different roots": (_roots, True),
    "frozen launch counts disagree (RAS)": (_ras_frozen, True),
    "launcher died": (_launcher_died, False),
    "monitored barrier names the laggards": (_monitored, True),
    "timed out waiting for a rank outside collectives": (_timed_out, True),
    "failed, other nodes unknown": (_failed_unknowns, True),
    "failed with consequences only": (_consequences, False),
    "finished, the others returning from what it posted": (_finishing, True),
    "every rank moving": (_moving, False),
    "NCCL launch counts moving (RAS)": (_ras_moving, False),
    "stalled outside collectives": (_stalled_outside, True),
    "straggler": (_straggler, True),
    "transport or hardware hang": (_transport, True),
    "launch counts differ in one RAS report": (_ras_one_poll, True),
    "one RAS report, nothing wrong in it": (_ras_clean, False),
    "every rank inside a process group's creation": (_joining, False),
    "in matching collectives, progress unseen": (_progress_unseen, False),
    "all wait in matching collectives": (_all_in_one, False),
    "inconclusive": (_inconclusive, False),
}
# cases built from a synthetic dump set (post-mortem): a directory, not a role
DUMP_CASES: dict[str, Callable[[Path], tuple[Evidence, list[int]]]] = {
    "unmatched send/recv": _unmatched,
    "recorded collectives all completed": _all_completed,
}


@pytest.mark.parametrize("culprit", [0, 1])
def test_a_rank_in_its_exit_short_of_a_peers_wait_left_early(culprit: int) -> None:
    """Its final count says it never posted the collective the other waits in: it left,
    whatever a stale recorder of its own says (analysis.departed)."""
    ev, culprits = _left_short(culprit)
    d = diagnose(ev)
    assert (d.rule, d.culprit_ranks) == ("rank left early", culprits), d.summary


@pytest.mark.parametrize("culprit", [0, 1])
def test_without_final_counts_a_finished_rank_still_left_early(culprit: int) -> None:
    """An exit beat without the recorder's counts (an older probe) claims nothing: the
    finished rank is read as before, as having left the other waiting."""
    ev, _ = _finishing(culprit)
    hb = ev.ranks[culprit].heartbeat
    assert hb is not None
    hb.pg_status = None
    d = diagnose(ev)
    assert (d.rule, d.culprit_ranks) == ("rank left early", [culprit]), d.summary


@pytest.mark.parametrize("culprit", [0, 1])
def test_a_finished_rank_short_of_a_later_pending_one_left_early(culprit: int) -> None:
    """The other waits in the 5th, the last the finished rank posted — and has posted a 6th
    after it (``async_op=True``; or the 5th is done and not yet marked so, on a loaded
    machine): it waits for that one too, which the finished rank never posted."""
    ev, _ = _finishing(culprit)
    waiting = ev.ranks[1 - culprit]
    assert waiting.fr is not None
    waiting.fr = _fr(1 - culprit, [(s, "all_reduce", [[8]], True) for s in range(1, 5)] + [
        (5, "all_reduce", [[8]], False), (6, "all_reduce", [[8]], False)])
    d = diagnose(ev)
    assert (d.rule, d.culprit_ranks) == ("rank left early", [culprit]), d.summary


def test_every_rule_has_a_case() -> None:
    names = [r.name for r in RULES]
    assert len(names) == len(set(names)), "two rules share a name"
    assert set(names) == set(CASES) | set(DUMP_CASES)


@pytest.mark.parametrize("node", [0, 1], ids=["node0_alone", "node1_alone"])
def test_a_node_alone_never_says_no_rank_raised(node: int) -> None:
    """Issue 19 item 4: the node that could not reach the other says the other's ranks are
    unknown and where their root cause would be (mirrored: either node alone)."""
    ev, _ = _failed_unknowns(node)
    d = diagnose(ev)
    other = "ranks 0, 1" if node else "ranks 2, 3"
    assert "no rank raised" not in d.summary
    assert f"{other} on node vm-b are unknown" in d.summary, d.summary
    assert ("the cause is there (a rank that raised, died or was killed) or between the "
            "nodes") in d.summary
    assert "none of them raised an error of its own" in d.summary
    assert d.fix.startswith("Look at node vm-b:") and "moe-hang analyze" in d.fix
    assert d.verdict == "crash" and d.culprit_ranks == [] and d.certainty == "uncertain"
    assert [r.state for r in d.ranks if r.rank in ev.unreached.ranks] == ["unknown"] * 2


def test_a_node_of_one_rank_alone_says_it_raised_no_error() -> None:
    """Fuzz seed 8123057 job 005 (one rank a node; the other node's rank SIGKILLed, its agent
    and the store gone): "rank 0 … and it raised no error of its own" — it said "and it
    raised an error of its own", the opposite of the evidence."""
    closed = RankEvidence(rank=0, alive=False, exit_code=1,
                          error=RankError("RuntimeError", CONNECTION_CLOSED))
    ev = Evidence(ranks={0: closed}, world_size=2, job=JobState.FAILED,
                  unreached=Unreached([1], local_world=1, hosts={"1": "vm-b"}))
    d = diagnose(ev)
    assert "Rank 0 failed with communication errors" in d.summary, d.summary
    assert "and it raised no error of its own; rank 1 on node vm-b is unknown" in d.summary
    assert (d.verdict, d.culprit_ranks, d.certainty) == ("crash", [], "uncertain")


@pytest.mark.parametrize("crashed", [1, 0], ids=["rank1", "mirrored"])
def test_healthy_after_a_restart_says_what_the_failed_attempt_raised(crashed: int) -> None:
    """Issue 18 case 8: torchrun restarted the ranks once; attempt 0's root cause in one
    line (the peer's closed connection is a consequence, not named)."""
    raised = RankError("ValueError", "corrupt shard 17", frames=[Frame("/job/x.py", 9, "load")],
                       time=1.0, restart=0)
    peer = RankError("RuntimeError", CONNECTION_CLOSED, time=2.0, restart=0)
    ev = _ev(*(RankEvidence(rank=r, alive=False, exit_code=0) for r in (0, 1)),
             job=JobState.COMPLETED,
             restarts=Restarts(1, {crashed: raised, 1 - crashed: peer}))
    d = diagnose(ev)
    assert d.verdict == "healthy" and d.rule == "every rank finished"
    assert d.summary == (f"All 2 ranks finished after 1 restart; attempt 0: rank {crashed} "
                         "raised ValueError: corrupt shard 17 at /job/x.py:9 load."), d.summary
    assert f"rank {crashed}" in d.fix


@pytest.mark.parametrize("first", [0, 1], ids=["rank0_first", "rank1_first"])
def test_one_error_on_every_rank_is_the_codes_not_the_first_ranks(first: int) -> None:
    """A trial (an EP dispatch whose all_to_all_single output has no grad_fn): both ranks
    raised the same RuntimeError at one line, each on its own. It said "Rank 1 raised ...:
    the other ranks only failed because it left", picked by a few milliseconds. Whichever
    raised first, every rank is named; an error that differs still names the first."""
    msg = "element 0 of tensors does not require grad and does not have a grad_fn"
    raised = [RankEvidence(rank=r, alive=False, exit_code=1, error=RankError(
        "RuntimeError", msg, frames=[Frame("/job/moe.py", 39, "main")],
        time=1.0 if r == first else 1.01)) for r in (0, 1)]
    d = diagnose(_ev(*raised, job=JobState.FAILED))
    assert (d.verdict, d.culprit_ranks, d.certainty) == ("crash", [0, 1], "definite")
    assert d.summary.startswith(f"Every rank raised RuntimeError: {msg} at /job/moe.py:39 "
                                "main: the same error on each"), d.summary
    assert "only failed because" not in d.fix and "every rank met it" in d.fix
    raised[1 - first].error = RankError("ValueError", "corrupt shard 17",
                                        frames=[Frame("/job/moe.py", 12, "load")], time=1.01)
    d = diagnose(_ev(*raised, job=JobState.FAILED))
    assert d.culprit_ranks == [first] and "only failed because" not in d.fix, d.fix
    assert f"rank {1 - first} raised an error of its own too" in d.fix


def test_one_error_on_several_ranks_keeps_what_its_words_call_for() -> None:
    """A review's cases. DDP's unused parameters on every rank: its own advice, not "fix the
    RuntimeError". Two of four ranks routed no token (the anchor advice), the other two
    failed of the closed connections (said as consequences). NCCL's remote error on three
    ranks after the fourth was SIGKILLed: a consequence, the killed rank named. The same
    error on two ranks while another was killed: no "none failed because another left"."""
    ddp = ("Expected to have finished reduction in the prior iteration before starting a new "
           "one. ... pass the keyword argument `find_unused_parameters=True` to "
           "`torch.nn.parallel.DistributedDataParallel`")
    d = diagnose(_ev(*(RankEvidence(rank=r, alive=False, exit_code=1, error=RankError(
        "RuntimeError", ddp, frames=[Frame("/job/train.py", 40, "main")], time=1.0 + r))
        for r in (0, 1)), job=JobState.FAILED))
    assert d.culprit_ranks == [0, 1] and "find_unused_parameters=True" in d.fix, d.fix
    block = "model.layers.0.block_sparse_moe"
    ranks = [RankEvidence(rank=r, alive=False, exit_code=1, error=RankError(
        "RuntimeError", "element 0 of tensors does not require grad and does not have a "
        "grad_fn", frames=[Frame("/job/train.py", 72, "main")], time=1.0 + r) if r < 2 else
        RankError("RuntimeError", CONNECTION_CLOSED, time=3.0),
        routing=[RouterCall(1, block, 0, 0 if r < 2 else 32,
                            (0,) * 4 if r < 2 else (16,) * 4, 2)]) for r in range(4)]
    d = diagnose(_ev(*ranks, job=JobState.FAILED))
    assert d.culprit_ranks == [0, 1] and "Ranks 0, 1 routed no token" in d.fix, d.fix
    assert "Ranks 2, 3 then failed as a consequence" in d.summary, d.summary
    nccl = ("NCCL error in: ProcessGroupNCCL.cpp:3356, remote process exited or there was a "
            "network error, NCCL version 2.21.5")
    ranks = [RankEvidence(rank=0, alive=False, exit_code=-signal.SIGKILL), *(RankEvidence(
        rank=r, alive=False, exit_code=1, error=RankError(
            "torch.distributed.DistBackendError", nccl, frames=[
                Frame(TORCH, 9, "all_reduce"), Frame("/job/train.py", 88, "main")],
            time=5.0 + r)) for r in (1, 2, 3))]
    d = diagnose(_ev(*ranks, job=JobState.FAILED))
    assert (d.rule_id, d.culprit_ranks) == ("killed", [0]), d.summary
    same = [RankEvidence(rank=r, alive=False, exit_code=1, error=RankError(
        "ValueError", "bad batch", frames=[Frame("/job/train.py", 50, "main")], time=1.0 + r))
        for r in (0, 1)]
    d = diagnose(_ev(*same, RankEvidence(rank=2, alive=False, exit_code=-signal.SIGKILL),
                     job=JobState.FAILED))
    assert "none failed because another left" not in d.summary, d.summary


@pytest.mark.parametrize("helper", [1, 0], ids=["rank1_logger_first", "mirrored"])
def test_two_threads_on_one_group_are_the_codes_order_not_a_ranks_skip(helper: int) -> None:
    """A trial (a logger thread all-reducing a metric on the default group beside the
    training loop): it said "Rank 1 skipped an all_reduce ... that rank 0 posted", definite.
    Every rank's history shows both threads on the group: the order is each rank's timing;
    every rank is named, the helper's line is the next step, and the advice a group of its
    own. Where one rank's history never shows the logger on the group, it is no race."""
    ev, _ = _thread_order(helper)
    d = diagnose(ev)
    assert (d.verdict, d.rule_id, d.culprit_ranks, d.culprit_basis, d.certainty) == (
        "desync", "thread_order", [0, 1], "thread_order", "definite"), d.summary
    assert d.summary.startswith("Two threads of every rank post on default_pg, MainThread at "
                                "/job/train.py:20 step and Thread-1 (log_loop) at "
                                "/job/train.py:8 log_loop"), d.summary
    assert f"rank {helper}'s Thread-1 (log_loop) all_reduce(4)" in d.summary
    assert "group of their own" in d.fix and d.fix_site is not None \
        and d.fix_site.line == 8
    # the logger's rank posted a training collective the other never did (it skipped
    # the one the other posts at seq 4): its own thread's order differs, no race explains it
    mine = ev.ranks[helper].fr
    assert mine is not None
    mine.entries.append(replace(mine.entries[0], seq=5, input_sizes=[[32]], completed=False,
                                record_id=5))
    d = diagnose(ev)
    assert d.rule_id != "thread_order" and d.culprit_basis != "thread_order", d.summary
    mine.entries.pop()
    other = ev.ranks[1 - helper]
    assert other.fr is not None
    other.fr.entries[1].thread_name = "MainThread"  # its logger never posted on the group
    d = diagnose(ev)
    assert d.rule_id != "thread_order" and d.culprit_basis != "thread_order", d.summary


def test_every_mismatch_kind_has_its_words_and_advice() -> None:
    assert set(KIND_PHRASE) == set(KIND_ADVICE) == set(MismatchKind)


@pytest.mark.parametrize("name, culprit", [
    pytest.param(n, c, id=f"{n}-{c}") for n, (_, asym) in CASES.items()
    for c in ((0, 1) if asym else (0,))])
def test_the_rule_fires_on_its_evidence(name: str, culprit: int) -> None:
    build, _ = CASES[name]
    ev, culprits = build(culprit)
    d = diagnose(ev)
    assert d.rule == name, f"{d.rule}: {d.summary}"
    assert d.rule_id == next(r.id for r in RULES if r.name == name)
    assert d.culprit_ranks == culprits, d.summary
    assert d.summary


@pytest.mark.parametrize("name", sorted(DUMP_CASES))
def test_the_rule_fires_on_its_dumps(name: str, tmp_path: Path) -> None:
    ev, culprits = DUMP_CASES[name](tmp_path)
    d = diagnose(ev)
    assert d.rule == name, f"{d.rule}: {d.summary}"
    if culprits:
        assert set(culprits) <= set(d.culprit_ranks), d.summary


def test_analyze_reads_the_same_evidence(tmp_path: Path) -> None:
    """The dump cases' evidence is what `analyze` itself diagnoses."""
    ev, _ = _all_completed(tmp_path)
    assert analyze_paths([tmp_path], force=False).rule == diagnose(ev).rule


def test_ranks_gone_agree_in_number() -> None:
    """Fuzz seed 8123057 job 089 said "Ranks 0, 1, 3 is gone … waited for it"."""
    gone = [RankEvidence(rank=r, alive=False) for r in (0, 1)]
    ev = _ev(*gone, _stuck(2, _in("all_reduce", 30)), _stuck(3, _in("all_reduce", 30)))
    d = diagnose(ev)
    assert d.summary.startswith("Ranks 0, 1 are gone (no process, no exception, no exit code)")
    assert "waited for them." in d.summary


@pytest.mark.parametrize("lone", [0, 2])
def test_stacks_alone_a_branch_of_every_rank_is_the_extra_a_subgroup_branch_is_not(
        tmp_path: Path, lone: int) -> None:
    """From stacks alone the ranks inside a rank branch are behind those past it. Where the
    branch's collective is the default group's (``if rank == R: all_reduce(x)``), the ranks
    inside it posted the extra; where it is a group's of its own (``if rank in members:
    all_reduce(x, group=sub)``), its members would complete it together, so a member is
    missing, among those past it: the order names them (fuzz 90210 job 63, both ways)."""
    job = tmp_path / "train.py"
    job.write_text("import torch.distributed as dist\n"
                   "rank = dist.get_rank()\n"
                   "if rank == R:\n"
                   "    dist.all_reduce(x)  # line 4: every rank's\n"
                   "if rank in members:\n"
                   "    dist.all_reduce(x, group=sub)  # line 6: sub's\n"
                   "dist.barrier()  # line 7\n")

    def at(r: int, op: str, line: int) -> RankEvidence:
        return _stuck(r, _stack((TORCH, 9, op), (str(job), line, "<module>")))

    others = [r for r in range(3) if r != lone]
    ev = _ev(at(lone, "all_reduce", 4), *(at(r, "barrier", 7) for r in others))
    d = diagnose(ev)
    assert (d.rule, d.culprit_ranks) == ("desync from stacks", [lone]), d.summary
    ev = _ev(*(at(r, "all_reduce", 6) for r in others), at(lone, "barrier", 7))
    d = diagnose(ev)
    assert (d.rule, d.culprit_ranks) == ("desync from stacks", [lone]), d.summary


@pytest.mark.parametrize("skipper, waiter", [(3, 2), (2, 3)])
def test_stacks_alone_ranks_on_a_group_of_their_own_are_not_counted(
        tmp_path: Path, skipper: int, waiter: int) -> None:
    """Expert groups [0,1] and [2,3]: one rank skips its group's all-reduce and waits in the
    barrier with the other group, whose members completed theirs; its partner waits alone
    in the all-reduce. Three against one says nothing (the three are not at one collective
    of one group): the ranks past the all-reduce are named, never the one waiting in it."""
    job = tmp_path / "train.py"
    job.write_text("import torch.distributed as dist\n"
                   "def reduce(t):\n"
                   "    dist.all_reduce(t, group=mine)  # line 3\n"
                   "if rank != SKIP:\n"
                   "    reduce(t)  # line 5\n"
                   "dist.barrier()  # line 6\n")
    ranks = [_stuck(r, _stack((TORCH, 9, "all_reduce"), (str(job), 3, "reduce"),
                              (str(job), 5, "<module>")) if r == waiter
                    else _stack((TORCH, 9, "barrier"), (str(job), 6, "<module>")))
             for r in range(4)]
    d = diagnose(_ev(*ranks))
    assert d.verdict == "desync" and skipper in d.culprit_ranks, d.summary
    assert waiter not in d.culprit_ranks and d.culprit_basis != "majority", d.summary


def test_rule_ids_are_stable_and_the_docs_tables_are_the_codes() -> None:
    """Every rule has one id, the JSON carries it, and the README's and DESIGN's tables are
    the one table in the code (scripts/rule_table.py writes them)."""
    import importlib.util

    from moe_hang.analysis.diagnosis import Diagnosis

    ids = [r.id for r in RULES]
    assert len(set(ids)) == len(ids) and all(i.isidentifier() for i in ids)
    spec = importlib.util.spec_from_file_location(
        "rule_table", Path(__file__).resolve().parents[2] / "scripts" / "rule_table.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for doc in mod.DOCS:
        text = doc.read_text()
        assert mod.with_table(text) == text, f"{doc.name}: run python scripts/rule_table.py"
    d = Diagnosis.from_dict({"verdict": "hang", "summary": "x", "rule": "r", "rule_id": "held"})
    assert d.to_dict()["rule_id"] == "held"
