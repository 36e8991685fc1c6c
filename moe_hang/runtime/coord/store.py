"""The job's own ``torch.distributed.TCPStore`` as a channel (:class:`StoreChannel`); torch is
imported lazily, on first connect: a single-node ``watch`` never imports it."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from moe_hang.runtime.coord.channel import _INDEX, ChannelGone, _check_key, key_prefix
from moe_hang.runtime.coord.worker import T, _first_line, _Worker

# a value torch's TCPStore can never hold for us: compare_set(key, ABSENT, ABSENT) reads a key
# without blocking (it returns ABSENT when the key is missing and never creates it)
_ABSENT = "\x00moe-hang:absent\x00"
_ABSENT_B = _ABSENT.encode()


_IMPORT_LOCK = threading.Lock()


def _import_dist() -> Any:
    """torch.distributed, with c10d's C++ log lines off while it loads (a connect that is
    retried would otherwise print a screen of warnings into the user's terminal).

    Called in the caller's thread, once, never inside a bounded call: an import of torch
    abandoned half-way in a daemon thread can abort the interpreter at exit."""
    with _IMPORT_LOCK:
        set_here = "TORCH_CPP_LOG_LEVEL" not in os.environ
        if set_here:
            os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
        try:
            import torch.distributed as dist
        finally:
            if set_here:
                os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
    return dist


def preload_torch() -> None:
    """Import torch.distributed now, in this thread (see :func:`_import_dist`): a watcher does
    it in its main thread before any background thread may need a store client."""
    _import_dist()


def _is_wait_timeout(exc: BaseException) -> bool:
    return type(exc).__name__ == "DistStoreError" and "timeout" in str(exc).lower()


class StoreChannel:
    """A TCPStore client on the job's store (never its server, never counted as a worker).

    ``connect()`` may be retried until the store exists (the agent hosting it may start after
    this watcher). Two connections, both made by ``connect()``: one for plain operations, one
    for blocking waits (a TCPStore client runs one request at a time). Waits from several
    threads take turns; a turn not had within the wait's own timeout counts as a timeout.
    Connections are never opened at the moment they are needed: a burst of connects from
    many nodes at once (a capture round) can stall some for seconds."""

    kind = "store"

    def __init__(self, host: str, port: int, run: str, *, op_timeout: float = 10.0,
                 store: Any = None, wait_store: Any = None) -> None:
        self.host, self.port = host, int(port)
        self.prefix = key_prefix(run)
        self.op_timeout = op_timeout
        self._gone: str | None = None
        self._lock = threading.Lock()
        self._ops: _Worker | None = None
        self._waiter: _Worker | None = None
        self._store: Any = store
        self._wstore: Any = wait_store
        self._wait_lock = threading.Lock()
        self._stuck_connects = 0
        if store is not None:
            self._ops = _Worker(f"moe-hang-store-{port}")
        if wait_store is not None:
            self._waiter = _Worker(f"moe-hang-wait-{port}")

    # ------------------------------------------------------------------ connection

    @property
    def gone(self) -> str | None:
        return self._gone

    @property
    def connected(self) -> bool:
        return self._store is not None and self._wstore is not None and self._gone is None

    def describe(self) -> str:
        return f"TCPStore {self.host}:{self.port} ({self.prefix})"

    def _client(self, dist: Any, timeout: float) -> Any:
        return dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=max(timeout, 0.1)))

    def try_connect(self, timeout: float = 2.0) -> bool:
        """One bounded attempt. False if nobody listens yet, or the attempt did not return in
        time (it is abandoned; TCPStore's own timeout ends it later): try again later."""
        if self._gone:
            return False
        dist = _import_dist()
        for role in ("ops", "wait"):
            if (self._store if role == "ops" else self._wstore) is not None:
                continue
            worker = _Worker(f"moe-hang-{role}-{self.port}")
            try:
                # TCPStore retries inside its connect with a backoff: ~2-3x its timeout at worst
                store = worker.call(lambda: self._client(dist, timeout), 3 * timeout + 5.0)
            except TimeoutError:
                # the thread ends (and its connection, if it ever gets one, is dropped) once
                # the attempt returns: abandoned attempts must not pile up connections
                worker.close()
                self._stuck_connects += 1
                return False
            except Exception:
                worker.close()
                return False
            with self._lock:
                if role == "ops":
                    self._store, self._ops = store, worker
                else:
                    self._wstore, self._waiter = store, worker
        return True

    def connect(self, timeout: float = 10.0, attempt_s: float = 1.0,
                stop: threading.Event | None = None) -> bool:
        """Retry :meth:`try_connect` until ``timeout`` (or ``stop`` is set)."""
        end = time.monotonic() + timeout
        while not self._gone:
            left = end - time.monotonic()
            if self.try_connect(max(0.1, min(attempt_s, left))):
                return True
            if time.monotonic() >= end or (stop is not None and stop.is_set()):
                return False
            time.sleep(min(0.2, max(0.0, end - time.monotonic())))
        return False

    def _fail(self, what: str, exc: BaseException) -> ChannelGone:
        if self._gone is None:
            if isinstance(exc, TimeoutError):
                self._gone = f"store {self.host}:{self.port}: {what} timed out ({exc})"
            else:
                self._gone = f"store {self.host}:{self.port} gone: {what}: {_first_line(exc)}"
        return ChannelGone(self._gone)

    def _op(self, what: str, fn: Callable[[Any], T], timeout: float | None = None) -> T:
        if self._gone:
            raise ChannelGone(self._gone)
        store, worker = self._store, self._ops
        if store is None or worker is None:
            raise ChannelGone(f"store {self.host}:{self.port}: not connected")
        try:
            return worker.call(lambda: fn(store), self.op_timeout if timeout is None else timeout)
        except Exception as exc:
            raise self._fail(what, exc) from None

    def _k(self, key: str) -> str:
        return self.prefix + _check_key(key)

    # ------------------------------------------------------------------ operations

    def put(self, key: str, value: bytes) -> None:
        k = self._k(key)

        def put(s: Any) -> None:
            s.set(k, value)
            # TCPStore's set is sent without waiting for a reply: a read on another
            # connection (another node) could still see the old value. One round trip on
            # this connection, answered after the set, makes the put done when it returns
            s.check([k])

        self._op("set", put)

    def get(self, key: str) -> bytes | None:
        k = self._k(key)
        v = self._op("get", lambda s: s.compare_set(k, _ABSENT, _ABSENT))
        return None if bytes(v) == _ABSENT_B else bytes(v)

    def put_first(self, key: str, value: bytes) -> bytes:
        k = self._k(key)
        return bytes(self._op("compare_set", lambda s: s.compare_set(k, "", value)))

    def put_member(self, ns: str, name: str, value: bytes) -> None:
        k, idx = self._k(f"{ns}/{name}"), self._k(f"{ns}/{_INDEX}")

        def both(s: Any) -> None:
            s.set(k, value)  # before the index entry: a listed member always exists
            s.append(idx, f"{name},")
            s.check([idx])  # answered after both: done when it returns (see put)

        self._op("set", both)

    def members(self, ns: str, hint: Sequence[str] = ()) -> list[str]:
        raw = self.get(f"{ns}/{_INDEX}")
        if not raw:
            return []
        return list(dict.fromkeys(n for n in raw.decode(errors="replace").split(",") if n))

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        full = [self._k(k) for k in keys]
        if not full:
            return []

        def read(s: Any) -> list[bytes | None]:
            if s.check(full):  # all there: one round trip
                return [bytes(v) for v in s.multi_get(full)]
            out: list[bytes | None] = []
            for k in full:
                v = bytes(s.compare_set(k, _ABSENT, _ABSENT))
                out.append(None if v == _ABSENT_B else v)
            return out

        return self._op("multi_get", read)

    def wait(self, key: str, timeout: float) -> bool:
        k = self._k(key)
        if self._gone:
            raise ChannelGone(self._gone)
        store, waiter = self._wstore, self._waiter
        if store is None or waiter is None:
            raise ChannelGone(f"store {self.host}:{self.port}: not connected")

        def wait_for(seconds: float) -> bool:
            try:
                store.wait([k], timedelta(seconds=max(seconds, 0.001)))
                return True
            except Exception as exc:
                if _is_wait_timeout(exc):
                    return False
                raise

        t0 = time.monotonic()
        if not self._wait_lock.acquire(timeout=max(0.0, timeout)):
            return False  # another thread's wait held the connection all along
        try:
            left = max(0.0, timeout - (time.monotonic() - t0))
            return waiter.call(lambda: wait_for(left), left + self.op_timeout)
        except Exception as exc:
            raise self._fail("wait", exc) from None
        finally:
            self._wait_lock.release()

    def close(self) -> None:
        for w in (self._ops, self._waiter):
            if w is not None:
                w.close()
