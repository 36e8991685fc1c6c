"""A TCP port for a test job's store (``--master_port``, a rendezvous endpoint).

Binding port 0 and closing it hands out a port from the kernel's ephemeral range, and any
connection made before torchrun binds it may take it again: gloo opens many, and two pytest
workers running jobs side by side made it happen (EADDRINUSE, "no rank ever started"). The
port is drawn instead below the ephemeral range, from a block of its own per pytest-xdist
worker, and checked free by binding it."""

from __future__ import annotations

import os
import random
import socket

BLOCK = 2500  # ports per pytest-xdist worker
FIRST = 10000  # below every ephemeral range in use (Linux: 32768 and up by default)


def _ephemeral() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _worker() -> int:
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0


def free_port() -> int:
    lo, hi = _ephemeral()
    base = FIRST + _worker() * BLOCK
    for _ in range(100):
        port = random.randint(base, base + BLOCK - 1)
        if lo <= port <= hi:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no block free: the kernel's choice, as before
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
