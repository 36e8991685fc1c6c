"""The RAS client (moe_hang.capture.ras) against a loopback server written here that speaks
the protocol as NCCL's RAS thread does (src/ras/client_support.cc: one answer line per command,
the report ended by closing), and against fake ``ncclras`` binaries on PATH."""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import FIXTURES

from moe_hang.analysis.ras.compare import compare_reports
from moe_hang.analysis.ras.findings import FindingKind
from moe_hang.capture import ncclras
from moe_hang.capture.ras import RasEndpoint, query_ras, ras_endpoint, take_two
from moe_hang.errors import MoeHangError

RAS = FIXTURES / "ras"
JSON = (RAS / "frozen_mismatch_poll1.json").read_bytes()
HANDSHAKE = b"CLIENT PROTOCOL 2\nTIMEOUT 2\nSET FORMAT json\nSTATUS\n"


class FakeRas(threading.Thread):
    """Serves ``reports`` (one per connection) like NCCL's RAS thread. ``stall_after``: send
    that many bytes of the report, then nothing until released; ``silent``: never answer;
    ``json``: whether SET FORMAT json is known (NCCL >= 2.28.7); ``hello``: the first answer."""

    def __init__(self, reports: list[bytes], *, stall_after: int | None = None,
                 silent: bool = False, json: bool = True,
                 hello: bytes = b"SERVER PROTOCOL 2\n") -> None:
        super().__init__(daemon=True)
        self.reports, self.stall_after, self.silent, self.json = reports, stall_after, silent, json
        self.hello = hello
        self.release = threading.Event()
        self.received: list[bytes] = []
        self.client_closed: list[bool] = []
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.srv.settimeout(20)
        self.port = self.srv.getsockname()[1]

    def run(self) -> None:
        try:
            for report in self.reports:
                conn, _ = self.srv.accept()
                with conn:
                    conn.settimeout(20)
                    self.serve(conn, report)
        except OSError:
            pass
        finally:
            self.srv.close()

    def serve(self, conn: socket.socket, report: bytes) -> None:
        got = b""
        pending = b""
        while True:
            chunk = conn.recv(4096)
            if not chunk:
                self.received.append(got)
                return
            got += chunk
            pending += chunk
            while b"\n" in pending:
                raw, _, pending = pending.partition(b"\n")
                cmd = raw.decode()
                if self.silent:
                    self.release.wait(20)
                    self.received.append(got)
                    return
                if cmd.startswith("CLIENT PROTOCOL "):
                    conn.sendall(self.hello)
                elif cmd.startswith("TIMEOUT "):
                    conn.sendall(b"OK\n")
                elif cmd == "SET FORMAT json":
                    conn.sendall(b"OK\n" if self.json
                                 else b"ERROR: Unknown command set format json\n")
                elif cmd == "STATUS":
                    self.received.append(got)
                    self.send_report(conn, report)
                    return
                else:
                    conn.sendall(f"ERROR: Unknown command {cmd}\n".encode())

    def send_report(self, conn: socket.socket, report: bytes) -> None:
        if self.stall_after is None:
            for i in range(0, len(report), 512):  # in pieces, as RAS's send queue does
                conn.sendall(report[i:i + 512])
            return
        conn.sendall(report[: self.stall_after])
        self.release.wait(20)
        try:  # did the client give up and close its end?
            conn.settimeout(0.5)
            self.client_closed.append(conn.recv(1) == b"")
        except OSError:
            self.client_closed.append(True)

    def __enter__(self) -> FakeRas:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.srv.close()
        self.join(5)
        assert not self.is_alive()


def ep(server: FakeRas) -> RasEndpoint:
    return RasEndpoint("127.0.0.1", server.port)


@pytest.fixture(autouse=True)
def no_ncclras(monkeypatch):
    """The socket path unless a test puts a fake ncclras on PATH."""
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv(ncclras.ENV_NCCLRAS, raising=False)


def threads_now() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.ident is not None}


# ----------------------------------------------------------------------------- the socket


@pytest.mark.timeout(30)
def test_json_report_over_the_socket_with_nccls_handshake():
    with FakeRas([JSON]) as srv:
        a = query_ras(ep(srv), ras_timeout_s=2)
    assert a.ok and a.error is None and (a.via, a.fmt) == ("socket", "json")
    assert srv.received == [HANDSHAKE]  # exactly ncclras's commands, each ending in \n
    assert a.report is not None and [c.size for c in a.report.communicators] == [4, 2]
    assert a.text.encode() == JSON and a.seconds < 5


@pytest.mark.timeout(30)
def test_the_comma_defect_over_the_socket_is_repaired():
    with FakeRas([(RAS / "missing_comma_2.28.9.json").read_bytes()]) as srv:
        a = query_ras(ep(srv), ras_timeout_s=2)
    assert a.ok and a.report is not None and "2.28.9" in a.report.repaired


@pytest.mark.timeout(30)
def test_nccl_without_json_gives_its_text_report():
    text = (RAS / "text_mismatch_2.26.2_poll1.txt").read_bytes()
    with FakeRas([text], json=False) as srv:
        a = query_ras(ep(srv), ras_timeout_s=2)
    assert a.ok and a.fmt == "text" and a.report is not None and a.report.fmt == "text"
    assert any("2.28.7" in n for n in a.notes)


@pytest.mark.timeout(30)
def test_a_server_that_stalls_mid_report_times_out_and_leaves_nothing():
    before = threads_now()
    with FakeRas([JSON], stall_after=300) as srv:
        t0 = time.monotonic()
        a = query_ras(ep(srv), ras_timeout_s=1, deadline_s=2.5)
        took = time.monotonic() - t0
        assert threads_now() - before == {srv.ident}  # the client started none
        srv.release.set()
        srv.join(5)
    assert not a.ok and a.report is None
    assert a.error is not None and "sent 300 bytes of its report" in a.error
    assert 2.0 <= took < 4.0
    assert srv.client_closed == [True]  # the client closed its socket
    assert threads_now() - before == set()


@pytest.mark.timeout(30)
def test_a_server_that_never_answers_the_handshake_times_out():
    with FakeRas([JSON], silent=True) as srv:
        t0 = time.monotonic()
        a = query_ras(ep(srv), ras_timeout_s=1, deadline_s=1.5)
        assert time.monotonic() - t0 < 3.0
    assert not a.ok and a.error is not None and "did not answer 'CLIENT PROTOCOL 2'" in a.error


@pytest.mark.timeout(30)
def test_a_refused_connection_is_a_clear_answer():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    a = query_ras(RasEndpoint("127.0.0.1", port), ras_timeout_s=5, deadline_s=3)
    assert not a.ok and a.error is not None
    assert a.error.startswith(f"nothing listens at 127.0.0.1:{port}")
    assert "NCCL_RAS_ADDR" in a.error and a.seconds < 3


@pytest.mark.timeout(30)
def test_something_else_on_the_port_is_not_taken_for_ras():
    with FakeRas([JSON], hello=b"HTTP/1.1 400 Bad Request\n") as srv:
        a = query_ras(ep(srv), ras_timeout_s=1)
    assert not a.ok and a.error is not None and "is not a RAS server" in a.error


@pytest.mark.timeout(30)
def test_an_unreadable_report_keeps_the_text_and_says_why():
    with FakeRas([b'{"communicators": [{"hash": "0x1",]}\n']) as srv:
        a = query_ras(ep(srv), ras_timeout_s=1)
    assert not a.ok and a.text.startswith("{") and a.error is not None
    assert "answered, but not valid JSON" in a.error


@pytest.mark.timeout(30)
def test_take_two_polls_apart_and_the_comparison_reads_them():
    second = (RAS / "frozen_mismatch_poll2.json").read_bytes()
    with FakeRas([JSON, second]) as srv:
        pair = take_two(0.6, ep(srv), ras_timeout_s=1)
    assert pair.second is not None and pair.second.ok and pair.interval_s is not None
    assert 0.6 <= pair.interval_s < 2.0
    assert pair.first.report is not None and pair.second.report is not None
    cmp = compare_reports(pair.first.report, pair.second.report, interval_s=pair.interval_s)
    (f,) = cmp.of(FindingKind.FROZEN_MISMATCH)
    assert f.ranks == (1,) and f.op == "AllGather"


@pytest.mark.timeout(30)
def test_take_two_stops_when_the_first_fails():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    pair = take_two(5.0, RasEndpoint("127.0.0.1", port), ras_timeout_s=5)
    assert pair.second is None and pair.interval_s is None and not pair.first.ok
    assert time.monotonic() - t0 < 2.0  # no sleep for a second poll that cannot work


@pytest.mark.parametrize("value,host,port", [
    (None, "localhost", 28028), ("", "localhost", 28028), ("10.0.0.7:29000", "10.0.0.7", 29000),
    ("[::1]:28030", "::1", 28030), ("node3", "node3", 28028), ("[fe80::2]", "fe80::2", 28028),
])
def test_the_endpoint_from_nccl_ras_addr(monkeypatch, value, host, port):
    if value is None:
        monkeypatch.delenv("NCCL_RAS_ADDR", raising=False)
    else:
        monkeypatch.setenv("NCCL_RAS_ADDR", value)
    assert ras_endpoint() == RasEndpoint(host, port)


@pytest.mark.parametrize("value", ["host:port", "host:0", ":28028", "[::1", "[::1]x", "h:99999"])
def test_a_bad_nccl_ras_addr_is_refused(value):
    with pytest.raises(MoeHangError, match="NCCL_RAS_ADDR"):
        ras_endpoint(value)


# ----------------------------------------------------------------------------- ncclras


def fake_ncclras(tmp: Path, body: str, monkeypatch) -> Path:
    d = tmp / "bin"
    d.mkdir(exist_ok=True)
    exe = d / "ncclras"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", os.pathsep.join([str(d), "/usr/bin", "/bin"]))
    return exe


@pytest.mark.timeout(30)
def test_ncclras_on_path_is_used_with_its_flags(tmp_path, monkeypatch):
    fake_ncclras(tmp_path, f'echo "$@" > {tmp_path}/argv\ncat {RAS}/dead_rank_2.29.7.json\n',
                 monkeypatch)
    a = query_ras(RasEndpoint("10.1.2.3", 28031), ras_timeout_s=3)
    assert a.ok and (a.via, a.fmt) == ("ncclras", "json")
    assert (tmp_path / "argv").read_text().split() == ["-f", "json", "-t", "3", "-h",
                                                       "10.1.2.3", "-p", "28031"]
    assert a.report is not None and a.report.communicators[0].missing_ranks[0].considered_dead


@pytest.mark.timeout(30)
def test_an_ncclras_without_json_is_asked_for_text(tmp_path, monkeypatch):
    fake_ncclras(tmp_path, (
        'if [ "$1" = "-f" ]; then echo "ncclras: invalid option -- \'f\'" >&2; exit 1; fi\n'
        f"cat {RAS}/text_incomplete_2.24.3.txt\n"), monkeypatch)
    a = query_ras(ras_timeout_s=2)
    assert a.ok and a.fmt == "text" and a.report is not None and a.report.nccl_version == "2.24.3"
    assert any("no -f" in n for n in a.notes)


@pytest.mark.timeout(30)
def test_an_ncclras_that_cannot_connect_says_so(tmp_path, monkeypatch):
    fake_ncclras(tmp_path, (
        'echo "Connecting to 127.0.0.1:28028: Connection refused" >&2\n'
        'echo "Failed to connect to the NCCL RAS service!" >&2\nexit 1\n'), monkeypatch)
    a = query_ras(ras_timeout_s=2)
    assert not a.ok and a.error is not None and "found nothing listening" in a.error
    assert "Connection refused" in a.error


@pytest.mark.timeout(30)
def test_an_ncclras_that_hangs_is_killed_with_what_it_started(tmp_path, monkeypatch):
    # it retries forever, with a child of its own (killed with its process group)
    fake_ncclras(tmp_path, (f"sleep 60 &\necho $! > {tmp_path}/child\necho $$ > {tmp_path}/me\n"
                            "echo 'Connection timed out; retrying...' >&2\nwait\n"), monkeypatch)
    t0 = time.monotonic()
    a = query_ras(ras_timeout_s=1, deadline_s=1.5)
    assert 1.4 <= time.monotonic() - t0 < 4.0
    assert not a.ok and a.error is not None and "did not finish within its deadline" in a.error
    for name in ("me", "child"):
        pid = int((tmp_path / name).read_text())
        deadline = time.monotonic() + 3
        while psutil.pid_exists(pid) and time.monotonic() < deadline:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    break  # killed, not yet reaped by its parent (init)
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)
        alive = psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        assert not alive, f"{name} ({pid}) survived"


@pytest.mark.timeout(30)
def test_socket_is_forced_even_with_ncclras_on_path(tmp_path, monkeypatch):
    fake_ncclras(tmp_path, f"touch {tmp_path}/ran\nexit 1\n", monkeypatch)
    with FakeRas([JSON]) as srv:
        a = query_ras(ep(srv), ras_timeout_s=2, use="socket")
    assert a.ok and a.via == "socket" and not (tmp_path / "ran").exists()


def test_asking_for_ncclras_without_it():
    a = query_ras(RasEndpoint("127.0.0.1", 1), ras_timeout_s=5, use="ncclras")
    assert not a.ok and a.error == "ncclras is not on PATH"
    assert os.environ["PATH"] == "/nonexistent"
