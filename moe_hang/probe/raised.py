"""What the probe records of an exception (stdlib only: loaded into the job's environment): the
one that ends a rank (``sys.excepthook``) and the ones that end one of its threads
(``threading.excepthook``: a prefetch or logging thread dies, the rank lives on, and what that
thread would have posted never comes)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

THREAD_ERRORS_KEPT = 8  # the last few threads' exceptions, with their names and ids
# how long the SIGTERM relay waits for the exception record the main thread is writing: a
# launcher's SIGTERM comes as a peer's failure ends the job, often while this rank's own
# excepthook records its error (milliseconds; the launcher's SIGKILL follows ~30 s later)
RECORD_WAIT_S = 2.0
_NOT_RECORDING = threading.Event()  # clear while the rank's exception is being recorded
_NOT_RECORDING.set()


def record_error(exc: BaseException, restart: int | None,
                 write: Callable[[dict[str, Any]], None]) -> None:
    """:func:`error_record`, handed to ``write``; a SIGTERM meanwhile waits for it
    (:func:`wait_for_record`), so the signal ends the rank only once it is on disk."""
    _NOT_RECORDING.clear()
    try:
        write(error_record(exc, restart))
    finally:
        _NOT_RECORDING.set()


def wait_for_record() -> None:
    """Bounded: a main thread that never returns from its excepthook ends the rank anyway."""
    _NOT_RECORDING.wait(RECORD_WAIT_S)


def error_record(exc: BaseException, restart: int | None) -> dict[str, Any]:
    """Type, first line, frames innermost first. The frames straight from the traceback, not
    through the traceback module: that stats and reads every file of it (linecache; torch's
    are large), and on a loaded machine torchrun's SIGTERM has ended ranks half-way through,
    before the record was on disk (its line lost)."""
    frames: list[list[Any]] = []
    t = exc.__traceback__
    while t is not None:
        frames.append([t.tb_frame.f_code.co_filename, t.tb_lineno, t.tb_frame.f_code.co_name])
        t = t.tb_next
    return {"type": type(exc).__name__,
            "message": (str(exc).strip().splitlines() or [""])[0][:500],
            "frames": frames[::-1][:80], "time": time.time(), "restart": restart}


def chain_excepthook(record: Callable[[BaseException], None],
                     hold: Callable[[], None]) -> None:
    """Record the exception that ends the rank (then ``hold``), before Python prints it."""
    previous = sys.excepthook

    def hook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
        if not isinstance(value, (KeyboardInterrupt, SystemExit)):
            with contextlib.suppress(Exception):
                record(value)
            with contextlib.suppress(Exception):
                hold()
        previous(tp, value, tb)

    sys.excepthook = hook


def chain_thread_excepthook(
        record: Callable[[BaseException, threading.Thread | None], None]) -> None:
    """Record an exception that ends one of the job's threads, before Python prints it."""
    previous = threading.excepthook

    def hook(args: Any) -> None:
        if args.exc_value is not None and not isinstance(args.exc_value, SystemExit):
            with contextlib.suppress(Exception):
                record(args.exc_value, args.thread)
        previous(args)

    threading.excepthook = hook
