"""moe_hang.commands.multinode, without processes: the global analysis from the nodes'
summaries, what is not known is not blamed, a verdict as data, and finding jobs on a host.

The heartbeats are the real ones of the issue's case (tests/e2e/jobs/expert_skip.py on two
torchrun agents: rank 2 waits in its expert group's all-gather, ranks 0, 1 and 3 in the loss
all-reduce), hosts renamed vm-0 and vm-1."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, assert_no_survivors, captured, relocated

from moe_hang.analysis.diagnosis import Certainty, CulpritBasis, Diagnosis, Verdict
from moe_hang.analysis.rules import diagnose
from moe_hang.commands import multinode
from moe_hang.commands.diagnose import pick_job
from moe_hang.errors import MoeHangError
from moe_hang.evidence.load import load_capture
from moe_hang.evidence.model import Evidence, Unreached
from moe_hang.evidence.stacks import is_library_frame
from moe_hang.evidence.vocab import JobState
from moe_hang.probe.layout import RunLayout
from moe_hang.runtime import coord
from moe_hang.runtime.coord import CaptureRequest, NodeSummary
from moe_hang.runtime.discover import find_jobs
from moe_hang.settings import Settings

pytestmark = pytest.mark.timeout(60)


def _heartbeats(fixtures: Path) -> dict[int, dict[str, Any]]:
    raw = (fixtures / "multinode" / "expert_skip_heartbeats.json").read_text()
    return {int(r): hb for r, hb in json.loads(raw.replace("@ROOT@", str(ROOT))).items()}


def _summaries(fixtures: Path) -> dict[str, NodeSummary]:
    hbs = _heartbeats(fixtures)
    out = {}
    for n in (0, 1):
        mine = {r: hb for r, hb in hbs.items() if r // 2 == n}
        s = coord.summarize_heartbeats(mine, node=str(n), moving=dict.fromkeys(mine, False),
                                       kind="capture")
        s.groups = {"0": [0, 1, 2, 3], str(n + 1): [2 * n, 2 * n + 1]}
        out[str(n)] = s
    return out


def _global(summaries: dict[str, NodeSummary], unknown: list[int]) -> tuple[Any, Evidence]:
    ev = Evidence(ranks={}, world_size=4, job=JobState.STALLED)
    multinode.merge_remote(ev, summaries)
    if unknown:
        ev.unreached = Unreached(unknown, local_world=2,
                                 hosts={n: s.host for n, s in summaries.items()} | {"1": "vm-1"})
    return diagnose(captured(ev)), ev  # each node reads its ranks' source, as a capture does


def test_summaries_of_both_nodes_name_the_rank_that_skipped(fixtures: Path) -> None:
    sums = _summaries(fixtures)
    # what travels between nodes is the compact summary: round-trip it through the encoding
    sums = {n: NodeSummary.decode(s.encode()) or s for n, s in sums.items()}
    assert sums["1"].groups == {"0": [0, 1, 2, 3], "2": [2, 3]}  # the probe's group lists
    diag, ev = _global(sums, [])
    assert sorted(ev.ranks) == [0, 1, 2, 3]
    assert diag.verdict == Verdict.DESYNC and diag.culprit_ranks == [3]
    assert {r.rank: r.host for r in diag.ranks} == {0: "vm-0", 1: "vm-0", 2: "vm-1", 3: "vm-1"}


def test_waiting_on_an_unknown_node_blames_nobody(fixtures: Path) -> None:
    """Node 1's watcher never answered: ranks 0 and 1 only wait, and the verdict says for
    whom and where to look."""
    diag, _ = _global({"0": _summaries(fixtures)["0"]}, [2, 3])
    assert diag.culprit_ranks == []
    assert diag.certainty == Certainty.UNCERTAIN
    assert diag.summary.startswith("Ranks 0, 1 wait in all_reduce default_pg#9 for ranks 2, 3 "
                                   "on node vm-1: run moe-hang there, or `moe-hang analyze` "
                                   "both captures"), diag.summary
    unknown = [r for r in diag.ranks if r.rank in (2, 3)]
    assert [r.state for r in unknown] == ["unknown", "unknown"]
    assert any("ranks 2, 3 unknown" in e for e in diag.evidence)


def test_a_fully_known_group_that_disagrees_stands(fixtures: Path) -> None:
    """Node 0 unknown, but ranks 2 and 3 make up their expert group: rank 2 waits in its
    all-gather, rank 3 never posted it. That is rank 3's doing whatever node 0 does."""
    diag, _ = _global({"1": _summaries(fixtures)["1"]}, [0, 1])
    assert diag.culprit_ranks == [3], diag.summary
    assert {r.rank: r.state for r in diag.ranks}[0] == "unknown"


def _capture(fixtures: Path, tmp: Path, node: int) -> Path:
    """One node's real capture (processes, heartbeats, recorder dumps, py-spy stacks), with
    this checkout's paths."""
    src = fixtures / "multinode" / f"node{node}"
    dst = tmp / f"node{node}"
    shutil.copytree(src, dst)
    for p in dst.rglob("*.json"):
        p.write_text(p.read_text().replace("@ROOT@", str(ROOT)))
    for p in dst.rglob("*.txt"):
        p.write_text(p.read_text().replace("@ROOT@", str(ROOT)))
    return dst


@pytest.mark.parametrize(("analyst", "world"), [(0, 4), (1, 4), (0, 6), (1, 6)])
def test_one_nodes_capture_and_the_others_summary(fixtures: Path, tmp_path: Path,
                                                  analyst: int, world: int) -> None:
    """What the analysing node does: its own capture (py-spy, recorder dumps) plus the
    other node's capture summary, recent collectives included. World 6: a third node never
    answered; the expert group of ranks 2 and 3 is all known, so rank 3 is still the one."""
    other = 1 - analyst
    ev = load_capture(_capture(fixtures, tmp_path, analyst), world=world, job="stalled")
    summary = multinode.capture_summary(RunLayout(_capture(fixtures, tmp_path, other)),
                                        str(other), f"vm-{other}",
                                        moving=dict.fromkeys(range(4), False), alive=None)
    assert summary.capture is not None
    summary = NodeSummary.decode(summary.encode())  # as it travels
    assert summary is not None
    assert multinode.merge_remote(ev, {str(other): summary}, into=tmp_path / "nodes") == \
        [2 * other, 2 * other + 1]
    if unknown := multinode.unreached_ranks(world, ev.ranks):
        ev.unreached = Unreached(unknown, local_world=2)
    diag = diagnose(ev)
    assert diag.verdict == Verdict.DESYNC and diag.culprit_ranks == [3], diag.summary
    if world == 6:
        assert [r.state for r in diag.ranks if r.rank >= 4] == ["unknown", "unknown"]


def test_diagnosis_round_trips_through_json(fixtures: Path) -> None:
    """Every node prints the verdict another node analysed: from its JSON, unchanged."""
    cases = [diagnose(load_capture(fixtures / name, **kw)) for name, kw in (
        ("ragged_gloo", {}), ("op_mismatch", {}), ("healthy", {"job": "completed"}))]
    cases.append(_global(_summaries(fixtures), [])[0])
    cases.append(_global({"0": _summaries(fixtures)["0"]}, [2, 3])[0])
    for diag in cases:
        d = diag.to_dict()
        back = Diagnosis.from_dict(json.loads(json.dumps(d)))
        assert back.to_dict() == d


def test_request_kinds() -> None:
    def req(reason: str) -> CaptureRequest:
        return CaptureRequest("x", reason, "0", "h", 0.0)

    assert multinode.request_kind(req("stalled: no progress for 3 s")) == "stalled"
    assert multinode.request_kind(req("desync: ranks wait in mismatched ...")) == "desync"
    assert multinode.request_kind(req("final: no progress for 300 s")) == "final"
    assert multinode.request_kind(req("anything else")) == "requested"
    assert multinode.request_kind(None) == "requested"


def test_plan_only_for_multi_node_jobs_or_a_shared_dir(tmp_path: Path) -> None:
    one = ["torchrun", "--nproc-per-node", "2", "train.py"]
    two = ["torchrun", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "head:29400", "--rdzv-id", "job7", "train.py"]
    assert multinode.plan(one, None, env={}) is None
    p = multinode.plan(two, None, env={"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0"})
    assert p is not None and p.endpoint is not None
    assert (p.endpoint.host, p.endpoint.port, p.run) == ("head", 29400, "job7-slurm42.0")
    d = multinode.plan(one, tmp_path, env={})
    assert d is not None and d.shared_dir == tmp_path.resolve() and d.run == "none"
    with pytest.raises(MoeHangError, match="not a directory"):
        multinode.plan(two, tmp_path / "nope", env={})


LAUNCHER = """
import os, subprocess, sys, time
procs = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', sys.argv[2]],
                          env=dict(os.environ, RANK=str(r), WORLD_SIZE='2', LOCAL_RANK=str(r),
                                   LOCAL_WORLD_SIZE='2', MASTER_ADDR='127.0.0.1',
                                   MASTER_PORT=sys.argv[1], TORCHELASTIC_RUN_ID=sys.argv[2]))
         for r in range(2)]
open(sys.argv[3], 'w').write('up')
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_diagnose_without_a_pid_finds_the_jobs_on_this_host(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One job: it is the one; two: both listed, and a PID is asked for. A "launcher" here is
    a process whose command line names torch.distributed.run, as torchrun's does. (Other
    engineers' jobs on this host are left out of what pick_job sees.)"""
    from moe_hang.commands import diagnose as diagnose_cmd

    tag = f"findjobs-{os.getpid()}-{time.time_ns()}"
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    procs: list[subprocess.Popen[bytes]] = []

    def ours() -> list[Any]:
        return [j for j in find_jobs() if j.agent in {p.pid for p in procs}]

    monkeypatch.setattr(diagnose_cmd, "find_jobs", ours)
    try:
        with pytest.raises(MoeHangError, match="no distributed PyTorch job on this host"):
            pick_job()
        for i, port in enumerate((29991, 29992)):
            up = tmp_path / f"up{i}"
            procs.append(subprocess.Popen(
                [sys.executable, str(script), str(port), tag, str(up), "torch.distributed.run"],
                start_new_session=True))
            deadline = time.monotonic() + 30
            while not up.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            mine = ours()
            assert [j.agent for j in mine] == [p.pid for p in procs]
            assert all(j.ranks == [0, 1] and j.world_size == 2 for j in mine)
        with pytest.raises(MoeHangError) as err:
            pick_job()
        text = str(err.value)
        assert text.startswith("2 distributed jobs on this host; give the PID of one:")
        assert all(f"PID {p.pid}  torchrun agent, ranks 0-1 of 2" in text for p in procs)
        _end(procs.pop())
        assert pick_job() == procs[0].pid
    finally:
        for p in procs:
            _end(p)
        assert_no_survivors(tag)


def _end(p: subprocess.Popen[bytes]) -> None:
    """The fake launcher and its fake ranks, by pid."""
    import psutil

    with contextlib.suppress(psutil.Error):
        for c in psutil.Process(p.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                c.kill()  # a zombie until its parent goes: not waited for
    p.kill()
    p.wait(5)


# ----------------------------------------------------------------------------- issue 19


def test_a_remote_rank_that_raised_is_the_root_cause_anywhere(tmp_path: Path) -> None:
    """Node 1's capture carries rank 2's exception record and that its probe holds it: node
    0, analysing with only that capture, names rank 2, at the line it raised."""
    layout = RunLayout(tmp_path)
    layout.ranks_dir.mkdir()
    for r in (2, 3):
        (layout.rank(r).heartbeat).write_text(json.dumps({
            "rank": r, "pid": 100 + r, "host": "vm-1", "world": 4, "local_rank": r - 2,
            "local_world": 2, "time": time.time(), "beat": 3, "held": r == 2,
            "pg_status": {"0": {"enqueued": 9, "completed": 8 if r == 3 else 9}},
            "main_frame": [["/job/mn_crash.py", 27, "<module>"]]}))
    layout.rank(2).error.write_text(json.dumps({
        "type": "ValueError", "message": "corrupt shard 17 on node 1", "time": 1.0,
        "restart": None, "frames": [["/job/mn_crash.py", 17, "load_shard"],
                                    ["/job/mn_crash.py", 27, "<module>"]]}))
    s = multinode.capture_summary(layout, "1", "vm-1", moving={2: False, 3: False},
                                  alive={2: True, 3: True})
    back = NodeSummary.decode(s.encode())
    assert back is not None and next(r for r in back.ranks if r.rank == 2).held
    ev = Evidence(ranks={}, world_size=4)
    assert multinode.merge_remote(ev, {"1": back}, into=tmp_path / "nodes") == [2, 3]
    assert ev.ranks[2].error is not None and ev.ranks[2].error.frames[0].line == 17
    assert ev.ranks[2].stack_source == "exception traceback (held for the capture)"
    d = diagnose(ev)
    assert d.rule == "root-cause exception" and d.culprit_ranks == [2], d.summary
    assert d.summary.startswith("Rank 2 raised ValueError: corrupt shard 17 on node 1 at ")


def test_ranks_without_a_local_world_are_a_block() -> None:
    assert multinode.block_of([2, 3]) == "1" and multinode.block_of([0, 1, 2, 3]) == "0"
    assert multinode.block_of([1, 2]) is None and multinode.block_of([0, 2]) is None
    assert multinode.block_of([]) is None


def test_a_job_without_torchrun_plans_on_its_ranks_store() -> None:
    """srun/mpirun: MASTER_ADDR:MASTER_PORT (here from the watcher's own environment: no
    rank pid given), the run key from the port; nothing without them."""
    p = multinode.plan_from_ranks([], {"MASTER_ADDR": "node0", "MASTER_PORT": "29500",
                                       "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3"})
    assert p is not None and p.endpoint is not None and p.shared_dir is None
    assert (p.endpoint.host, p.endpoint.port) == ("node0", 29500)
    assert p.run == "env-29500-slurm77.3"
    assert multinode.plan_from_ranks([], {"MASTER_ADDR": "node0"}) is None
    assert coord.launches_torchrun(["torchrun", "x.py"])
    assert coord.launches_torchrun([sys.executable, "-m", "torch.distributed.run", "x.py"])
    assert not coord.launches_torchrun(["srun", "python", "x.py"])
    assert coord.torchrun_max_restarts(["torchrun", "--max-restarts=2", "x.py"]) == 2
    assert coord.torchrun_max_restarts(["torchrun", "x.py"], {"PET_MAX_RESTARTS": "1"}) == 1
    assert coord.torchrun_max_restarts(["python", "x.py", "--max-restarts", "3"], {}) == 0


def _two_node_view(fixtures: Path, tmp_path: Path, run: str, analyst: str, world: int = 2,
                   recorded: str = "/work/main/runs/fuzz-8123057/jobs",
                   jobs: str = "fuzz8123057_jobs") -> Evidence:
    """What the analysing node holds in a capture round: its own capture, and the other
    node's capture summary as it travels through the store."""
    capture = relocated(fixtures / run, tmp_path / "run", recorded, str(fixtures / jobs))
    other = "node1" if analyst == "node0" else "node0"
    ev = load_capture(capture / analyst, world=world, job="stalled")
    summary = multinode.capture_summary(RunLayout(capture / other), "1", "vm-b",
                                        moving=dict.fromkeys(range(world), False), alive=None)
    decoded = NodeSummary.decode(summary.encode())
    assert decoded is not None
    mine = set(ev.ranks)
    assert multinode.merge_remote(ev, {"1": decoded}, into=tmp_path / "nodes") == \
        sorted(set(range(world)) - mine)
    return ev


@pytest.mark.parametrize("analyst", ["node0", "node1"])
def test_a_rank_only_checkpoint_is_advised_as_such_not_as_an_fsdp_skip(
        fixtures: Path, tmp_path: Path, analyst: str) -> None:
    """Fuzz seed 8123057 job 099 (FSDP2 MoE, two nodes of 4 ranks): rank 0 alone calls
    save_checkpoint() under `if FAULTY and step == FAULT_STEP:` and waits in its barrier
    while the others all-gather the next block's parameters. The culprit was right; the
    advice was FSDP's "run a skipped block on a dummy input". The branch is the cause."""
    ev = _two_node_view(fixtures, tmp_path, "checkpoint_two_nodes", analyst, world=8,
                        recorded="/work/main/runs/fuzz-8123057-after/jobs")
    diag = diagnose(ev)
    assert (diag.verdict, diag.culprit_ranks) == (Verdict.DESYNC, [0]), diag.summary
    assert diag.fix.startswith("Rank 0 took `if FAULTY and step == FAULT_STEP`, a branch"), \
        diag.fix
    assert "save_checkpoint" in diag.fix and "dummy input" not in diag.fix


@pytest.mark.parametrize(("run", "culprit"), [("size_two_nodes_0", 0), ("size_two_nodes_1", 1)])
@pytest.mark.parametrize("analyst", ["node0", "node1"])
def test_a_size_abort_on_the_other_node_is_the_same_desync_from_either_node(
        fixtures: Path, tmp_path: Path, run: str, culprit: int, analyst: str) -> None:
    """Fuzz seed 8123057 job 008 (FSDP2, two nodes of one rank; the faulty rank all-reduces 6
    floats where every step had 4; gloo aborts its peer with SIGABRT), mirrored, from either
    node. The dead rank's node sends its faulthandler stack and the job log's size abort with
    its summary, and the survivor's recent collectives reach two steps back: a size desync
    on both nodes (it was "rank 1 is gone, no exit code"), and the rank whose collective
    broke the shape it always had is the likely culprit (gloo's byte counts are a ring
    chunk's: they say nothing of the dead rank's tensor, so it was "ambiguous" or worse)."""
    ev = _two_node_view(fixtures, tmp_path, run, analyst)
    assert ev.size_abort is not None
    diag = diagnose(ev)
    assert (diag.verdict, diag.culprit_ranks) == (Verdict.DESYNC, [culprit]), diag.summary
    assert diag.rule == "gloo size abort" and diag.certainty == Certainty.LIKELY
    assert diag.summary.startswith("Ranks posted different sizes at seq 50 of default_pg")
    assert "this is likely, not certain" in diag.summary
    assert "the same number of bytes — the same shape and dtype" in diag.fix, diag.fix
    assert "not recorded, gloo aborted it first" in diag.fix


@pytest.mark.parametrize(("run", "culprit"), [("lock_two_nodes_0", 1), ("lock_two_nodes_1", 0)])
@pytest.mark.parametrize("analyst", ["node0", "node1"])
def test_a_remote_rank_stuck_on_a_lock_is_idle_not_unknown(fixtures: Path, tmp_path: Path,
                                                            run: str, culprit: int,
                                                            analyst: str) -> None:
    """Fuzz seed 8123057 job 006 (two nodes of one rank; one rank deadlocked on a thread lock
    outside every collective, the other in the all-gather), mirrored, analysed from either
    node: the remote rank's summary has the probe's sample of its main thread and "not
    moving", no py-spy stack. It is idle at the lock, and the culprit — the live global
    verdict said "not enough evidence: states known for rank 0 only"."""
    diag = diagnose(_two_node_view(fixtures, tmp_path, run, analyst))
    assert (diag.verdict, diag.culprit_ranks) == (Verdict.HANG, [culprit]), diag.summary
    assert diag.rule == "stalled outside collectives"
    assert f"Rank {culprit} is outside any collective" in diag.summary
    assert "fuzz8123057_006_lock_plain.py:56 checkpoint_state" in diag.summary


@pytest.mark.parametrize(("run", "culprit"), [("order_swap_two_nodes_0", 0),
                                              ("order_swap_two_nodes_1", 1)])
@pytest.mark.parametrize("analyst", ["node0", "node1"])
def test_the_rank_on_the_singled_out_branch_is_the_culprit_not_the_one_on_its_else(
        fixtures: Path, tmp_path: Path, run: str, culprit: int, analyst: str) -> None:
    """Fuzz seed 8123057 job 044 (FSDP2, two nodes of one rank): under `if FAULTY and step ==
    FAULT_STEP:` the faulty rank gathers metrics before reducing the loss, its `else` reduces
    first; mirrored, from either node. The all-reduce the other rank waits in runs under
    `if not (...)` — every rank but the faulty one — so it is not an extra of that rank (it
    was blamed, basis source); the faulty one is."""
    diag = diagnose(_two_node_view(fixtures, tmp_path, run, analyst))
    assert (diag.verdict, diag.culprit_ranks) == (Verdict.DESYNC, [culprit]), diag.summary
    # its order across the two groups breaks every earlier step's (history, the strongest
    # rung); the advice names the branch that did it
    assert diag.culprit_basis == "history"
    assert f"Rank {culprit} posts the " in diag.fix, diag.fix
    assert "`if FAULTY and step == FAULT_STEP`" in diag.fix
    assert "in the same order" in diag.fix


def _monitor(t_up: float | None, sampled: bool, heartbeats: dict) -> Any:
    from types import SimpleNamespace
    return SimpleNamespace(out=SimpleNamespace(t_up=t_up, sampled=sampled,
                                               heartbeats=heartbeats, rank_pids={}))


def test_a_node_up_by_sampling_waits_for_its_ranks_heartbeats(fixtures: Path,
                                                              tmp_path: Path) -> None:
    """A loaded machine: the ranks are up before their probes, so the monitor samples them
    (up, no heartbeats). The node is not named then (every watcher of the job would be its
    host's name, and take the others' records for its own); once the probes' beats are in,
    it is node 1 with ranks 2 and 3."""
    from moe_hang.evidence.heartbeats import read_heartbeats

    layout = RunLayout(tmp_path / "run")
    layout.ranks_dir.mkdir(parents=True)
    for r, hb in _heartbeats(fixtures).items():
        if r // 2 == 1:
            (layout.ranks_dir / f"rank{r}.hb.json").write_text(json.dumps(hb))
    shared = tmp_path / "shared"
    shared.mkdir()
    plan = multinode.plan(["python", "train.py"], shared, env={})
    assert plan is not None
    node = multinode.Node(plan, layout, lambda _text: None, timings=Settings(),
                          hold_s=Settings().hold_s)
    assert not node.tick(_monitor(time.time(), True, {}))
    assert (node.node, node.local_ranks, node.world) == ("", [], None)
    node.tick(_monitor(time.time(), False, read_heartbeats(layout.ranks_dir)))
    assert (node.node, node.local_ranks, node.world) == ("1", [2, 3], 4)


def test_a_job_not_started_by_torchrun_is_judged_by_its_heartbeats_not_its_sampling() -> None:
    """srun or mpirun: whether the job spans nodes is decided once, on the ranks' heartbeats;
    ranks up by sampling (probes late) leave it open, or it would stay one node for good."""
    from moe_hang.commands.multinode.peers import SpreadLater

    looked: list[int] = []

    def join(mon: Any) -> None:
        looked.append(len(mon.out.heartbeats))
        return None

    spread = SpreadLater(join)  # type: ignore[arg-type]
    spread.tick(_monitor(None, False, {}))
    spread.tick(_monitor(time.time(), True, {}))
    assert looked == []
    spread.tick(_monitor(time.time(), False, {2: object(), 3: object()}))
    spread.tick(_monitor(time.time(), False, {2: object(), 3: object()}))
    assert looked == [2]


def _sigterm_after_beat(src: Path, tmp_path: Path) -> RunLayout:
    """A node's run directory with rank 1's last beat and its probe's dump of every thread."""
    layout = RunLayout(tmp_path / "run")
    layout.ranks_dir.mkdir(parents=True)
    for name in ("rank1.hb.json", "rank1.stack.txt"):
        (layout.ranks_dir / name).write_text(
            (src / name).read_text().replace("@ROOT@", str(ROOT)))
    return layout


@pytest.mark.parametrize("dump_at, reason, line", [(0.1, "sigterm", 55), (-0.1, "sigterm", 55),
                                                   (0.1, "exception", 15)],
                         ids=["dump_after_the_beat", "dump_before_the_beat",
                              "dump_of_an_exception"])
def test_a_remote_rank_is_the_evidence_its_own_node_reads(
        fixtures: Path, tmp_path: Path, dump_at: float, reason: str, line: int) -> None:
    """A recorded rank (fuzz 4071993 job 44): its last beat sampled init_process_group, the
    SIGTERM dump a tenth of a second later the step's all-reduce at line 55. Through its
    node's capture, the analysing node reads exactly what that node reads of it: the dump
    and the beat (which is fresher the analysis weighs), not the dump of an exception (the
    excepthook's stack; its traceback decides); its threads, ids and all (a posting thread
    that is gone will never post again); the same notes. (The summaries this replaced chose
    between beat and dump on their own, unlike the local loader.)"""
    src = fixtures / "multinode" / "sigterm_after_beat"
    layout = _sigterm_after_beat(src, tmp_path)
    beat = json.loads((layout.ranks_dir / "rank1.hb.json").read_text())["time"]
    marker = json.loads((src / "rank1.dump.json").read_text())
    (layout.ranks_dir / "rank1.dump.json").write_text(
        json.dumps(marker | {"time": beat + dump_at, "reason": reason}))
    s = multinode.capture_summary(layout, "1", "vm", moving=None, alive={1: False})
    back = NodeSummary.decode(s.encode())
    assert back is not None
    ev = Evidence(ranks={}, world_size=2)
    assert multinode.merge_remote(ev, {"1": back}, into=tmp_path / "nodes") == [1]
    here = load_capture(layout.root).ranks[1]
    there = ev.ranks[1]
    assert (there.threads, there.stack_source, there.heartbeat, there.notes) == \
        (here.threads, here.stack_source, here.heartbeat, here.notes)
    if reason == "sigterm":  # the dump's, whichever is fresher (the analysis weighs them)
        assert there.threads and there.threads[0].frames[-1].line == line
        assert 0x00007f5600871b80 in {int(t.thread_id or "0", 0) for t in there.threads}
    else:  # the excepthook's dump is not where it is: its beat's sample
        assert there.threads is None and there.heartbeat is not None
        assert there.heartbeat.main_frame and there.heartbeat.main_frame[-1][1] == line


@pytest.mark.parametrize(("run", "culprit"), [("thread_two_nodes_0", 2),
                                              ("thread_two_nodes_1", 5)])
@pytest.mark.parametrize("analyst", ["node0", "node1"])
def test_a_metrics_threads_collective_is_at_its_line_from_either_node(
        fixtures: Path, tmp_path: Path, run: str, culprit: int, analyst: str) -> None:
    """Fuzz seed 7319044 job 002 (a 2x3 mesh on two nodes, mirrored): the culprit's metrics
    thread posts one all-reduce too many on its own group and waits in it; its main thread
    waits in ``LOGGER.join()`` (:76). Analysed from the other node, the culprit's evidence
    is its summary: its main thread's sample, and the recorder's entries (no frames). The
    line is the thread's all-reduce (:49), which its node read off that thread's stack; a
    main thread's stack never places a collective another thread posted."""
    ev = _two_node_view(fixtures, tmp_path, run, analyst, world=6,
                        recorded="/tmp/fz2b/jobs", jobs="fuzz7319044_jobs")
    diag = diagnose(ev)
    assert (diag.verdict, diag.culprit_ranks) == (Verdict.DESYNC, [culprit]), diag.summary
    (rc,) = [r for r in diag.ranks if r.rank == culprit]
    assert rc.callsite is not None and (rc.callsite.line, rc.callsite.function) == \
        (49, "log_metrics"), diag.summary
    assert rc.collective is not None and rc.collective.op == "all_reduce"


@pytest.mark.parametrize("analyst", ["node0", "node1"])
def test_a_remote_ranks_collective_its_group_completed_is_not_pending(
        fixtures: Path, tmp_path: Path, analyst: str) -> None:
    """Fuzz seed 58213907 job 070 (a 2x4 mesh on two nodes): a remote rank's summary carries
    an entry of its posted log copied before it completed (``retired: false``) while its
    group's count at the capture says it completed. That stale "pending" was the rank's
    current collective, and the divergence showed the rank with no line. A group completes
    in order: its count is the rank's latest word."""
    ev = _two_node_view(fixtures, tmp_path, "step_shift_two_nodes_0", analyst, world=8,
                        recorded="/work/wt-fuzz/runs/fuzz-58213907/jobs",
                        jobs="fuzz58213907_jobs")
    diag = diagnose(ev)
    assert diag.culprit_ranks == [4], diag.summary
    fd = diag.first_divergence
    assert fd is not None
    lines = {r: c.callsite.line if c is not None and c.callsite is not None else None
             for r, c in fd.per_rank.items()}
    assert lines == {**dict.fromkeys([0, 1, 2, 3, 5, 6, 7], 55), 4: None}, lines


@pytest.mark.parametrize(("run", "culprit"), [("thread_skip_two_nodes_0", 0),
                                              ("thread_skip_two_nodes_1", 1)])
@pytest.mark.parametrize("analyst", ["node0", "node1"])
def test_a_metrics_thread_one_short_on_one_of_two_nodes_is_named_by_its_rate(
        fixtures: Path, tmp_path: Path, run: str, culprit: int, analyst: str) -> None:
    """Fuzz seed 61120905 job 010 (DTensor, one rank on each of two nodes, mirrored): the
    culprit's main loop hands its metrics thread no item at step 3, so its thread ends after
    four all-reduces and its main thread waits in the final barrier; the other's thread waits
    in its fifth, its main thread in ``LOGGER.join()``. One against one: the rate decides
    (each thread's j-th all-reduce within a lap of the main loop's j-th, on both ranks; the
    culprit's ended one short), from either node (was: both named, "which one, this capture
    does not decide")."""
    ev = _two_node_view(fixtures, tmp_path, run, analyst, world=2,
                        recorded="/work/wt-f/runs/fuzz-61120905/jobs", jobs="fuzz61120905_jobs")
    diag = diagnose(ev)
    assert (diag.verdict, diag.culprit_ranks, diag.culprit_basis) == (
        Verdict.DESYNC, [culprit], CulpritBasis.HISTORY), diag.summary
    assert "posted 4 for its main loop's 5 laps (one fewer)" in diag.fix, diag.fix
    assert ":53 log_metrics" in diag.fix, diag.fix


@pytest.mark.parametrize(("run", "culprit", "analyst"), [("fsdp_skip_two_nodes_0", 2, "node0"),
                                                         ("fsdp_skip_two_nodes_1", 0, "node1")])
def test_an_fsdp_module_skip_is_advised_as_such_from_user_frames_only(
        fixtures: Path, tmp_path: Path, run: str, culprit: int, analyst: str) -> None:
    """Fuzz seed 73920461 job 072 (FSDP2, two nodes of two ranks, mirrored): the culprit's
    forward skips block 1 (``continue`` in the block loop); gloo aborts it. The analysing
    node's evidence of the pending all-gathers kept user frames only (a node's summary, a
    posted log): the stack of each rank, inside that same call, says it is FSDP's unshard.
    The advice is the module skip (was: "left the loop ... DistributedSampler")."""
    ev = _two_node_view(fixtures, tmp_path, run, analyst, world=4,
                        recorded="/work/wt-f2/runs/fuzz-73920461/jobs", jobs="fuzz73920461_jobs")
    for e in ev.ranks.values():  # as a summary or a posted log has them: user frames only
        for c in [*(e.fr.entries if e.fr else []), *e.posted_log]:
            c.frames = [f for f in c.frames if not is_library_frame(f)]
    diag = diagnose(ev)
    assert (diag.verdict, diag.culprit_ranks) == (Verdict.DESYNC, [culprit]), diag.summary
    assert diag.fix.startswith("FSDP all-gathers a module's parameters"), diag.fix
    assert "left the loop" not in diag.fix


@pytest.mark.parametrize(("run", "left"), [("early_exit_p2p_two_nodes_0", 3),
                                           ("early_exit_p2p_two_nodes_1", 1)])
@pytest.mark.parametrize("analyst", ["node0", "node1"])
def test_a_gloo_ranks_count_of_ops_is_not_its_count_of_collectives(
        fixtures: Path, tmp_path: Path, run: str, left: int, analyst: str) -> None:
    """Fresh seed 70423118 job 027 (a 4-stage pipeline on two nodes, mirrored): a rank leaves
    at step 2 before its recv; the others fail or wait in step 2's all-reduce (#5). Its exit
    beat's counts are gloo's, of ops: its two recvs with its four collectives, 6. Read as
    collectives, it had posted #5, "answered" the wait, and the verdict was the others'
    communication errors with no culprit. Brought back to collectives by how far its newest
    collective's op id ran ahead of its seq (2): 4, it left them waiting."""
    ev = _two_node_view(fixtures, tmp_path, run, analyst, world=4,
                        recorded="/work/wt-c/runs/fuzz-70423118/jobs", jobs="fuzz70423118_jobs")
    diag = diagnose(ev)
    assert (diag.verdict, diag.culprit_ranks, diag.culprit_basis) == (
        Verdict.RANK_DIED, [left], CulpritBasis.EXITED), diag.summary
