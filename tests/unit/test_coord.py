"""moe_hang.runtime.coord: the cross-node protocol, on a real TCPStore and on a directory.

Simulated nodes are threads (or, where one must die for real, a subprocess); the store's
server is this process (is_master=True) or a subprocess that a test kills. Every test is
bounded, and every process a test starts is ended by it."""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from moe_hang.runtime import coord
from moe_hang.runtime.coord import (
    CaptureRequest,
    ChannelGone,
    Coordinator,
    DirChannel,
    NodeSummary,
    StoreChannel,
    shareddir,
)
from moe_hang.testing import ports

ROOT = Path(__file__).resolve().parents[2]
LOCAL_WORLD = 2


# ----------------------------------------------------------------------------- helpers


def hb(rank: int, op: str = "gloo:all_gather", seq: int = 7, sizes: list[list[int]] | None = None,
       local_world: int = LOCAL_WORLD, world: int = 6, pending: bool = True) -> dict[str, Any]:
    """A heartbeat in the probe's format (moe_hang/probe.py)."""
    entry = {"pg_id": "0", "process_group": ["0", "default_pg"], "collective_seq_id": seq,
             "profiling_name": op, "input_sizes": sizes if sizes is not None else [[4, 8]],
             "output_sizes": [[8, 8]], "input_dtypes": ["Float"], "time_created_ns": 10**18 + seq,
             "frames": [{"name": "all_gather", "filename": "/x/torch/distributed/c10d.py",
                         "line": 10}, {"name": "dispatch", "filename": "/job/train.py",
                                       "line": 15}]}
    return {"rank": rank, "pid": 1000 + rank, "host": f"h{rank // local_world}",
            "world": str(world), "local_rank": str(rank % local_world),
            "local_world": str(local_world), "time": time.time(), "beat": 3, "cpu_s": 1.0,
            "progress": {"step": 2}, "pg_status": {"0": {"enqueued": seq, "completed": seq - 1}},
            "pending": [entry] if pending else [],
            "main_frame": [["/x/torch/distributed/c10d.py", 10, "all_gather"],
                           ["/job/train.py", 15, "dispatch"], ["/job/train.py", 30, "<module>"]]}


def node_summary(node: int, *, culprit: int | None = None, local_world: int = LOCAL_WORLD,
                 world: int = 6) -> NodeSummary:
    hbs = {}
    for r in range(node * local_world, (node + 1) * local_world):
        hbs[r] = hb(r, op="gloo:barrier" if r == culprit else "gloo:all_gather",
                    sizes=[] if r == culprit else None, local_world=local_world, world=world)
    return coord.summarize_heartbeats(hbs, node=str(node), host=f"h{node}",
                                      moving=dict.fromkeys(hbs, False), kind="capture")


def analyse(summaries: dict[str, NodeSummary], missing: list[str]) -> dict[str, Any]:
    return coord.basic_verdict(summaries, missing)


@pytest.fixture
def store_server() -> Iterator[tuple[str, int, Any]]:
    dist = pytest.importorskip("torch.distributed")
    from datetime import timedelta

    srv = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                        timeout=timedelta(seconds=10))
    yield "127.0.0.1", srv.port, srv
    del srv


def store_channel(host: str, port: int, run: str = "job1", **kw: Any) -> StoreChannel:
    ch = StoreChannel(host, port, run, **kw)
    assert ch.connect(timeout=10), ch.gone
    return ch


@pytest.fixture(params=["store", "dir"])
def make_channel(request: pytest.FixtureRequest, tmp_path: Path
                 ) -> Iterator[Callable[[], coord.Channel]]:
    """A factory of channels that all talk to one store / one shared directory."""
    made: list[coord.Channel] = []
    if request.param == "store":
        pytest.importorskip("torch")
        host, port, _srv = request.getfixturevalue("store_server")

        def make() -> coord.Channel:
            ch = store_channel(host, port)
            made.append(ch)
            return ch
    else:
        def make() -> coord.Channel:
            ch = DirChannel(tmp_path / "shared", "job1")
            made.append(ch)
            return ch
    yield make
    for ch in made:
        ch.close()


def in_threads(fns: list[Callable[[], Any]], timeout: float = 45.0) -> list[Any]:
    """Run each callable in its own thread; their results (an exception is re-raised)."""
    out: list[Any] = [None] * len(fns)
    errs: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as exc:
            errs.append(exc)

    ts = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in ts:
        t.start()
    end = time.monotonic() + timeout
    for t in ts:
        t.join(max(0.0, end - time.monotonic()))
    assert not any(t.is_alive() for t in ts), "a simulated node did not finish"
    if errs:
        raise errs[0]
    return out


def coordinators(make: Callable[[], coord.Channel], n: int, *, start: bool = True,
                 world: int = 6) -> list[Coordinator]:
    cs = []
    for i in range(n):
        c = Coordinator(make(), str(i), f"h{i}", poll_s=0.02)
        assert c.register(list(range(i * LOCAL_WORLD, (i + 1) * LOCAL_WORLD)),
                          hosts_store=(i == 0), world=world, local_world=LOCAL_WORLD)
        if start:
            c.start(interval=0.2, publish_every_s=0.0)
        cs.append(c)
    return cs


def round_for(c: Coordinator, expected: list[str], *, culprit: int | None = None,
              capture_s: float = 0.0, **kw: Any) -> Callable[[], coord.RoundResult]:
    def run() -> coord.RoundResult:
        end = time.monotonic() + 10
        while c.capture_requested() is None and time.monotonic() < end:
            time.sleep(0.01)
        req = c.capture_requested()
        assert req is not None, "no capture request seen"

        def capture() -> NodeSummary:
            time.sleep(capture_s)
            return node_summary(int(c.node), culprit=culprit)

        return c.run_round(req, capture, analyse, expected, **kw)
    return run


@contextlib.contextmanager
def server_process() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A TCPStore server in a process of its own (to kill: the store gone)."""
    pytest.importorskip("torch")
    code = ("import time, torch.distributed as d\n"
            "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
            "print(s.port, flush=True)\ntime.sleep(120)\n")
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL="FATAL")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], 40)
        assert ready, "store server did not start"
        yield p, int(p.stdout.readline())
    finally:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
        p.wait(10)


def free_port() -> int:
    return ports.free_port()  # below the ephemeral range: moe_hang/testing/ports.py


# ----------------------------------------------------------------------------- channels


@pytest.mark.timeout(60)
def test_channel_primitives(make_channel: Callable[[], coord.Channel]) -> None:
    a, b = make_channel(), make_channel()
    assert a.get("nothing/here") is None
    a.put("k", b"v1")
    assert b.get("k") == b"v1"
    b.put("k", b"v2")
    assert a.get("k") == b"v2"
    assert a.put_first("first", b"A") == b"A"
    assert b.put_first("first", b"B") == b"A"
    for n in ("0", "1", "10", "2"):
        a.put_member("ns", n, n.encode() * 3)
    b.put_member("ns", "1", b"again")  # re-publishing lists a member once
    assert sorted(b.members("ns"), key=int) == ["0", "1", "2", "10"]
    assert b.get_many(["ns/0", "ns/1", "ns/missing"]) == [b"000", b"again", None]
    assert b.get_many(["ns/0", "ns/2"]) == [b"000", b"222"]
    binary = bytes(range(256)) * 50
    a.put("bin", binary)
    assert b.get("bin") == binary
    t = time.monotonic()
    assert b.wait("late", 0.3) is False
    assert time.monotonic() - t < 3.0
    late = threading.Timer(0.3, lambda: a.put("late", b"1"))
    late.start()
    assert b.wait("late", 5.0) is True
    late.join(10)  # its put is done only once its round trip returns: before the store goes
    with pytest.raises(ValueError):
        a.put("../escape", b"x")


@pytest.mark.timeout(60)
def test_encode_roundtrip_and_untrusted_input() -> None:
    s = node_summary(1, culprit=3)
    data = s.encode()
    assert data[:1] == b"Z"  # compressed past a few hundred bytes
    back = NodeSummary.decode(data)
    assert back is not None and back.to_json() == s.to_json()
    assert NodeSummary.decode(b"{not json") is None
    assert NodeSummary.decode(b"Z" + b"garbage") is None
    assert NodeSummary.decode(b'{"no": "node"}') is None
    assert coord.decode(None) is None


# ----------------------------------------------------------------------------- the protocol


@pytest.mark.timeout(60)
def test_three_nodes_one_global_verdict(make_channel: Callable[[], coord.Channel]) -> None:
    cs = coordinators(make_channel, 3)
    expected = coord.expected_nodes(6, LOCAL_WORLD)
    assert expected == ["0", "1", "2"]
    assert sorted(cs[2].nodes()) == expected
    assert cs[0].nodes()["0"].hosts_store
    cs[1].publish_summary(node_summary(1))
    seen = cs[0].read_summaries()  # what diagnose on node 0 reads about node 1
    assert seen["1"].host == "h1" and [r.rank for r in seen["1"].ranks] == [2, 3]
    req = cs[1].request_capture("desync on node 1")
    assert req is not None and req.by_node == "1"
    t = time.monotonic()
    results = in_threads([round_for(c, expected, culprit=3) for c in cs])
    elapsed = time.monotonic() - t
    verdicts = [r.verdict.to_json() for r in results]
    assert verdicts[0] == verdicts[1] == verdicts[2]
    v = results[0].verdict
    assert v.by_node == "1" and v.request == req.id and not v.local_only
    assert v.captured == expected and v.missing == [] and v.unknown_ranks == []
    assert v.verdict["verdict"] == "desync" and v.verdict["culprit_ranks"] == [3]
    assert v.hosts == {"0": "h0", "1": "h1", "2": "h2"}
    assert sorted(v.summaries) == expected and not v.summaries["2"].ranks[0].stack  # compact
    assert [r.analysed_here for r in results] == [False, True, False]
    assert results[0].not_ended == []  # node 0 hosts the store: it waited for the others
    assert elapsed < 10, elapsed
    hbs = coord.to_heartbeats(v.summaries.values())
    assert sorted(hbs) == list(range(6))
    assert hbs[3]["pending"][0]["profiling_name"] == "gloo:barrier"
    assert hbs[3]["host"] == "h1" and hbs[3]["pg_status"]["0"] == {"enqueued": 7, "completed": 6}
    for c in cs:
        c.close()


@pytest.mark.timeout(60)
def test_capture_requested_from_outside_the_watchers(
        make_channel: Callable[[], coord.Channel]) -> None:
    """``diagnose`` on some machine asks every watcher to capture and reads the verdict: the
    lowest node analyses (nobody waits for an analyst that is not a watcher)."""
    cs = coordinators(make_channel, 3)
    outside = Coordinator(make_channel(), "diagnose-h9-4242", "h9")
    req = outside.request_capture("diagnose --global")
    assert req is not None and req.by_node == "diagnose-h9-4242"
    t = time.monotonic()
    results = in_threads([round_for(c, ["0", "1", "2"], dead_after_s=30) for c in cs])
    assert time.monotonic() - t < 10  # not the 30 s an absent analyst would cost
    v = outside.read_verdict(timeout=5)
    assert v is not None and v.by_node == "0" and v.request == req.id
    assert [r.analysed_here for r in results] == [True, False, False]
    assert v.head_json() == results[2].verdict.head_json()
    assert sorted(v.summaries) == ["0", "1", "2"]
    for c in [*cs, outside]:
        c.close()


@pytest.mark.timeout(60)
def test_a_round_that_ends_nothing_is_followed_by_a_fresh_one(
        make_channel: Callable[[], coord.Channel]) -> None:
    """A capture on request (or an uncertain verdict) leaves the job running: the next request
    is a new round under fresh keys, with its own verdict; a watcher that starts later joins
    the current round, not the old request."""
    cs = coordinators(make_channel, 2, world=4)
    expected = ["0", "1"]
    first = cs[0].request_capture("requested: kill -USR1")
    assert first is not None
    r0 = in_threads([round_for(c, expected, culprit=3) for c in cs])
    assert {r.verdict.request for r in r0} == {first.id}
    for c in cs:
        c.next_round()
        assert c.capture_requested() is None and c.round == 1
    time.sleep(0.5)  # the background threads wait on the new round's request, not the old one
    assert all(c.capture_requested() is None for c in cs)
    late = Coordinator(make_channel(), "2", "h2", poll_s=0.02)
    late.start(interval=0.2)
    second = cs[1].request_capture("stalled: no progress for 3 s")
    assert second is not None and second.id != first.id and second.by_node == "1"
    r1 = in_threads([round_for(c, expected) for c in cs])
    assert {r.verdict.request for r in r1} == {second.id}
    assert r1[0].verdict.to_json() == r1[1].verdict.to_json()
    assert r1[0].verdict.verdict != r0[0].verdict.verdict  # no culprit planted this time
    end = time.monotonic() + 5
    while late.capture_requested() is None and time.monotonic() < end:
        time.sleep(0.02)
    got = late.capture_requested()
    assert late.round == 1 and got is not None and got.id == second.id
    assert cs[0].read_verdict() is not None and cs[0].read_verdict().request == second.id
    for c in [*cs, late]:
        c.close()


@pytest.mark.timeout(60)
def test_double_capture_requests_one_wins(make_channel: Callable[[], coord.Channel]) -> None:
    cs = coordinators(make_channel, 6, start=False)
    go = threading.Barrier(len(cs))

    def ask(c: Coordinator) -> Callable[[], CaptureRequest | None]:
        def run() -> CaptureRequest | None:
            go.wait(10)
            return c.request_capture(f"stall seen by {c.node}")
        return run

    got = in_threads([ask(c) for c in cs])
    assert all(g is not None for g in got)
    assert len({g.id for g in got}) == 1
    assert cs[0].poll_capture_request() == got[0]
    for c in cs:
        c.close()


@pytest.mark.timeout(60)
def test_node_that_never_registers_is_unknown(make_channel: Callable[[], coord.Channel]) -> None:
    cs = coordinators(make_channel, 2)  # node 2 of 3 never joins the protocol
    expected = ["0", "1", "2"]
    assert cs[0].request_capture("stall") is not None
    t = time.monotonic()
    results = in_threads([round_for(c, expected, unregistered_grace_s=1.0,
                                    capture_timeout_s=30) for c in cs])
    assert time.monotonic() - t < 15  # the grace, not the 30 s deadline
    v = results[1].verdict
    assert results[0].verdict.to_json() == v.to_json()
    assert v.captured == ["0", "1"] and v.missing == ["2"]
    assert v.unknown_ranks == [4, 5]  # world 6: missing ranks are unknown ...
    assert v.verdict["unknown_nodes"] == ["2"]
    assert not set(v.verdict["culprit_ranks"]) & {4, 5}  # ... never culprits
    for c in cs:
        c.close()


@pytest.mark.timeout(60)
def test_watcher_dies_mid_protocol(make_channel: Callable[[], coord.Channel]) -> None:
    """Node 2 registers and beats, then its watcher dies: given up after dead_after_s."""
    cs = coordinators(make_channel, 3)
    expected = ["0", "1", "2"]
    time.sleep(0.5)  # node 2 beats a few times ...
    cs[2].stop()  # ... and dies before it captures
    assert cs[0].request_capture("stall") is not None
    t = time.monotonic()
    results = in_threads([round_for(c, expected, dead_after_s=1.5, capture_timeout_s=30)
                          for c in cs[:2]])
    assert time.monotonic() - t < 15
    v = results[0].verdict
    assert results[1].verdict.to_json() == v.to_json()
    assert v.missing == ["2"] and v.unknown_ranks == [4, 5]
    for c in cs:
        c.close()


@pytest.mark.timeout(60)
def test_requester_killed_mid_protocol(store_server: tuple[str, int, Any]) -> None:
    """The requester (the analyst) is a real process, SIGKILLed after its request: the others
    notice its beat stop, analyse themselves, and still agree on one verdict."""
    host, port, _srv = store_server
    code = f"""
import sys, time
sys.path.insert(0, {str(ROOT)!r})
from moe_hang.runtime.coord import Coordinator, StoreChannel
ch = StoreChannel({host!r}, {port}, "job1")
assert ch.connect(timeout=20)
c = Coordinator(ch, "2", "h2")
c.register([4, 5], world=6, local_world=2)
c.start(interval=0.2)
c.request_capture("stall seen by node 2")
print("requested", flush=True)
time.sleep(60)
"""
    cs = coordinators(lambda: store_channel(host, port), 2)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, start_new_session=True,
                         env=dict(os.environ, TORCH_CPP_LOG_LEVEL="FATAL"))
    try:
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], 40)
        assert ready and p.stdout.readline().strip() == b"requested"
        time.sleep(0.5)
        p.kill()
        p.wait(10)
        t = time.monotonic()
        results = in_threads([round_for(c, ["0", "1", "2"], dead_after_s=1.5) for c in cs])
        assert time.monotonic() - t < 20
    finally:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
        p.wait(10)
    v = results[0].verdict
    assert results[1].verdict.to_json() == v.to_json()
    assert v.request.startswith("2-") and v.by_node in ("0", "1")
    assert v.captured == ["0", "1"] and v.missing == ["2"] and not v.local_only
    assert sum(r.analysed_here for r in results) >= 1
    for c in cs:
        c.close()


@pytest.mark.timeout(60)
def test_store_gone_mid_protocol_falls_back_local() -> None:
    with server_process() as (server, port):
        cs = coordinators(lambda: store_channel("127.0.0.1", port), 2)
        assert cs[0].request_capture("stall") is not None

        def kill_store_then_capture() -> NodeSummary:
            server.kill()
            server.wait(10)
            return node_summary(1)

        def node1() -> coord.RoundResult:
            req = cs[1].capture_requested() or cs[1].wait_capture_request(5)
            assert req is not None
            return cs[1].run_round(req, kill_store_then_capture, analyse, ["0", "1"])

        t = time.monotonic()
        r0, r1 = in_threads([round_for(cs[0], ["0", "1"], capture_s=0.5, capture_timeout_s=20),
                             node1])
        assert time.monotonic() - t < 15
    for r, me in ((r0, "0"), (r1, "1")):
        v = r.verdict
        assert v.local_only and "gone" in (v.note or ""), v.note
        assert v.captured == [me] and v.missing == [n for n in ("0", "1") if n != me]
    for c in cs:
        assert c.gone is not None
        assert c.request_capture("again") is None  # gone stays gone, and fast
        assert c.register([0]) is False
        c.close()


class _HungStore:
    """A store whose every call blocks: a partitioned link (a real TCPStore get then blocks
    far beyond its own timeout)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def hang(*_a: Any, **_k: Any) -> Any:
            self.release.wait(30)
            raise RuntimeError("released")
        return hang


@pytest.mark.timeout(60)
def test_hung_store_is_bounded() -> None:
    hung = _HungStore()
    try:
        ch = StoreChannel("10.255.255.1", 1, "job1", op_timeout=0.5, store=hung,
                          wait_store=hung)
        c = Coordinator(ch, "0", "h0")
        t = time.monotonic()
        assert c.register([0, 1]) is False
        assert time.monotonic() - t < 3
        assert ch.gone is not None and "timed out" in ch.gone
        t = time.monotonic()
        assert c.request_capture("x") is None and c.read_verdict(1.0) is None
        assert c.wait_all_captured(["0", "1"], time.monotonic() + 5) == ({}, ["0", "1"])
        assert time.monotonic() - t < 1
        with pytest.raises(ChannelGone):
            ch.get("k")
    finally:
        hung.release.set()


@pytest.mark.timeout(60)
def test_unreachable_store_is_bounded() -> None:
    pytest.importorskip("torch")
    ch = StoreChannel("127.0.0.1", free_port(), "job1")
    t = time.monotonic()
    assert ch.connect(timeout=1.0, attempt_s=0.3) is False
    assert time.monotonic() - t < 8
    assert ch.gone is None  # nobody there yet is not "gone": a later attempt may connect
    with pytest.raises(ChannelGone):
        ch.get("k")


@pytest.mark.timeout(60)
def test_connect_before_the_store_exists() -> None:
    dist = pytest.importorskip("torch.distributed")
    port = free_port()
    ch = StoreChannel("127.0.0.1", port, "job1")
    done: list[bool] = []
    t = threading.Thread(target=lambda: done.append(ch.connect(timeout=20, attempt_s=0.5)),
                         daemon=True)
    t.start()
    time.sleep(1.5)  # the watcher starts before the agent that hosts the store
    srv = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    t.join(25)
    assert done == [True]
    ch.put("k", b"v")
    assert srv.get(ch.prefix + "k") == b"v"  # our keys live under moe-hang/<run>/
    assert ch.prefix == "moe-hang/job1/"
    ch.close()
    del srv


@pytest.mark.timeout(60)
def test_dir_channel_without_hard_links(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_link(*_a: Any, **_k: Any) -> None:
        raise OSError(errno.EPERM, "no hard links here")

    monkeypatch.setattr(shareddir.os, "link", no_link)
    a, b = DirChannel(tmp_path, "j"), DirChannel(tmp_path, "j")
    assert a.put_first("verdict", b"one") == b"one"
    assert b.put_first("verdict", b"two") == b"one"
    assert not [p for p in (tmp_path / "moe-hang" / "j").iterdir() if p.name.endswith(".tmp")]


@pytest.mark.timeout(60)
def test_stale_request_in_shared_dir_is_ignored(tmp_path: Path) -> None:
    old = DirChannel(tmp_path, "none")
    stale = CaptureRequest("0-1-1", "an earlier job", "0", "h0", time.time() - 3600)
    old.put_first("request", coord.encode(stale.to_json()))
    c = Coordinator(DirChannel(tmp_path, "none"), "1", "h1")
    assert c.poll_capture_request() is None
    assert c.wait_capture_request(0.2) is None
    assert coord.run_key("none", {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0"}) == "none-slurm42.0"


# ----------------------------------------------------------------------------- helpers


@pytest.mark.timeout(60)
def test_summaries_from_heartbeats() -> None:
    hbs = {2: hb(2), 3: hb(3, op="gloo:barrier", sizes=[]), }
    hbs[3]["progress"] = {"phase": "exiting"}
    s = coord.summarize_heartbeats(hbs, node="1", host="h1", moving={2: False, 3: False})
    r2, r3 = s.ranks
    assert (r2.rank, r2.pid, r2.local_rank, r2.state) == (2, 1002, 0, "in_collective")
    assert r2.callsite == "/job/train.py:15:dispatch"  # the FR frame outside torch
    assert r2.pending[0].signature() == ("all_gather", ((4, 8),), ("Float",))
    assert r2.completed == {"0": 6} and r2.enqueued == {"0": 7} and r2.step == 2
    assert r3.state == "exited"
    assert s.world == 6 and s.local_world == 2
    assert coord.node_id_from_heartbeats(hbs) == "1"
    assert coord.summarize_heartbeats({0: hb(0, pending=False)}, node="0",
                                      moving={0: True}).ranks[0].state == "computing"
    assert coord.expected_nodes(1024, 8) == [str(i) for i in range(128)]
    assert coord.expected_nodes(None, None, group_world=3) == ["0", "1", "2"]
    assert coord.ranks_of_nodes(["1", "3"], 2) == [2, 3, 6, 7]
    fresh = node_summary(0)
    fresh.ranks[0].moving, fresh.time = True, time.time()
    assert coord.remote_moving({"0": fresh}, "1") == [0]
    assert coord.remote_moving({"0": fresh}, "0") == []


@pytest.mark.timeout(60)
def test_endpoint_from_torchrun_command_lines() -> None:
    ep = coord.endpoint_from_torchrun(
        ["torchrun", "--nnodes", "2", "--nproc_per_node=8", "--rdzv_backend", "c10d",
         "--rdzv-endpoint", "node01:29501", "--rdzv_id", "job7", "train.py", "--nnodes", "9"],
        env={})
    assert ep is not None and (ep.host, ep.port, ep.run_id, ep.backend) == (
        "node01", 29501, "job7", "c10d")
    assert ep.multi_node and ep.nnodes_max == 2
    ep = coord.endpoint_from_torchrun(
        ["srun", "/x/bin/python", "-m", "torch.distributed.run", "--nnodes=1:4",
         "--rdzv-backend=c10d", "--rdzv-endpoint=[fe80::1]", "-m", "pkg.train"], env={})
    assert ep is not None and (ep.host, ep.port, ep.nnodes_min, ep.nnodes_max) == (
        "fe80::1", 29400, 1, 4)
    ep = coord.endpoint_from_torchrun(
        ["torchrun", "--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1",
         "--master_port", "29600", "t.py"], env={})
    assert ep is not None and (ep.host, ep.port, ep.backend, ep.node_rank, ep.run_id) == (
        "10.0.0.1", 29600, "static", 1, "none")
    ep = coord.endpoint_from_torchrun(["torchrun", "t.py"],
                                      env={"PET_NNODES": "3", "PET_RDZV_BACKEND": "c10d",
                                           "PET_RDZV_ENDPOINT": "head:1234"})
    assert ep is not None and (ep.host, ep.port, ep.nnodes_max) == ("head", 1234, 3)
    assert coord.endpoint_from_torchrun(["torchrun", "--standalone", "t.py"], env={}) is None
    assert coord.endpoint_from_torchrun(["torchrun", "--nproc-per-node", "2", "t.py"],
                                        env={}) is None  # single node: nothing to coordinate
    assert coord.endpoint_from_torchrun(["python", "train.py"], env={}) is None
    ep = coord.endpoint_from_rank_env({"MASTER_ADDR": "n0", "MASTER_PORT": "33295",
                                       "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8",
                                       "TORCHELASTIC_RUN_ID": "job7"})
    assert ep is not None and (ep.host, ep.port, ep.run_id, ep.nnodes_max) == (
        "n0", 33295, "job7", 2)


@pytest.mark.timeout(60)
def test_store_listener_pid(store_server: tuple[str, int, Any]) -> None:
    _host, port, _srv = store_server
    assert coord.store_listener_pid(port, [os.getpid()]) == os.getpid()
    assert coord.store_listener_pid(free_port(), [os.getpid()]) is None
    assert coord.store_listener_pid(port, [2**22 + 7]) is None  # no such process


# ----------------------------------------------------------------------------- real torchrun


def _torchrun_agents(n: int, port: int, tmp: Path
                     ) -> tuple[list[str], list[subprocess.Popen[bytes]]]:
    job = tmp / "job.py"
    job.write_text("import os, time\n"
                   "open(os.path.join(os.environ['OUT'], 'rank%s' % os.environ['RANK']), 'w')"
                   ".write(str(os.getpid()))\ntime.sleep(60)\n")
    env = dict(os.environ, OUT=str(tmp), OMP_NUM_THREADS="1", PET_LOG_DIR=str(tmp / "logs"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(n),
           "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{port}", "--rdzv-id", "coordtest", "--max-restarts", "0", str(job)]
    return cmd, [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  env=env, start_new_session=True) for _ in range(n)]


def _end(p: subprocess.Popen[bytes]) -> None:
    """As watch ends a job: SIGTERM to the agent (it ends its ranks), SIGKILL after a grace."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(5)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(5)


def _kill_ranks(tmp: Path) -> None:
    """torchrun starts each rank in a session of its own: end them by pid, whatever happened."""
    for f in tmp.glob("rank*"):
        with contextlib.suppress(ValueError, OSError):
            pid = int(f.read_text())
            if str(tmp / "job.py").encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)  # still that rank, not a reused pid


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("agents", [2, 3])
def test_real_torchrun_agents_share_their_rendezvous_store(agents: int, tmp_path: Path) -> None:
    """N torchrun agents (c10d rendezvous on 127.0.0.1) and one coordinator per agent on the
    rendezvous endpoint, found from the command line; the host of the store found from /proc;
    the other agents end first, the host last."""
    pytest.importorskip("torch")
    port = free_port()
    cmd, procs = _torchrun_agents(agents, port, tmp_path)
    try:
        ep = coord.endpoint_from_torchrun(cmd, env={})
        assert ep is not None
        assert (ep.port, ep.run_id, ep.nnodes_max) == (port, "coordtest", agents)
        end = time.monotonic() + 90
        while time.monotonic() < end and len(list(tmp_path.glob("rank*"))) < agents:
            time.sleep(0.2)
        assert len(list(tmp_path.glob("rank*"))) == agents, "ranks did not start"
        hosts = [p.pid for p in procs if coord.store_listener_pid(ep.port, [p.pid])]
        assert len(hosts) == 1, hosts  # exactly one agent hosts the rendezvous store
        cs = []
        for i, p in enumerate(procs):
            ch = StoreChannel(ep.host, ep.port, ep.run_id)
            assert ch.connect(timeout=20)
            c = Coordinator(ch, str(i), "localhost", poll_s=0.02)
            c.register([i], hosts_store=p.pid in hosts, world=agents, local_world=1)
            c.start(interval=0.2)
            cs.append(c)
        assert cs[-1].request_capture("test") is not None
        expected = [str(i) for i in range(agents)]

        def node(c: Coordinator, p: subprocess.Popen[bytes]) -> Callable[[], Any]:
            def run() -> Any:
                req = None
                while req is None:
                    req = c.capture_requested()
                    time.sleep(0.01)
                s = NodeSummary(node=c.node, host="localhost",
                                ranks=[coord.RankSummary(rank=int(c.node), state="idle")],
                                world=agents, local_world=1, time=time.time())
                r = c.run_round(req, lambda: s, analyse, expected)
                _end(p)  # end this node's job: the host only once the others acknowledged
                return r
            return run

        out = in_threads([node(c, p) for c, p in zip(cs, procs, strict=True)], timeout=60)
        assert len({r.verdict.request for r in out}) == 1
        assert all(r.verdict.to_json() == out[0].verdict.to_json() for r in out)
        assert all(r.verdict.captured == expected and not r.verdict.local_only for r in out)
        host = next(r for r, p in zip(out, procs, strict=True) if p.pid in hosts)
        assert host.not_ended == []  # every other node had the verdict before the store went
        for c in cs:
            c.close()
    finally:
        for p in procs:
            _end(p)
        _kill_ranks(tmp_path)
