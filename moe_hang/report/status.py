"""The live phase line a person watches while a command works, and the arbiter that keeps
it off the job's own lines.

Under ``watch`` two writers share one terminal: the job (its bytes, passed through unchanged,
``\\r`` progress bars included) and this status line. :class:`Terminal` holds the lock and the
job's last byte: before job bytes are written the status line is erased (``\\r\\x1b[K``); it
is drawn again only when the job's last byte was ``\\n`` and the job has been quiet for
``Settings.status_quiet_s``. Without a terminal there is no status line at all;
``MOE_HANG_PROGRESS=1`` prints the phases as plain lines instead (CI logs).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from typing import BinaryIO, TextIO

from moe_hang.settings import Settings

ERASE = "\r\x1b[K"
_FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


class Terminal:
    """Who writes to the terminal, and when (one lock; the job's last byte)."""

    def __init__(self, *, live: bool, plain: bool, settings: Settings,
                 job: BinaryIO | None = None, status: TextIO | None = None) -> None:
        self._live, self._plain = live, plain
        self._quiet_s, self._tick_s = settings.status_quiet_s, settings.status_tick_s
        self._job_stream = job
        self._status = status if status is not None else sys.stderr
        # reentrant: a Ctrl-C raised in the main thread while it holds the lock must not
        # deadlock the close() on its way out
        self._lock = threading.RLock()
        self._last = b"\n"  # nothing written yet: as good as a line start
        self._last_t = 0.0
        self._text = ""
        self._shown = False
        self._frame = 0
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if live:
            self._ticker = threading.Thread(target=self._tick, name="moe-hang-status",
                                            daemon=True)
            self._ticker.start()

    @property
    def _job(self) -> BinaryIO:
        # resolved late: only watch writes job bytes, and a test's stdout may have no buffer
        return self._job_stream if self._job_stream is not None else sys.stdout.buffer

    # the three writers ---------------------------------------------------------------

    def say(self, text: str) -> None:
        """The current phase: the status line on a terminal, a plain line if asked for."""
        with self._lock:
            self._text = text
            if self._live:
                self._draw()
            elif self._plain:
                self._status.write(f"· {text}\n")
                self._status.flush()

    def job_bytes(self, data: bytes) -> None:
        """The job's own output, unchanged, never on the status line's row."""
        if not data:
            return
        with self._lock:
            self._erase()
            self._job.write(data)
            self._job.flush()
            self._last, self._last_t = data[-1:], time.monotonic()

    def notice(self, text: str) -> None:
        """A line of ours in the job's stream (``[moe-hang] ...``), on a line of its own."""
        with self._lock:
            self._erase()
            lead = b"" if self._last == b"\n" else b"\n"
            self._job.write(lead + text.encode(errors="replace") + b"\n")
            self._job.flush()
            self._last, self._last_t = b"\n", time.monotonic()

    def close(self) -> None:
        """Stop drawing, erase the status line, and end a line the job left unfinished, so
        what is printed next starts at a line of its own."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(1.0)
        with self._lock:
            self._erase()
            self._text = ""
            if self._last != b"\n":
                self._job.write(b"\n")
                self._job.flush()
                self._last = b"\n"

    # drawing ---------------------------------------------------------------------------

    def _tick(self) -> None:
        while not self._stop.wait(self._tick_s):
            with self._lock:
                self._frame = (self._frame + 1) % len(_FRAMES)
                self._draw()

    def _draw(self) -> None:
        """Under the lock: draw the status line if the job is at a line start and quiet."""
        if self._stop.is_set() or not self._text:
            return
        if self._last != b"\n" or time.monotonic() - self._last_t < self._quiet_s:
            return
        cols = shutil.get_terminal_size((80, 24)).columns
        text = self._text[: max(cols - 3, 1)]  # one row: a wrapped status line cannot be erased
        self._status.write(f"{ERASE}\x1b[36m{_FRAMES[self._frame]}\x1b[0m {text}")
        self._status.flush()
        self._shown = True

    def _erase(self) -> None:
        if self._shown:
            self._status.write(ERASE)
            self._status.flush()
            self._shown = False


class JobOutput:
    """What ``watch`` hands the job's output to: bytes to pass through, lines of ours."""

    def __init__(self, term: Terminal) -> None:
        self.term = term

    def job_bytes(self, data: bytes) -> None:
        self.term.job_bytes(data)

    def __call__(self, line: str) -> None:
        self.term.notice(line)


@contextlib.contextmanager
def live_status(enabled: bool = True, *, settings: Settings,
                job: BinaryIO | None = None) -> Iterator[Terminal]:
    """A :class:`Terminal` for one command; ``job`` is where the job's bytes go (watch).

    The status line is drawn only when stderr is a terminal and ``enabled``; otherwise
    phases are printed as plain lines when MOE_HANG_PROGRESS=1 (so pipes and CI logs see
    just the report and one-line errors). On the way out the status line is gone."""
    live = enabled and sys.stderr.isatty()
    plain = enabled and not live and os.environ.get("MOE_HANG_PROGRESS") == "1"
    term = Terminal(live=live, plain=plain, settings=settings, job=job)
    try:
        yield term
    finally:
        term.close()
