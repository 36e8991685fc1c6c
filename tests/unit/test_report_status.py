"""The status line never lands on a line the job is writing; the job's bytes pass through
unchanged (``\\r`` progress bars included); once interrupted, nothing more is echoed."""

from __future__ import annotations

import io
import os
import threading
import time

import pytest

from moe_hang.commands.watch import _Echo, _pump
from moe_hang.report.status import ERASE, JobOutput, Terminal
from moe_hang.settings import Settings

pytestmark = pytest.mark.timeout(30)


class _Log:
    """One ordered record of what reached the terminal, from both writers."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str | bytes]] = []
        self.lock = threading.Lock()

    def stream(self, name: str) -> _Stream:
        return _Stream(self, name)

    def job(self) -> bytes:
        return b"".join(d for n, d in self.events if n == "job" and isinstance(d, bytes))

    def draws(self) -> list[int]:
        return [i for i, (n, d) in enumerate(self.events)
                if n == "status" and isinstance(d, str) and d != ERASE]


class _Stream:
    def __init__(self, log: _Log, name: str) -> None:
        self.log, self.name = log, name

    def write(self, data: str | bytes) -> int:
        with self.log.lock:
            self.log.events.append((self.name, data))
        return len(data)

    def flush(self) -> None:
        pass


def _terminal(log: _Log) -> Terminal:
    return Terminal(live=True, plain=False, settings=Settings(),
                    job=log.stream("job"),  # type: ignore[arg-type]
                    status=log.stream("status"))  # type: ignore[arg-type]


def _assert_never_on_a_job_line(log: _Log) -> None:
    """Before every draw: the job's last byte was a newline, and it was erased before the
    job wrote again."""
    last = b"\n"
    shown = False
    for name, data in log.events:
        if name == "job":
            assert not shown, "job bytes written over the status line"
            last = data[-1:] if data else last
        elif data == ERASE:
            shown = False
        else:
            assert last == b"\n", f"status drawn after the job's {last!r}"
            shown = True


def test_status_line_waits_for_the_jobs_line_end_and_quiet():
    log = _Log()
    term = _terminal(log)
    term.say("launching")
    assert log.draws(), "a phase is shown at once when the job has written nothing"
    term.job_bytes(b"step 1/3\r")
    assert log.events[-2] == ("status", ERASE) and log.events[-1] == ("job", b"step 1/3\r")
    term.say("watching")
    time.sleep(Settings().status_quiet_s * 2.5)
    assert log.events[-1] == ("job", b"step 1/3\r"), "drawn on the job's progress line"
    term.job_bytes(b"step 2/3\rstep 3/3\n")
    n = len(log.draws())
    time.sleep(Settings().status_quiet_s * 2.5)
    assert len(log.draws()) > n, "not drawn again once the job ended its line and was quiet"
    term.notice("[moe-hang] rank 1 still computing")
    term.close()
    assert log.job() == b"step 1/3\rstep 2/3\rstep 3/3\n[moe-hang] rank 1 still computing\n"
    assert log.events[-1] == ("status", ERASE) or log.events[-1][0] == "job"
    _assert_never_on_a_job_line(log)


def test_a_busy_job_never_shares_its_line():
    log = _Log()
    term = _terminal(log)
    term.say("watching")
    stop = time.monotonic() + 1.5
    sent = []
    i = 0
    while time.monotonic() < stop:  # tqdm-like: \r every 20 ms, a newline now and then
        chunk = f"\r{i:4d}%".encode() + (b"\n" if i % 40 == 39 else b"")
        term.job_bytes(chunk)
        sent.append(chunk)
        term.say(f"phase {i}")
        i += 1
        time.sleep(0.02)
    term.close()
    assert log.job().startswith(b"".join(sent))
    _assert_never_on_a_job_line(log)


def test_close_ends_an_unfinished_line_and_erases():
    log = _Log()
    term = _terminal(log)
    term.job_bytes(b"50%")
    term.say("tearing down")
    term.close()
    assert log.job() == b"50%\n"  # the report starts on a line of its own
    term.say("late")  # after close: nothing is drawn any more
    assert not log.draws()


def test_without_a_terminal_phases_are_plain_lines_or_nothing():
    out = io.StringIO()
    plain = Terminal(live=False, plain=True, settings=Settings(), job=io.BytesIO(), status=out)
    plain.say("launching 2 ranks")
    plain.close()
    assert out.getvalue() == "· launching 2 ranks\n"
    out = io.StringIO()
    quiet = Terminal(live=False, plain=False, settings=Settings(), job=io.BytesIO(), status=out)
    quiet.say("launching 2 ranks")
    quiet.job_bytes(b"x\n")
    quiet.close()
    assert out.getvalue() == ""


def test_pump_passes_chunks_through_unchanged_and_the_gate_closes():
    r, w = os.pipe()
    log, job = io.BytesIO(), io.BytesIO()
    term = Terminal(live=False, plain=False, settings=Settings(), job=job, status=io.StringIO())
    gate = _Echo(JobOutput(term))
    with os.fdopen(r, "rb", buffering=0) as stream:
        t = threading.Thread(target=_pump, args=(stream, log, gate))
        t.start()
        os.write(w, b"\r 10%")
        time.sleep(0.1)
        assert job.getvalue() == b"\r 10%", "a chunk without a newline waits for nothing"
        os.write(w, b"\r100%\n\xff\xfe raw bytes\n")
        time.sleep(0.1)
        gate.on = False  # an interrupt is being handled: torchrun's traceback stays out
        os.write(w, b"Traceback (most recent call last):\n")
        os.close(w)
        t.join(5)
    assert job.getvalue() == b"\r 10%\r100%\n\xff\xfe raw bytes\n"
    assert log.getvalue().endswith(b"Traceback (most recent call last):\n")


def test_a_plain_line_printer_still_gets_whole_lines():
    lines: list[str] = []
    gate = _Echo(lines.append)
    for chunk in (b"ab", b"c\nde", b"\xc3", b"\xa9\n"):
        gate(chunk)
    assert lines == ["abc", "deé"]
