"""NCCL RAS at capture time (moe_hang.capture.ras_job): which jobs are asked (NCCL only,
never gloo), two polls written into the run directory and read back as evidence, RAS off or
unreachable said as a note; and ``--ras FILE`` on the command line (a bad file is one line and
exit 1, before anything starts)."""

from __future__ import annotations

import json
import shutil
import socket

import pytest
from conftest import FIXTURES, run_cli
from test_ras_client import JSON, FakeRas

from moe_hang.analysis.ras.findings import FindingKind
from moe_hang.analysis.ras.reading import read_ras
from moe_hang.capture import ncclras
from moe_hang.capture.ras_job import backend_of, capture_ras, poll_into
from moe_hang.evidence.model import Evidence, RankEvidence
from moe_hang.evidence.probe_records import Heartbeat
from moe_hang.evidence.ras_files import attach_run_ras
from moe_hang.probe.layout import RunLayout
from moe_hang.settings import Settings

RAS = FIXTURES / "ras"


@pytest.fixture(autouse=True)
def no_ncclras(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv(ncclras.ENV_NCCLRAS, raising=False)


def _hb(name: str | None = None, backend: str | None = None) -> Heartbeat:
    hb = Heartbeat(rank=0)
    if name:
        hb.pending = [{"profiling_name": name}]
    if backend:
        hb.progress = {"backend": backend}
    return hb


def test_which_jobs_are_nccl():
    assert backend_of([_hb("nccl:all_reduce")], [], []) == "nccl"
    assert backend_of([_hb("gloo:all_reduce")], [], [{"NCCL_DEBUG": "INFO"}]) == "gloo"
    assert backend_of([_hb(backend="nccl")], [], []) == "nccl"
    assert backend_of([], [], [{"NCCL_SOCKET_IFNAME": "eth0"}]) == "nccl"
    assert backend_of([], [], [{"RANK": "0"}]) is None
    # the recorder, when the heartbeats say nothing
    dumps = sorted((FIXTURES / "fr_started" / "pickle").glob("comm_lib_trace_rank_*"))
    assert backend_of([Heartbeat(rank=0)], dumps, []) == "nccl"


@pytest.mark.timeout(30)
def test_a_gloo_job_is_never_asked(tmp_path):
    layout = RunLayout(tmp_path)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        srv.setblocking(False)
        env = {"NCCL_RAS_ADDR": f"127.0.0.1:{srv.getsockname()[1]}", "NCCL_DEBUG": "INFO"}
        assert not capture_ras(layout, [_hb("gloo:all_reduce")], [env], settings=Settings())
        with pytest.raises(BlockingIOError):
            srv.accept()  # nobody connected
    assert not layout.ras_dir.exists()


@pytest.mark.timeout(30)
def test_two_polls_into_the_run_directory_and_back(tmp_path):
    layout = RunLayout(tmp_path)
    second = (RAS / "frozen_mismatch_poll2.json").read_bytes()
    said: list[str] = []
    with FakeRas([JSON, second]) as srv:
        env = {"NCCL_RAS_ADDR": f"127.0.0.1:{srv.port}"}
        assert poll_into(layout, backend="nccl", env=env, say=said.append,
                         settings=Settings(ras_interval_s=1.2))
    assert said and "twice" in said[0]
    meta = json.loads(layout.ras_meta.read_text())
    assert [p["file"] for p in meta["polls"]] == ["poll1.json", "poll2.json"]
    assert 1.2 <= meta["interval_s"] < 3.0
    assert layout.ras_poll(1, "json").read_bytes() == JSON
    ranks = {r: RankEvidence(rank=r, pid=23300 + r, host="10.9.4.2" if r < 2 else "10.9.4.3")
             for r in range(4)}
    ev = Evidence(ranks=ranks, world_size=4)
    attach_run_ras(ev, tmp_path)
    assert ev.ras is not None and read_ras(ev.ras).compared
    (f,) = read_ras(ev.ras).comparison.of(FindingKind.FROZEN_MISMATCH)
    assert f.global_ranks == (3,)


@pytest.mark.timeout(30)
def test_ras_off_or_unreachable_is_a_note(tmp_path):
    layout = RunLayout(tmp_path / "off")
    layout.root.mkdir()
    assert not poll_into(layout, backend="nccl", env={"NCCL_RAS_ENABLE": "0"},
                         settings=Settings())
    ev = Evidence(ranks={})
    attach_run_ras(ev, layout.root)
    assert ev.ras is not None and "RAS is off" in read_ras(ev.ras).lines()[0]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    layout = RunLayout(tmp_path / "down")
    layout.root.mkdir()
    assert poll_into(layout, backend="nccl", env={"NCCL_RAS_ADDR": f"127.0.0.1:{port}"},
                     settings=Settings(ras_interval_s=0.1))
    ev = Evidence(ranks={})
    attach_run_ras(ev, layout.root)
    assert ev.ras is not None and ev.ras.polls == ()
    assert "127.0.0.1" in read_ras(ev.ras).lines()[0]


# ----------------------------------------------------------------------------- the CLI


@pytest.mark.timeout(120)
def test_analyze_with_ras_files_and_a_bad_one(tmp_path):
    r = run_cli("analyze", "--json", "--ras", str(RAS / "mismatch_4node_2.28.9.json"),
                "--ras", str(RAS / "mismatch_4node_2.28.9_poll2.json"))
    assert r.returncode == 3, r.stderr
    d = json.loads(r.stdout)
    assert d["verdict"] == "desync" and d["culprit_ranks"] == [1]
    assert d["rule"] == "frozen launch counts disagree (RAS)" and d["nccl_ras"]["compared"]
    bad = tmp_path / "bad.json"
    bad.write_text('{"nccl_version": ')
    for args in (["analyze", "--ras", str(bad)],
                 ["analyze", str(FIXTURES / "fr_started" / "json"), "--ras", str(bad)],
                 ["diagnose", "1", "--ras", str(bad)],
                 ["analyze", "--ras", str(RAS / "moving_poll1.json"), "--ras",
                  str(RAS / "frozen_mismatch_poll1.json")]):
        r = run_cli(*args)
        assert r.returncode == 1 and r.stderr.startswith("[error] --ras "), (args, r.stderr)
        assert "Traceback" not in r.stderr and r.stdout == ""
    r = run_cli("analyze")
    assert r.returncode == 1 and "nothing to analyze" in r.stderr


@pytest.mark.timeout(120)
def test_analyze_a_capture_with_its_polls_and_dumps(tmp_path):
    """A watch/diagnose capture holding the recorder's dumps and two RAS polls."""
    cap = tmp_path / "cap"
    layout = RunLayout(cap)
    layout.ranks_dir.mkdir(parents=True)
    for r in range(4):
        shutil.copy(FIXTURES / "fr_started" / "pickle" / f"comm_lib_trace_rank_{r}",
                    layout.rank(r).fr)
    (cap / "processes.json").write_text(json.dumps({"world_size": 4, "job": "stalled",
        "ranks": {str(r): {"pid": 41000 + r, "host": "node0", "alive": True,
                           "exit_code": None, "progressed": False} for r in range(4)}}))
    layout.ras_dir.mkdir()
    sym = (RAS / "symmetric_hang_poll1.json").read_text()
    data = json.loads(sym)
    data["communicators"] = [data["communicators"][1]]  # the 4 ranks of node 0
    for i, ts in enumerate(("2026-03-04 02:10:00", "2026-03-04 02:10:05"), 1):
        data["timestamp"] = ts
        layout.ras_poll(i, "json").write_text(json.dumps(data, indent=2))
    layout.ras_meta.write_text(json.dumps({"polls": [
        {"file": "poll1.json", "source": "RAS at localhost:28028 (socket)"},
        {"file": "poll2.json", "source": "RAS at localhost:28028 (socket)"}],
        "interval_s": 3.0, "aliases": {"10.7.0.21": "node0"}}))
    r = run_cli("analyze", "--json", str(cap))
    assert r.returncode == 3, r.stderr
    d = json.loads(r.stdout)
    assert d["verdict"] == "transport_hang" and d["certainty"] == "likely", d["summary"]
    assert d["nccl_ras"]["mapped_by"] == "host and pid"
