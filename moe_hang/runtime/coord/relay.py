"""The watchers' own store (the relay): where the watchers of a torchrun job talk once they have
met in the job's store.

The job's store lives in the torchrun agent that hosts it. When a rank of that node dies of a
signal (SIGKILL, gloo's SIGABRT on a size mismatch), nothing can hold it back the way a rank
that raised is held: its agent ends the node at once, and the store goes with it, before any
round could run — the other nodes then decide alone. So the watcher on the store's node serves
a TCPStore of its own and names it (``relay`` in the run's namespace of the job's store); every
watcher moves there before it registers, and a round outlives the job's store. That watcher
already ends last (it hosts the store), so the relay stays up while any other needs it.
"""

from __future__ import annotations

import contextlib
import socket
from datetime import timedelta
from typing import Any

from moe_hang.runtime.coord.store import StoreChannel, _import_dist

RELAY_KEY = "relay"


def local_address(host: str, port: int, timeout: float = 2.0) -> str | None:
    """This machine's address on the way to ``host:port`` (the job's store): the others
    reach the store there, so they reach this machine by that address too (127.0.0.1 for a
    store on the loopback)."""
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout) as s:
        return str(s.getsockname()[0])
    return None


class Relay:
    """A TCPStore server in this watcher (port chosen by the system), and the address the
    others connect to. Closing it ends the server. ``op_timeout_s``: the server's own timeout
    for a client's blocking operation (``Settings.relay_op_timeout_s``)."""

    def __init__(self, address: str, op_timeout_s: float) -> None:
        dist = _import_dist()
        self._server: Any = dist.TCPStore(address, 0, is_master=True, wait_for_workers=False,
                                          timeout=timedelta(seconds=op_timeout_s))
        self.address, self.port = address, int(self._server.port)

    def spec(self) -> bytes:
        return f"{self.address}:{self.port}".encode()

    def close(self) -> None:
        self._server = None  # the last reference: the server thread stops with it


def parse_spec(raw: bytes | None) -> tuple[str, int] | None:
    """``host:port`` as the relay's watcher wrote it; None for anything else."""
    if not raw:
        return None
    host, _, port = raw.decode(errors="replace").rpartition(":")
    return (host, int(port)) if host and port.isdigit() and 0 < int(port) < 65536 else None


def open_relay(raw: bytes | None, run: str, connect_s: float) -> StoreChannel | None:
    """A channel on the relay named by ``raw``; None when it names none or cannot be reached
    (the caller stays on the job's store)."""
    spec = parse_spec(raw)
    if spec is None:
        return None
    ch = StoreChannel(spec[0], spec[1], run)
    if ch.connect(timeout=connect_s):
        return ch
    ch.close()
    return None
