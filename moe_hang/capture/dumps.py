"""Ask the probes inside live ranks for a Flight Recorder + stack dump, bounded.

Requests go through each probe's FIFO without blocking; answers are awaited until a deadline,
after which the rank is reported as not answering. This works while a rank's main thread is
blocked inside a collective (the probe's own thread answers).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from moe_hang.probe.layout import RankFiles

T = TypeVar("T")


def request_dumps(probe_dir: Path, ranks: list[int], *, timeout: float,
                  meanwhile: threading.Event | None = None, grace: float = 0.0
                  ) -> dict[int, str | None]:
    """Ask each rank's probe thread for a Flight Recorder + stack dump; rank -> error or None.
    ``timeout``: ``Settings.dump_timeout_s``. Past it, an answer still counts while the
    capture's other work goes on (``meanwhile`` not set yet: py-spy reading the stacks on a
    loaded machine, where a probe's first dump with call sites takes seconds of CPU), at most
    ``grace`` seconds more: no wait of its own."""
    request = f"{os.getpid()}-{time.monotonic_ns()}"
    errors: dict[int, str | None] = {}
    waiting = []
    for r in ranks:
        fifo = RankFiles(probe_dir, r).ctl
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            errors[r] = "no probe in this rank"
            continue
        except OSError:
            errors[r] = "probe not listening (the rank has exited)"
            continue
        try:
            os.write(fd, f"dump {request}\n".encode())
            waiting.append(r)
        except OSError as exc:
            errors[r] = f"could not reach the probe ({exc.strerror})"
        finally:
            os.close(fd)
    deadline = time.monotonic() + timeout
    last = deadline + grace

    def on() -> bool:
        now = time.monotonic()
        return now < deadline or (meanwhile is not None and not meanwhile.is_set()
                                  and now < last)

    while waiting and on():
        for r in list(waiting):
            marker = RankFiles(probe_dir, r).dump_marker
            with contextlib.suppress(OSError, ValueError):
                if json.loads(marker.read_text()).get("request") == request:
                    errors[r] = None
                    waiting.remove(r)
        if waiting:
            time.sleep(0.02)
    for r in waiting:
        errors[r] = f"probe did not answer within {timeout:.0f} s"
    return errors


def dumps_beside(requests: Mapping[Path, list[int]], work: Callable[[], T], *, timeout: float,
                 grace: float) -> tuple[T, dict[int, str | None]]:
    """Ask the probes (``requests``: probe directory -> its ranks) for their dumps while
    ``work`` runs (py-spy reading the stacks, at the same moment): what ``work`` returned, and
    rank -> error or None. A late answer still counts while ``work`` goes on, at most ``grace``
    seconds past ``timeout``; once it is done the asking ends within its own bound."""
    errors: dict[int, str | None] = {}
    done = threading.Event()

    def ask() -> None:
        for d, ranks in requests.items():
            errors.update(request_dumps(d, ranks, timeout=timeout, meanwhile=done, grace=grace))

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    try:
        result = work()
    finally:
        done.set()
    asker.join(timeout + 2.0)  # its own bound, and a margin
    return result, dict(errors)
