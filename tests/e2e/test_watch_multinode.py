"""Multi-node ``watch``: one ``moe-hang watch`` per torchrun agent, as srun starts them, and
one verdict for the whole job from one coordinated capture.

The job (tests/e2e/jobs/expert_skip.py): an expert group per node; global rank 3 routed no
token and skips its group's all-gather, so rank 2 waits in that all-gather while every other
rank waits in the loss all-reduce. Agents meet under c10d rendezvous on 127.0.0.1 (which agent
gets which ranks is torch's race), or in network namespaces with host names of their own
(root only: skipped elsewhere, the namespaces are removed by the test that made them)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import (
    JOBS,
    ROOT,
    assert_no_survivors,
    free_port,
    job_env,
    line_of,
    moe_hang_argv,
    processes_with_env,
    run_cli,
    wait_files,
)

from moe_hang.probe.layout import RunLayout

pytestmark = [pytest.mark.e2e]

SCRIPT = str(JOBS / "expert_skip.py")
PY = sys.executable


def _torchrun(nnodes: int, endpoint: str, rdzv_id: str) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc_per_node",
            "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", rdzv_id,
            "--max_restarts", "0", SCRIPT]


def _watch(out: Path, *opts: str) -> list[str]:
    return moe_hang_argv("watch", "--stall", "3", "--out", str(out), "--json", *opts, "--")


class Nodes:
    """The processes of one test (watchers, plain agents), each in its own session; on exit
    every one of them and every rank of the job (by its JOB_MARKS) is gone."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.marks = tmp / "marks"
        self.marks.mkdir()
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, argv: list[str], **env: str) -> subprocess.Popen[str]:
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=ROOT, env=job_env(JOB_MARKS=str(self.marks), **env),
                             start_new_session=True)
        self.procs.append(p)
        return p

    def results(self, procs: list[subprocess.Popen[str]], timeout: float = 150
                ) -> list[tuple[int, dict, str]]:
        """(exit code, --json diagnosis, stderr) of each watcher."""
        out = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            assert stdout.strip(), stderr[-3000:]
            out.append((p.returncode, json.loads(stdout), stderr))
        return out

    def rank_dirs(self) -> dict[int, Path]:
        """Which run directory watches which global rank (its ranks' heartbeats)."""
        found = {}
        for hb in self.tmp.glob("node*/ranks/rank*.hb.json"):
            found[int(hb.name[4:].split(".")[0])] = hb.parent.parent
        return found

    def close(self) -> None:
        # the ranks first: torchrun starts them in sessions of their own, and they hold its
        # output pipe open
        for p in processes_with_env("JOB_MARKS", str(self.marks)):
            with contextlib.suppress(psutil.Error):
                p.kill()
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.communicate(timeout=10)
        deadline = time.monotonic() + 10
        while processes_with_env("JOB_MARKS", str(self.marks)) and time.monotonic() < deadline:
            time.sleep(0.1)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    n = Nodes(tmp_path)
    try:
        yield n
    finally:
        n.close()
    assert_no_survivors(str(tmp_path))
    # this test's job only (its JOB_MARKS): a job of another xdist worker's test runs the
    # same script at the same time
    left = processes_with_env("JOB_MARKS", str(n.marks))
    assert not left, f"processes survived: {[p.pid for p in left]}"


def _by_rank(d: dict) -> dict[int, dict]:
    return {r["rank"]: r for r in d["ranks"]}


def _assert_rank3_verdict(d: dict) -> None:
    assert d["verdict"] == "desync" and d["culprit_ranks"] == [3], d["summary"]
    r = _by_rank(d)
    assert r[2]["collective"]["op"] == "all_gather" and r[2]["collective"]["pg"] != "0"
    assert all(r[k]["collective"]["op"] == "all_reduce" for k in (0, 1, 3))


@pytest.mark.timeout(240)
def test_two_agents_one_capture_one_verdict(nodes: Nodes, tmp_path: Path) -> None:
    """The issue's case: both watchers print culprit rank 3 with every rank's line, from one
    coordinated capture; analyze over both directories agrees, and over the analysing
    node's alone; nothing survives."""
    port = free_port()
    procs = [nodes.start(_watch(tmp_path / f"node{i}") + _torchrun(2, f"127.0.0.1:{port}",
                                                                    "mn2"))
             for i in (0, 1)]
    res = nodes.results(procs)
    assert [code for code, _, _ in res] == [3, 3], [err[-2000:] for _, _, err in res]
    for _, d, err in res:
        _assert_rank3_verdict(d)
        assert "one verdict for the job from nodes 0 (" in err, err[-2000:]
    own = ("artifacts", "command", "job_exit_code", "detected", "timings")  # each node's
    a, b = ({k: v for k, v in d.items() if k not in own} for _, d, _ in res)
    assert a == b
    verdicts = [json.loads((tmp_path / f"node{i}" / "coord" / "verdict.json").read_text())
                for i in (0, 1)]
    assert verdicts[0]["request"] == verdicts[1]["request"]  # one capture round
    assert sorted(verdicts[0]["captured"]) == ["0", "1"] and verdicts[0]["missing"] == []
    # what the ranks wrote while they were being ended is kept apart from the capture
    assert all((tmp_path / f"node{i}" / "teardown" / "job.log").exists() for i in (0, 1))
    merged = run_cli("analyze", str(tmp_path / "node0"), str(tmp_path / "node1"), "--json",
                     timeout=60)
    assert merged.returncode == 3, merged.stderr
    _assert_rank3_verdict(json.loads(merged.stdout))
    # a node that analysed kept the other's capture as it came (coord/nodes/): its
    # directory alone is the whole job, anywhere
    analysts = [d for d in (tmp_path / "node0", tmp_path / "node1")
                if RunLayout(d).node_captures()]
    assert analysts
    for d in analysts:
        alone = run_cli("analyze", str(d), "--json", timeout=60)
        assert alone.returncode == 3, alone.stderr
        _assert_rank3_verdict(json.loads(alone.stdout))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim_rank", [4, 0], ids=["another_node", "the_store_node"])
def test_three_agents_one_watcher_killed_mid_run(nodes: Nodes, tmp_path: Path,
                                                 victim_rank: int) -> None:
    """Three agents; the watcher of a node without rank 3 is SIGKILLed once the job runs
    (its agent and ranks run on, unwatched): the two others still agree on rank 3 and name
    that node's ranks unknown, never guilty. On the store's node (ranks 0, 1: its agent
    started first) that watcher served the relay: the others go back to the job's store,
    which its agent still hosts."""
    port = free_port()

    def start(i: int) -> subprocess.Popen[str]:
        return nodes.start(_watch(tmp_path / f"node{i}") + _torchrun(3, f"127.0.0.1:{port}",
                                                                      "mn3"))

    # the first agent up hosts the store and is node 0 (torch orders one host's agents by pid)
    procs = [start(0)]
    deadline = time.monotonic() + 90
    while not _listening(port):
        assert procs[0].poll() is None and time.monotonic() < deadline, "the store not up"
        time.sleep(0.2)
    procs += [start(1), start(2)]
    wait_files(nodes.marks, "hang.rank*", 6, timeout=120, what="6 ranks reaching 'hang'")
    deadline = time.monotonic() + 20
    while len(nodes.rank_dirs()) < 6 and time.monotonic() < deadline:
        time.sleep(0.1)
    dirs = nodes.rank_dirs()
    victim_dir = dirs[victim_rank]  # ranks 4, 5 or 0, 1: not in the skipped expert group
    victim = procs[int(victim_dir.name[4:])]
    os.kill(victim.pid, signal.SIGKILL)  # the watcher only: its job is in another session
    lost = sorted(r for r, d in dirs.items() if d == victim_dir)
    others = [p for p in procs if p is not victim]
    res = nodes.results(others)
    assert [code for code, _, _ in res] == [3, 3], [err[-2000:] for _, _, err in res]
    for _, d, err in res:
        assert d["verdict"] == "desync" and d["culprit_ranks"] == [3], d["summary"]
        r = _by_rank(d)
        assert [r[k]["state"] for k in lost] == ["unknown", "unknown"], err[-2000:]
        assert any(f"ranks {lost[0]}, {lost[1]} unknown" in e for e in d["evidence"]), \
            (d["evidence"], err[-3000:])
        assert ("relay is gone" in err) == (victim_rank == 0), err[-3000:]
        assert "no other node reachable" not in err, err[-3000:]
    assert res[0][1]["summary"] == res[1][1]["summary"]


@pytest.mark.timeout(240)
def test_a_node_without_watcher_is_unknown_not_guilty(nodes: Nodes, tmp_path: Path) -> None:
    """Static rendezvous (node ranks fixed): node 0 under watch, node 1 a plain torchrun. Node
    0's ranks only wait; the verdict says for whom and where to look, blames nobody, and is
    not acted on until --hang-after."""
    port = free_port()
    static = [PY, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
              "--master_addr", "127.0.0.1", "--master_port", str(port), "--max_restarts", "0"]
    watched = nodes.start([*_watch(tmp_path / "node0", "--hang-after", "4"), *static,
                           "--node_rank", "0", SCRIPT])
    nodes.start([*static, "--node_rank", "1", SCRIPT])
    [(code, d, err)] = nodes.results([watched])
    assert code == 3, err[-2000:]
    assert d["culprit_ranks"] == [] and d["verdict"] == "hang", d["summary"]
    assert re.search(r"Ranks 0, 1 wait in all_reduce default_pg#\d+ for ranks 2, 3 on node 1: "
                     r"run moe-hang there, or `moe-hang analyze` both captures", d["summary"])
    assert [_by_rank(d)[r]["state"] for r in (2, 3)] == ["unknown", "unknown"]
    assert "not ended: still watching" in err  # held until --hang-after, then ended
    verdict = json.loads((tmp_path / "node0" / "coord" / "verdict.json").read_text())
    assert verdict["missing"] == ["1"] and verdict["unknown_ranks"] == [2, 3]


@contextlib.contextmanager
def _namespaces(tmp: Path) -> Iterator[list[str]]:
    """Two "hosts", node0 and node1: a network namespace each, joined by a veth pair; the
    names resolve through a hosts file bind-mounted into each host's mount namespace."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = uuid.uuid4().hex[:6]
    ns = [f"mh{tag}{i}" for i in (0, 1)]
    made: list[str] = []
    try:
        for n in ns:
            got = subprocess.run(["ip", "netns", "add", n], capture_output=True, text=True)
            if got.returncode != 0:
                pytest.skip(f"ip netns add is not allowed here: {got.stderr.strip()}")
            made.append(n)
        subprocess.run(["ip", "link", "add", f"{ns[0]}v", "type", "veth", "peer", "name",
                        f"{ns[1]}v"], check=True)
        for i, n in enumerate(ns):
            subprocess.run(["ip", "link", "set", f"{n}v", "netns", n], check=True)
            subprocess.run(["ip", "-n", n, "addr", "add", f"10.213.9.{i + 1}/24", "dev",
                            f"{n}v"], check=True)
            subprocess.run(["ip", "-n", n, "link", "set", f"{n}v", "up"], check=True)
            subprocess.run(["ip", "-n", n, "link", "set", "lo", "up"], check=True)
        (tmp / "hosts").write_text("127.0.0.1 localhost\n10.213.9.1 node0\n10.213.9.2 node1\n")
        yield ns
    finally:
        for n in made:  # the veth pair goes with them
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def _on_host(ns: list[str], i: int, tmp: Path, argv: list[str]) -> list[str]:
    """``argv`` run on "host" i: its network namespace, host name and /etc/hosts."""
    inner = (f"hostname node{i} && mount --bind {tmp / 'hosts'} /etc/hosts && exec "
             + " ".join(argv))
    return ["ip", "netns", "exec", ns[i], "unshare", "--uts", "--mount", "sh", "-c", inner]


@pytest.mark.timeout(240)
def test_separate_hosts_through_a_shared_dir(nodes: Nodes, tmp_path: Path) -> None:
    """Each agent on a host of its own; the watchers outside them (as with a container whose
    network the watcher is not in): the store cannot be reached, the shared directory can."""
    shared = tmp_path / "shared"
    shared.mkdir()
    with _namespaces(tmp_path) as ns:
        tr = _torchrun(2, "node0:29702", "nsjob")
        procs = [nodes.start(_watch(tmp_path / f"node{i}", "--shared-dir", str(shared))
                             + _on_host(ns, i, tmp_path, tr), GLOO_SOCKET_IFNAME=f"{ns[i]}v")
                 for i in (0, 1)]
        res = nodes.results(procs)
    assert [code for code, _, _ in res] == [3, 3], [err[-2000:] for _, _, err in res]
    for _, d, err in res:
        _assert_rank3_verdict(d)
        assert {r["host"] for r in d["ranks"]} == {"node0", "node1"}
        assert "one verdict for the job from nodes 0 (node" in err
    # the run key is the agents' rendezvous id, found in their command line
    assert (shared / "moe-hang" / "nsjob" / "verdict").is_file()


@pytest.mark.timeout(240)
def test_separate_hosts_the_store_gone_for_one(nodes: Nodes, tmp_path: Path) -> None:
    """Watchers on their hosts, through the rendezvous store on node0; once the job hangs,
    node1's link goes down. Node0 names node1's ranks unknown; node1, cut off from the store
    (its calls bounded however long the partition blocks them), gives a verdict of its own
    ranks only. Neither blames a rank for waiting on the other's."""
    with _namespaces(tmp_path) as ns:
        tr = _torchrun(2, "node0:29702", "nscut")
        procs = [nodes.start(_on_host(ns, i, tmp_path, _watch(tmp_path / f"node{i}",
                                                              "--hang-after", "4") + tr),
                             GLOO_SOCKET_IFNAME=f"{ns[i]}v")
                 for i in (0, 1)]
        wait_files(nodes.marks, "hang.rank*", 4, timeout=120, what="4 ranks reaching 'hang'")
        subprocess.run(["ip", "-n", ns[1], "link", "set", f"{ns[1]}v", "down"], check=True)
        res = nodes.results(procs, timeout=180)
    assert [code for code, _, _ in res] == [3, 3], [err[-2000:] for _, _, err in res]
    dirs = nodes.rank_dirs()
    for i, (_, d, err) in enumerate(res):
        v = json.loads((tmp_path / f"node{i}" / "coord" / "verdict.json").read_text())
        mine = sorted(r for r, p in dirs.items() if p.name == f"node{i}")
        assert v["captured"] == [str(mine[0] // 2)], (i, v["captured"], err[-2000:])
        if i == 1:
            assert v["local_only"] and "store" in (v["note"] or ""), v
        if mine == [2, 3]:
            assert d["culprit_ranks"] == [3], d["summary"]  # its expert group is all there
        else:
            assert d["culprit_ranks"] == [] and "Ranks 0, 1 wait in all_reduce" in \
                d["summary"], d["summary"]


# ----------------------------------------------------------------------------- a crash
# (issue 19 item 4): one verdict, on every node, whichever node's watcher would end first


CRASH = str(JOBS / "mn_crash.py")


def _listening(port: int) -> bool:
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr[1] == port
               for c in psutil.net_connections(kind="tcp"))


def _crash_job(nodes: Nodes, tmp_path: Path, crash: int, **env: str
               ) -> list[subprocess.Popen[str]]:
    """Two watched c10d agents; the first one's agent is up (and hosts the rendezvous store)
    before the second starts, so it is node 0 (ranks 0, 1: torch orders the agents of one
    host by pid)."""
    port = free_port()
    argv = [PY, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id",
            f"crash{crash}", "--max_restarts", "0", CRASH]
    first = nodes.start(_watch(tmp_path / "node0") + argv, CRASH_RANK=str(crash), **env)
    deadline = time.monotonic() + 90
    while not _listening(port):
        assert first.poll() is None and time.monotonic() < deadline, "node 0's store not up"
        time.sleep(0.2)
    return [first, nodes.start(_watch(tmp_path / "node1") + argv, CRASH_RANK=str(crash),
                               **env)]


@pytest.mark.timeout(300)
# the crash on either node, the late watcher on either: make test runs the two where both
# swap (a mirrored pair); the other two, make test-matrix
@pytest.mark.parametrize("crash, late", [
    pytest.param(2, "store_node", id="on_the_other_node-store_node"),
    pytest.param(1, "other_node", id="on_the_store_node-other_node"),
    pytest.param(2, "other_node", id="on_the_other_node-other_node", marks=pytest.mark.matrix),
    pytest.param(1, "store_node", id="on_the_store_node-store_node", marks=pytest.mark.matrix)])
def test_a_crash_gives_one_verdict_on_every_node(nodes: Nodes, tmp_path: Path, crash: int,
                                                 late: str) -> None:
    """Global rank ``crash`` raises ValueError (rank 2: on the node without the store; its
    mirror rank 1: on the store's node). The watcher of one node is held back (SIGSTOP for
    3 s) right as the rank raises, so that the other would be first to end: either way both
    print the same crash verdict naming that rank, from one round (never "no other node
    reachable", never "no rank raised"): the node whose agent hosts the store ends its job
    only once the other has the verdict."""
    procs = _crash_job(nodes, tmp_path, crash)
    wait_files(nodes.marks, f"hang.rank{crash}", 1, timeout=150, what=f"rank {crash} at step 2")
    victim = procs[0 if late == "store_node" else 1]
    os.kill(victim.pid, signal.SIGSTOP)
    time.sleep(3.0)
    os.kill(victim.pid, signal.SIGCONT)
    res = nodes.results(procs)
    assert [code for code, _, _ in res] == [3, 3], [err[-3000:] for _, _, err in res]
    dirs = nodes.rank_dirs()
    assert [dirs[r].name for r in range(4)] == ["node0"] * 2 + ["node1"] * 2, dirs
    line = line_of(Path(CRASH), "raise ValueError")
    for _, d, err in res:
        assert d["verdict"] == "crash" and d["culprit_ranks"] == [crash], (d["summary"],
                                                                         err[-3000:])
        assert d["rule"] == "root-cause exception" and d["certainty"] == "definite"
        assert d["summary"].startswith(
            f"Rank {crash} raised ValueError: corrupt shard 17 on node {crash // 2} at "), \
            d["summary"]
        assert f"mn_crash.py:{line} load_shard" in d["summary"]
        assert "no rank raised" not in d["summary"]
        assert "no other node reachable" not in err and "one verdict for the job" in err, \
            err[-3000:]
        # the store's host waited for the other node to have the verdict, and it had
        assert "did not confirm in time" not in err
    own = ("artifacts", "command", "job_exit_code", "detected", "timings")
    a, b = ({k: v for k, v in d.items() if k not in own} for _, d, _ in res)
    assert a == b
    verdicts = [json.loads((tmp_path / f"node{i}" / "coord" / "verdict.json").read_text())
                for i in (0, 1)]
    assert verdicts[0]["request"] == verdicts[1]["request"]
    assert not verdicts[0]["local_only"] and not verdicts[1]["local_only"]
    assert sorted(verdicts[0]["captured"]) == ["0", "1"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("crash", [1, 2], ids=["on_the_store_node", "on_the_other_node"])
def test_a_rank_killed_on_the_store_node_still_gives_one_verdict(nodes: Nodes, tmp_path: Path,
                                                                crash: int) -> None:
    """Global rank ``crash`` is SIGKILLed at step 2. A killed rank cannot be held: on the
    store's node (rank 1) its agent ends at once and takes the job's store with it. The
    watchers talk in the relay the store node's watcher serves, so both still print one
    verdict from one round naming that rank and the signal (before the relay: "no other node
    reachable", ranks of the other node unknown). Mirrored: the rank on the other node."""
    procs = _crash_job(nodes, tmp_path, crash, CRASH_HOW="sigkill")
    res = nodes.results(procs)
    assert [code for code, _, _ in res] == [3, 3], [err[-3000:] for _, _, err in res]
    for _, d, err in res:
        assert (d["verdict"], d["culprit_ranks"]) == ("rank_died", [crash]), (d["summary"],
                                                                              err[-3000:])
        assert d["summary"].startswith(f"Rank {crash} was killed by SIGKILL"), d["summary"]
        assert "no other node reachable" not in err and "one verdict for the job" in err, \
            err[-3000:]
    verdicts = [json.loads((tmp_path / f"node{i}" / "coord" / "verdict.json").read_text())
                for i in (0, 1)]
    assert verdicts[0]["request"] == verdicts[1]["request"]
    assert not verdicts[0]["local_only"] and not verdicts[1]["local_only"]
    assert sorted(verdicts[0]["captured"]) == ["0", "1"]


# ----------------------------------------------------------------------------- no torchrun
# (issue 19 item 3): srun or mpirun start the ranks; launch_like.py once per "node" stands in
# for the launcher's daemon there. The watchers meet in the store rank 0's process hosts for
# the ranks' env:// init (MASTER_ADDR:MASTER_PORT), or in --shared-dir


def _launched(nodes: Nodes, tmp_path: Path, style: str, script: str, *opts: str,
              **env: str) -> list[tuple[int, dict, str]]:
    port = str(free_port())
    launch = [PY, str(JOBS / "launch_like.py"), style, "2", port, script]
    procs = [nodes.start([*_watch(tmp_path / f"node{i}", *opts), *launch],
                         LAUNCH_NODE_RANK=str(i), LAUNCH_NNODES="2", **env)
             for i in (0, 1)]
    return nodes.results(procs)


def _one_round(tmp_path: Path, res: list[tuple[int, dict, str]]) -> None:
    own = ("artifacts", "command", "job_exit_code", "detected", "timings")
    a, b = ({k: v for k, v in d.items() if k not in own} for _, d, _ in res)
    assert a == b
    verdicts = [json.loads((tmp_path / f"node{i}" / "coord" / "verdict.json").read_text())
                for i in (0, 1)]
    assert verdicts[0]["request"] == verdicts[1]["request"]
    assert sorted(verdicts[0]["captured"]) == ["0", "1"] and not verdicts[0]["local_only"]
    for _, _, err in res:
        assert "one verdict for the job from nodes 0 (" in err, err[-3000:]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("style, crash, step_s", [("slurm", 2, "1.0"), ("ompi", 1, "1.0"),
                                                 ("slurm", 1, "0")],
                         ids=["srun_crash_on_node1", "mpirun_crash_on_store_node",
                              "srun_crash_before_the_ranks_settle"])
def test_without_torchrun_through_the_ranks_store(nodes: Nodes, tmp_path: Path, style: str,
                                                   crash: int, step_s: str) -> None:
    """No torchrun, no --shared-dir: the watchers find MASTER_ADDR:MASTER_PORT in their ranks'
    environment and meet in rank 0's store (keys of their own); a rank that raised on either
    node gives one crash verdict on both — also one that raised right after the group was
    made, before the watchers knew the job spans nodes (held from the start)."""
    res = _launched(nodes, tmp_path, style, CRASH, CRASH_RANK=str(crash), JOB_STEP_S=step_s)
    assert [code for code, _, _ in res] == [3, 3], [err[-3000:] for _, _, err in res]
    for _, d, err in res:
        assert d["verdict"] == "crash" and d["culprit_ranks"] == [crash], (d["summary"],
                                                                         err[-3000:])
        assert d["summary"].startswith(f"Rank {crash} raised ValueError: corrupt shard 17")
        assert {r["rank"] for r in d["ranks"]} == {0, 1, 2, 3}
    _one_round(tmp_path, res)
    assert [sorted(r for r, p in nodes.rank_dirs().items() if p.name == f"node{i}")
            for i in (0, 1)] == [[0, 1], [2, 3]]


@pytest.mark.timeout(240)
def test_without_torchrun_through_a_shared_dir(nodes: Nodes, tmp_path: Path) -> None:
    """srun-like, --shared-dir: rank 3 skips its expert group's all-gather; both watchers print
    the rank-3 desync, and nothing survives."""
    shared = tmp_path / "shared"
    shared.mkdir()
    res = _launched(nodes, tmp_path, "slurm", SCRIPT, "--shared-dir", str(shared))
    assert [code for code, _, _ in res] == [3, 3], [err[-3000:] for _, _, err in res]
    for _, d, _ in res:
        _assert_rank3_verdict(d)
    _one_round(tmp_path, res)


@pytest.mark.timeout(240)
def test_without_torchrun_a_healthy_job_ends_by_itself(nodes: Nodes, tmp_path: Path) -> None:
    """The same launch, nobody raises: both watchers let it finish and return its code."""
    res = _launched(nodes, tmp_path, "slurm", CRASH, CRASH_RANK="-1", JOB_STEP_S="0.2")
    assert [code for code, _, _ in res] == [0, 0], [err[-3000:] for _, _, err in res]
    assert all(d["verdict"] == "healthy" for _, d, _ in res), [d["summary"] for _, d, _ in res]
