"""Asking the probes for dumps, bounded (capture/dumps.py): an answer later than the dump
timeout still counts while the capture's other work (py-spy) goes on, never past it."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from moe_hang.capture.dumps import dumps_beside, request_dumps
from moe_hang.probe.layout import RankFiles


def _probe(tmp_path: Path, answer_after_s: float) -> tuple[Path, threading.Thread, int]:
    """A stand-in probe for rank 0: a FIFO it listens on, and its answer (the marker file
    naming the request) written ``answer_after_s`` after the request arrives."""
    files = RankFiles(tmp_path, 0)
    files.ctl.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(files.ctl)
    fd = os.open(files.ctl, os.O_RDONLY | os.O_NONBLOCK)

    def answer() -> None:
        deadline = time.monotonic() + 10
        line = b""
        while b"\n" not in line and time.monotonic() < deadline:
            try:
                line += os.read(fd, 256)
            except BlockingIOError:
                time.sleep(0.01)
        time.sleep(answer_after_s)
        request = line.decode().split()[1]
        files.dump_marker.write_text(json.dumps({"request": request}))

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    return tmp_path, t, fd


@pytest.mark.parametrize("stacks_done_after_s, answered", [(1.0, True), (0.1, False)])
def test_a_late_answer_counts_while_the_stacks_are_still_read(tmp_path, stacks_done_after_s,
                                                              answered):
    probe_dir, t, fd = _probe(tmp_path, answer_after_s=0.5)
    read = threading.Event()
    timer = threading.Timer(stacks_done_after_s, read.set)
    timer.start()
    t0 = time.monotonic()
    errors = request_dumps(probe_dir, [0], timeout=0.2, meanwhile=read, grace=5.0)
    took = time.monotonic() - t0
    t.join(5)
    timer.join(5)
    os.close(fd)
    assert (errors[0] is None) == answered, errors
    # bounded by the stacks, not by the grace
    assert took < (1.5 if answered else 0.6), took


def test_without_other_work_the_timeout_alone_bounds_the_wait(tmp_path):
    probe_dir, t, fd = _probe(tmp_path, answer_after_s=0.5)
    t0 = time.monotonic()
    errors = request_dumps(probe_dir, [0], timeout=0.2)
    assert time.monotonic() - t0 < 0.45
    assert errors[0] == "probe did not answer within 0 s"
    t.join(5)
    os.close(fd)


@pytest.mark.parametrize("work_s, answered", [(1.0, True), (0.1, False)])
def test_dumps_beside_the_stacks_return_both_and_end_with_the_work(tmp_path, work_s, answered):
    """The one helper watch and diagnose use: the work's result, and the answers that came
    while it ran (a late one counts only while the work goes on)."""
    probe_dir, t, fd = _probe(tmp_path, answer_after_s=0.5)
    t0 = time.monotonic()
    out, errors = dumps_beside({probe_dir: [0]}, lambda: time.sleep(work_s) or "stacks",
                               timeout=0.2, grace=5.0)
    took = time.monotonic() - t0
    t.join(5)
    os.close(fd)
    assert out == "stacks"
    assert (errors[0] is None) == answered, errors
    assert took < (1.5 if answered else 0.6), took  # the work's end, or the timeout


def test_dumps_beside_with_nothing_to_ask_runs_the_work_alone():
    assert dumps_beside({}, lambda: 7, timeout=5.0, grace=5.0) == (7, {})
