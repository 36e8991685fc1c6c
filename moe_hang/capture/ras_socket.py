"""NCCL's RAS client protocol over a socket, as ``ncclras`` speaks it (src/ras/client.cc) —
every wait bounded.

The protocol is text, one command per line ending in ``\\n``, one answer line per command:
``CLIENT PROTOCOL 2`` -> ``SERVER PROTOCOL 2``; ``TIMEOUT <s>`` (how long RAS waits for its
peers while gathering) -> ``OK``; ``SET FORMAT json`` (NCCL >= 2.28.7) -> ``OK``, older releases
answer ``ERROR: Unknown command ...`` and keep the text format; ``STATUS`` -> the report, whose
end is the server closing the connection. Nothing runs in the background: the socket lives in
this call and is closed on every way out.
"""

from __future__ import annotations

import contextlib
import socket
import time
from dataclasses import dataclass, field

PROTOCOL = 2  # NCCL_RAS_CLIENT_PROTOCOL (2.24 to 2.30)
MAX_REPORT_BYTES = 64 * 1024 * 1024  # a runaway answer is cut, not buffered forever
_LINE_MAX = 4096


class RasProtocolError(Exception):
    """Why no report came back, in one line."""


@dataclass
class SocketAnswer:
    text: str
    fmt: str  # what the server agreed to: json | text
    asked_at: float  # time.monotonic() when STATUS went out
    notes: list[str] = field(default_factory=list)


class _Conn:
    """A connected socket whose every read waits at most ``per_read`` s and never past the
    call's deadline."""

    def __init__(self, sock: socket.socket, where: str, deadline: float, per_read: float):
        self.sock, self.where, self.deadline, self.per_read = sock, where, deadline, per_read
        self.buf = b""

    def send(self, line: str) -> None:
        self.sock.settimeout(self._wait("send"))
        try:
            self.sock.sendall(line.encode() + b"\n")
        except TimeoutError:
            raise RasProtocolError(f"{self.where} did not take {line!r} in time") from None
        except OSError as exc:
            raise RasProtocolError(f"{self.where} closed the connection ({exc.strerror or exc})"
                                   ) from None

    def _wait(self, what: str) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RasProtocolError(f"{self.where}: no {what} before the deadline")
        return min(self.per_read, left)

    def _recv(self, what: str) -> bytes:
        wait = self._wait(what)
        self.sock.settimeout(wait)
        try:
            return self.sock.recv(65536)
        except TimeoutError:
            raise _Silent(wait) from None
        except OSError as exc:
            raise RasProtocolError(f"{self.where} broke the connection during the {what} "
                                   f"({exc.strerror or exc})") from None

    def line(self, after: str) -> str:
        while b"\n" not in self.buf:
            try:
                chunk = self._recv(f"answer to {after!r}")
            except _Silent as s:
                raise RasProtocolError(f"{self.where} did not answer {after!r} within "
                                       f"{s.waited:.0f} s") from None
            if not chunk:
                raise RasProtocolError(f"{self.where} closed the connection after {after!r}")
            self.buf += chunk
            if len(self.buf) > _LINE_MAX:
                raise RasProtocolError(f"{self.where} answered {after!r} with no line end")
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode(errors="replace").rstrip("\r")

    def rest(self) -> bytes:
        """Everything until the server closes (the end of a report)."""
        got = bytearray(self.buf)
        while True:
            try:
                chunk = self._recv("report")
            except _Silent as s:
                raise RasProtocolError(
                    f"{self.where} sent {len(got)} bytes of its report, then nothing for "
                    f"{s.waited:.0f} s" if got else
                    f"{self.where} sent no report within {s.waited:.0f} s") from None
            except RasProtocolError:
                if got:
                    raise RasProtocolError(f"{self.where} sent {len(got)} bytes of its report "
                                           "and did not finish it before the deadline"
                                           ) from None
                raise
            if not chunk:
                return bytes(got)
            got += chunk
            if len(got) > MAX_REPORT_BYTES:
                raise RasProtocolError(f"{self.where} sent more than "
                                       f"{MAX_REPORT_BYTES >> 20} MiB: not a report")


class _Silent(Exception):
    def __init__(self, waited: float) -> None:
        self.waited = waited


def _ok(conn: _Conn, command: str) -> str:
    conn.send(command)
    return conn.line(command)


def ask(host: str, port: int, *, fmt: str, ras_timeout_s: int, deadline: float,
        connect_s: float = 3.0) -> SocketAnswer:
    """One STATUS query; raises :class:`RasProtocolError` with the reason."""
    where = f"RAS at {host}:{port}" if ":" not in host else f"RAS at [{host}]:{port}"
    try:
        sock = socket.create_connection(
            (host, port), timeout=max(0.01, min(connect_s, deadline - time.monotonic())))
    except ConnectionRefusedError:
        raise RasProtocolError(
            f"nothing listens at {host}:{port}: no NCCL process with RAS there (RAS needs "
            "NCCL >= 2.24, is off with NCCL_RAS_ENABLE=0, and listens where NCCL_RAS_ADDR "
            "says)") from None
    except TimeoutError:
        raise RasProtocolError(f"{host}:{port} did not accept a connection within "
                               f"{connect_s:.0f} s") from None
    except OSError as exc:
        raise RasProtocolError(f"cannot connect to {host}:{port}: {exc.strerror or exc}"
                               ) from None
    # ncclras's own read timeout: RAS's TIMEOUT plus 1 s plus RAS_COLLECTIVE_EXTRA_TIMEOUT
    conn = _Conn(sock, where, deadline, per_read=ras_timeout_s + 6.0)
    notes: list[str] = []
    try:
        hello = _ok(conn, f"CLIENT PROTOCOL {PROTOCOL}")
        if not hello.upper().startswith("SERVER PROTOCOL "):
            raise RasProtocolError(f"{host}:{port} is not a RAS server (it answered "
                                   f"{hello[:60]!r})")
        if hello.split()[-1] != str(PROTOCOL):
            notes.append(f"RAS speaks protocol {hello.split()[-1]}, this client {PROTOCOL}")
        answer = _ok(conn, f"TIMEOUT {ras_timeout_s}")
        if answer.upper() != "OK":
            raise RasProtocolError(f"{where} refused 'TIMEOUT {ras_timeout_s}': {answer[:80]}")
        got = "text"
        if fmt == "json":
            answer = _ok(conn, "SET FORMAT json")
            if answer.upper() == "OK":
                got = "json"
            else:  # "ERROR: Unknown command set format json"
                notes.append("RAS has no JSON format (NCCL older than 2.28.7): read its text "
                             "report")
        conn.send("STATUS")
        asked = time.monotonic()
        body = conn.rest()
    finally:
        with contextlib.suppress(OSError):
            sock.close()
    if not body.strip():
        raise RasProtocolError(f"{where} closed the connection without a report")
    return SocketAnswer(body.decode(errors="replace"), got, asked, notes)
