"""Bounded calls: every channel operation runs on a worker thread of its own and the caller
waits a bounded time (a hung store or NFS mount never hangs the watcher)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class _Call(Generic[T]):
    __slots__ = ("done", "error", "fn", "result")

    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None


class _Worker:
    """One daemon thread running calls in order; a caller waits at most its timeout.

    A call that does not return in time leaves the thread stuck where it is (in C++, or in
    the kernel on a dead NFS server): the worker is then *stuck* and its owner gives up on it.
    """

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue[_Call[Any] | None] = queue.SimpleQueue()
        self.stuck = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            call = self._q.get()
            if call is None:
                return
            try:
                call.result = call.fn()
            except BaseException as exc:  # handed to the caller
                call.error = exc
            call.done.set()

    def call(self, fn: Callable[[], T], timeout: float) -> T:
        if self.stuck:
            raise TimeoutError("worker stuck in an earlier call")
        c: _Call[T] = _Call(fn)
        self._q.put(c)
        if not c.done.wait(max(0.0, timeout)):
            self.stuck = True
            raise TimeoutError(f"no answer within {timeout:.1f} s")
        if c.error is not None:
            raise c.error
        return c.result  # type: ignore[return-value]

    def close(self) -> None:
        self._q.put(None)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"
