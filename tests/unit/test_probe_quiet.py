"""When the probe may symbolize the recorder's frames at a capture (torch imports
torch._dynamo to do it): only while the job's main thread waits — inside torch.distributed, or
in a C call of a wait from its own line, as NCCL jobs wait — and no thread is importing."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from moe_hang.probe import sample


class _Work:
    def wait(self, timeout: float | None = None) -> None:
        time.sleep(0.4)

    def size(self) -> int:
        return 1


def _seen_from_another_thread(job: Callable[[], None]) -> tuple[str | None, bool]:
    """What ``called_name`` says of the job's frame (the caller of the innermost one) and
    ``quiet_for_imports`` of the thread, while the job runs on this thread."""
    got: dict[str, object] = {}
    me = threading.get_ident()

    def look() -> None:
        time.sleep(0.15)
        frame = sys._current_frames()[me]
        got["name"] = sample.called_name(frame.f_back)
        got["quiet"] = sample.quiet_for_imports(me)

    t = threading.Thread(target=look)
    t.start()
    job()
    t.join()
    return got["name"], bool(got["quiet"])  # type: ignore[return-value]


def test_a_wait_called_from_the_jobs_line_is_named_whatever_its_arguments():
    w = _Work()

    def plain() -> None:
        w.wait()

    def nested() -> None:
        w.wait(float(len(str(w.size()))))

    assert _seen_from_another_thread(plain)[0] == "wait"
    assert _seen_from_another_thread(nested)[0] == "wait"


def test_a_plain_function_call_is_no_wait():
    def pause() -> None:
        time.sleep(0.4)

    def job() -> None:
        pause()

    assert _seen_from_another_thread(job)[0] is None


def test_a_thread_computing_in_python_is_not_quiet():
    """The innermost frame is the job's own Python code (it may import next): no frames."""
    def compute() -> None:
        end = time.monotonic() + 0.4
        while time.monotonic() < end:
            sum(range(1000))

    assert _seen_from_another_thread(compute)[1] is False


def test_no_frame_no_quiet():
    assert sample.quiet_for_imports(None) is False


def test_the_probe_and_the_analysis_know_the_same_waits():
    from moe_hang.evidence.source import WAIT_METHODS

    assert sample.WAIT_METHODS == WAIT_METHODS


def test_on_the_main_thread_itself_only_imports_under_way_matter():
    """The probe's hook of an uncaught exception runs on the job's main thread: nothing else
    of that thread can be importing, so frames are safe unless another thread imports."""
    me = threading.get_ident()
    assert sample.quiet_for_imports(me) is True

    got: dict[str, bool] = {}

    def other() -> None:  # the same question asked about a thread that computes: no
        got["quiet"] = sample.quiet_for_imports(me)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert got["quiet"] is False
