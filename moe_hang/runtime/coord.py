"""Coordination of the ``moe-hang watch`` processes of one multi-node job.

One watcher runs per node. They talk through one channel, under a prefix of their own
(``moe-hang/<run key>/``), and nothing else:

* :class:`StoreChannel`: a client of the ``torch.distributed.TCPStore`` the job already has:
  torchrun's rendezvous store (``--rdzv-endpoint``; static rendezvous: ``--master-addr:port``),
  which lives in one torchrun agent and which every agent must reach (the ranks'
  MASTER_ADDR:MASTER_PORT is another store under c10d, on group rank 0's agent, random port).
  torch is imported lazily, on first connect: a single-node ``watch`` never imports it.
* :class:`DirChannel`: a directory every node sees (``--shared-dir``), for clusters where the
  store cannot be reached from outside the ranks. Atomic writes (temp + rename, ``link`` for
  first-writer-wins).

Every channel operation runs on a worker thread of its own and the caller waits a bounded time:
a store whose host vanished (a partition blocks a TCPStore ``get`` far beyond its own timeout)
or a hung NFS mount turns into :class:`ChannelGone`, never into a hung watcher. Once gone, a
channel stays gone, every later call fails at once, and :class:`Coordinator` falls back to a
local-only verdict that names the other nodes *unknown*.

The protocol (:meth:`Coordinator.run_round` runs it end to end)::

    register(node, host, local ranks, watcher pid)      node/<id>, alive/<id> (beat)
    publish_summary(NodeSummary)  (periodic)            summary/<id>
    request_capture(reason, by_node)  first one wins    request
    -- every node: capture its ranks, then --
    publish_capture(NodeSummary after capture)          captured/<id>
    wait_all_captured(expected, deadline)               -> (captured, missing)
    the requester analyses and publishes the verdict    verdict  (first one wins)
    everybody else reads it (or, if the requester died,  (carries the compact global set)
      analyses itself and publishes: first one wins)
    ack_ended()                                         ended/<id>
    the node hosting the store waits for the acks, then ends its job; the others end at once

Missing nodes are unknown, not guilty: a node that never registered or whose watcher stopped
beating is reported in ``missing`` and its ranks in ``unknown_ranks``.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import queue
import re
import socket
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

T = TypeVar("T")

ROOT = "moe-hang"
SCHEMA = 1
# a value torch's TCPStore can never hold for us: compare_set(key, ABSENT, ABSENT) reads a key
# without blocking (it returns ABSENT when the key is missing and never creates it)
_ABSENT = "\x00moe-hang:absent\x00"
_ABSENT_B = _ABSENT.encode()
_INDEX = "_index"
_MAX_DECODED = 64 << 20
_KEY_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.=+-]{0,127}$")

# frames that are never the user's line (kept in step with moe_hang.stacks.is_library_frame)
_TOOL_FILES = ("moe_hang/probe.py", "moe_hang/_probe_site/")


class ChannelGone(Exception):
    """The channel cannot be used any more (store gone, timed out, directory unreachable)."""


# ----------------------------------------------------------------------------- bounded calls


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


# ----------------------------------------------------------------------------- channels


class Channel(Protocol):
    """Keys are relative to the channel's prefix: slash-separated parts of ``[A-Za-z0-9_.=+-]``.
    Values are bytes. Every method is bounded; a failure raises :class:`ChannelGone`."""

    kind: str

    @property
    def gone(self) -> str | None: ...

    def describe(self) -> str: ...

    def put(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes | None: ...

    def put_first(self, key: str, value: bytes) -> bytes:
        """Atomic first-writer-wins: store ``value`` unless the key exists; return what is
        stored (ours if we won)."""
        ...

    def put_member(self, ns: str, name: str, value: bytes) -> None:
        """``ns/name`` = value, and ``name`` listed by :meth:`members`."""
        ...

    def members(self, ns: str, hint: Sequence[str] = ()) -> list[str]:
        """Names put under ``ns`` (``hint``: names worth probing directly)."""
        ...

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...

    def wait(self, key: str, timeout: float) -> bool:
        """True once ``key`` exists, False after ``timeout`` seconds."""
        ...

    def close(self) -> None: ...


def sanitize(part: str) -> str:
    """A run id or node id as one key part."""
    out = re.sub(r"[^A-Za-z0-9_.=+-]", "_", part.strip())[:128]
    if not out or not out[0].isalnum():
        out = "x" + out[:127]
    return out


def key_prefix(run_key: str) -> str:
    return f"{ROOT}/{sanitize(run_key)}/"


def run_key(run_id: str | None, env: Mapping[str, str] | None = None) -> str:
    """The namespace of one job. torchrun's run id (``--rdzv-id``, ``TORCHELASTIC_RUN_ID``;
    ``none`` by default) is enough in a store that lives as long as the job; a shared directory
    outlives jobs, so the Slurm job and step ids are added where there are some."""
    e = os.environ if env is None else env
    key = run_id or "none"
    job = e.get("SLURM_JOB_ID")
    if job:
        key += f"-slurm{job}"
        if e.get("SLURM_STEP_ID"):
            key += f".{e['SLURM_STEP_ID']}"
    return sanitize(key)


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not parts or not all(_KEY_PART.match(p) or p == _INDEX for p in parts):
        raise ValueError(f"bad coordination key {key!r}")
    return key


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
        self._op("set", lambda s: s.set(k, value))

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


class DirChannel:
    """Files under ``<root>/moe-hang/<run key>/``. Writers write a temporary file and rename
    it (readers never see half a value); first-writer-wins is a hard link (atomic on NFS too),
    or O_EXCL where the file system has no links. On NFS, directory listings may be cached:
    members are also probed by name (``hint``), which close-to-open consistency keeps fresh."""

    kind = "dir"

    def __init__(self, root: str | os.PathLike[str], run: str, *, op_timeout: float = 5.0,
                 poll_s: float = 0.05) -> None:
        self.base = Path(root)
        self.root = self.base / key_prefix(run)
        self.op_timeout = op_timeout
        self.poll_s = poll_s
        self._gone: str | None = None
        self._worker = _Worker("moe-hang-dir")
        self._tag = f"{socket.gethostname()}.{os.getpid()}"

    @property
    def gone(self) -> str | None:
        return self._gone

    def describe(self) -> str:
        return f"directory {self.root}"

    def _op(self, what: str, fn: Callable[[], T]) -> T:
        if self._gone:
            raise ChannelGone(self._gone)
        try:
            return self._worker.call(fn, self.op_timeout)
        except Exception as exc:
            if self._gone is None:
                self._gone = f"shared directory {self.root}: {what}: {_first_line(exc)}"
            raise ChannelGone(self._gone) from None

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def _tmp(self, p: Path) -> Path:
        return p.with_name(f".{p.name}.{self._tag}.{threading.get_ident()}.tmp")

    def _write(self, p: Path, value: bytes) -> Path:
        p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self._tmp(p)
        with open(tmp, "wb") as f:
            f.write(value)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    @staticmethod
    def _read(p: Path) -> bytes | None:
        try:
            data = p.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return data or None  # an O_EXCL winner still writing: not there yet

    def put(self, key: str, value: bytes) -> None:
        p = self._path(key)

        def do() -> None:
            tmp = self._write(p, value)
            try:
                os.replace(tmp, p)
            except BaseException:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise

        self._op("write", do)

    def get(self, key: str) -> bytes | None:
        p = self._path(key)
        return self._op("read", lambda: self._read(p))

    def put_first(self, key: str, value: bytes) -> bytes:
        p = self._path(key)

        def do() -> bytes:
            tmp = self._write(p, value)
            try:
                os.link(tmp, p)
                return value
            except FileExistsError:
                pass
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                    raise
                try:  # no hard links here: O_EXCL (readers skip it while it is empty)
                    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                except FileExistsError:
                    pass
                else:
                    with os.fdopen(fd, "wb") as f:
                        f.write(value)
                    return value
            finally:
                with contextlib.suppress(OSError):
                    tmp.unlink()
            for _ in range(50):  # the winner's O_EXCL write may still be under way
                got = self._read(p)
                if got is not None:
                    return got
                time.sleep(0.02)
            raise OSError(f"{p} exists but stays empty")

        return self._op("write", do)

    def put_member(self, ns: str, name: str, value: bytes) -> None:
        self.put(f"{ns}/{name}", value)

    def members(self, ns: str, hint: Sequence[str] = ()) -> list[str]:
        d = self._path(ns)

        def do() -> list[str]:
            try:
                names = {n for n in os.listdir(d) if not n.startswith(".")}
            except (FileNotFoundError, NotADirectoryError):
                names = set()
            for h in hint:
                if h not in names and (d / h).exists():
                    names.add(h)
            return sorted(names, key=_node_sort_key)

        return self._op("list", do)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        paths = [self._path(k) for k in keys]
        return self._op("read", lambda: [self._read(p) for p in paths])

    def wait(self, key: str, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while True:
            if self.get(key) is not None:
                return True
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(self.poll_s, left))

    def close(self) -> None:
        self._worker.close()


# ----------------------------------------------------------------------------- encoding


def encode(obj: Any) -> bytes:
    """Compact JSON; zlib-compressed (leading ``Z``) past a few hundred bytes."""
    raw = json.dumps(obj, separators=(",", ":"), default=str).encode()
    return b"Z" + zlib.compress(raw, 6) if len(raw) > 384 else raw


def decode(data: bytes | None) -> Any:
    """The inverse of :func:`encode`; None for None or anything unreadable (a value from
    another node is input, not trusted: no pickle, bounded decompression)."""
    if not data:
        return None
    try:
        if data[:1] == b"Z":
            d = zlib.decompressobj()
            raw = d.decompress(data[1:], _MAX_DECODED)
            if d.unconsumed_tail:
                return None
            return json.loads(raw)
        return json.loads(data)
    except (ValueError, zlib.error):
        return None


# ----------------------------------------------------------------------------- data


def _int_or_none(v: Any) -> int | None:
    try:
        return None if v is None else int(v)
    except (TypeError, ValueError):
        return None


def _sizes(v: Any) -> list[list[int]]:
    out: list[list[int]] = []
    for s in v or []:
        try:
            out.append([int(x) for x in s])
        except (TypeError, ValueError):
            out.append([])
    return out


@dataclass
class PendingCollective:
    """A collective a rank posted that has not completed (from its Flight Recorder); in a
    capture's ``history``, any recent one (``completed`` says which)."""

    op: str  # the recorder's profiling name, e.g. "nccl:all_gather"
    seq: int
    pg_id: str = "0"
    pg: str | None = None  # group name
    pg_desc: str | None = None
    input_sizes: list[list[int]] = field(default_factory=list)
    output_sizes: list[list[int]] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    t_ns: int | None = None  # time created
    completed: bool | None = None  # history entries: did it complete on this rank?
    frames: list[str] = field(default_factory=list)  # the user frames that posted it

    def to_json(self, stacks: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {"op": self.op, "seq": self.seq, "pg_id": self.pg_id}
        for k in ("pg", "pg_desc", "t_ns", "completed"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        for k in ("input_sizes", "output_sizes", "dtypes"):
            if getattr(self, k):
                d[k] = getattr(self, k)
        if stacks and self.frames:
            d["frames"] = self.frames
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PendingCollective:
        return cls(op=str(d.get("op", "?")), seq=int(d.get("seq", -1)),
                   pg_id=str(d.get("pg_id", "0")),
                   pg=None if d.get("pg") is None else str(d["pg"]),
                   pg_desc=None if d.get("pg_desc") is None else str(d["pg_desc"]),
                   input_sizes=_sizes(d.get("input_sizes")),
                   output_sizes=_sizes(d.get("output_sizes")),
                   dtypes=[str(x) for x in d.get("dtypes") or []], t_ns=_int_or_none(d.get("t_ns")),
                   completed=None if d.get("completed") is None else bool(d["completed"]),
                   frames=[str(f) for f in d.get("frames") or []])

    @classmethod
    def from_fr_entry(cls, e: Mapping[str, Any]) -> PendingCollective | None:
        """From a probe heartbeat's ``pending`` entry (the recorder's entry format)."""
        try:
            seq = int(e.get("collective_seq_id", -1))
        except (TypeError, ValueError):
            return None
        pg = e.get("process_group")
        name = str(pg[0]) if isinstance(pg, (list, tuple)) and pg else None
        desc = str(pg[1]) if isinstance(pg, (list, tuple)) and len(pg) > 1 else None
        return cls(op=str(e.get("profiling_name", "?")), seq=seq, pg_id=str(e.get("pg_id", "0")),
                   pg=name, pg_desc=desc, input_sizes=_sizes(e.get("input_sizes")),
                   output_sizes=_sizes(e.get("output_sizes")),
                   dtypes=[str(x) for x in e.get("input_dtypes") or []],
                   t_ns=_int_or_none(e.get("time_created_ns")))

    def to_fr_entry(self) -> dict[str, Any]:
        return {"pg_id": self.pg_id, "process_group": [self.pg or self.pg_id, self.pg_desc or ""],
                "collective_seq_id": self.seq, "profiling_name": self.op,
                "input_sizes": self.input_sizes, "output_sizes": self.output_sizes,
                "input_dtypes": self.dtypes, "time_created_ns": self.t_ns}

    def signature(self) -> tuple[str, tuple[tuple[int, ...], ...], tuple[str, ...]]:
        op = self.op.rsplit(":", 1)[-1]
        return op, tuple(tuple(s) for s in self.input_sizes), tuple(self.dtypes)


def _groups(v: Any) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for k, rs in (v.items() if isinstance(v, Mapping) else ()):
        with contextlib.suppress(TypeError, ValueError):
            out[str(k)] = sorted(int(r) for r in rs)
    return out


@dataclass
class RankSummary:
    rank: int
    pid: int | None = None
    local_rank: int | None = None
    # in_collective | computing | idle | running (moving unknown) | exited | unknown
    state: str = "unknown"
    pending: list[PendingCollective] = field(default_factory=list)
    enqueued: dict[str, int] = field(default_factory=dict)  # pg id -> last posted seq
    completed: dict[str, int] = field(default_factory=dict)  # pg id -> last completed seq
    callsite: str | None = None  # "file:line:function", the user line
    stack: list[str] = field(default_factory=list)  # main thread, innermost first
    step: int | None = None
    phase: str | None = None
    moving: bool | None = None
    beat_time: float | None = None
    exit_code: int | None = None
    # a capture only, from the rank's Flight Recorder dump: its recent collectives per group
    # (names, seqs, sizes, whether each completed) and the groups' status by name
    history: list[PendingCollective] = field(default_factory=list)
    fr_status: dict[str, list[int]] = field(default_factory=dict)  # name -> [enq, completed]

    def to_json(self, stacks: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {"rank": self.rank, "state": self.state}
        for k in ("pid", "local_rank", "callsite", "step", "phase", "moving", "exit_code"):
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        if self.beat_time is not None:
            d["beat_time"] = round(self.beat_time, 3)
        if self.pending:
            d["pending"] = [p.to_json() for p in self.pending]
        if self.enqueued:
            d["enqueued"] = self.enqueued
        if self.completed:
            d["completed"] = self.completed
        if stacks and self.stack:
            d["stack"] = self.stack
        if self.history:
            d["history"] = [h.to_json(stacks) for h in self.history]
        if self.fr_status:
            d["fr_status"] = self.fr_status
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RankSummary:
        def seqs(v: Any) -> dict[str, int]:
            out: dict[str, int] = {}
            for k, s in (v or {}).items():
                i = _int_or_none(s)
                if i is not None:
                    out[str(k)] = i
            return out

        beat = d.get("beat_time")
        return cls(rank=int(d["rank"]), pid=_int_or_none(d.get("pid")),
                   local_rank=_int_or_none(d.get("local_rank")), state=str(d.get("state", "?")),
                   pending=[PendingCollective.from_json(p) for p in d.get("pending") or []
                            if isinstance(p, Mapping)],
                   enqueued=seqs(d.get("enqueued")), completed=seqs(d.get("completed")),
                   callsite=None if d.get("callsite") is None else str(d["callsite"]),
                   stack=[str(s) for s in d.get("stack") or []], step=_int_or_none(d.get("step")),
                   phase=None if d.get("phase") is None else str(d["phase"]),
                   moving=None if d.get("moving") is None else bool(d["moving"]),
                   beat_time=float(beat) if isinstance(beat, (int, float)) else None,
                   exit_code=_int_or_none(d.get("exit_code")),
                   history=[PendingCollective.from_json(h) for h in d.get("history") or []
                            if isinstance(h, Mapping)],
                   fr_status={str(k): [int(x) for x in v][:2]
                              for k, v in (d.get("fr_status") or {}).items()
                              if isinstance(v, (list, tuple)) and len(v) >= 2})


@dataclass
class NodeSummary:
    """What one node's watcher knows about its ranks, compact enough for the store."""

    node: str
    host: str
    ranks: list[RankSummary] = field(default_factory=list)
    world: int | None = None
    local_world: int | None = None
    time: float = 0.0
    watcher_pid: int | None = None
    kind: str = "periodic"  # periodic | capture
    request: str | None = None  # the capture request this answers
    note: str | None = None
    # process group name -> global member ranks, as this node's ranks know them (a capture
    # reads them from the probes' dumps): a rank only knows the groups it is a member of
    groups: dict[str, list[int]] = field(default_factory=dict)

    def to_json(self, stacks: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {"schema": SCHEMA, "node": self.node, "host": self.host,
                             "time": round(self.time, 3), "kind": self.kind,
                             "ranks": [r.to_json(stacks) for r in self.ranks]}
        for k in ("world", "local_world", "watcher_pid", "request", "note"):
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        if self.groups:
            d["groups"] = self.groups
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> NodeSummary:
        ranks = []
        for r in d.get("ranks") or []:
            with contextlib.suppress(KeyError, TypeError, ValueError):
                ranks.append(RankSummary.from_json(r))
        return cls(node=str(d["node"]), host=str(d.get("host", "?")), ranks=ranks,
                   world=_int_or_none(d.get("world")),
                   local_world=_int_or_none(d.get("local_world")),
                   time=float(d.get("time") or 0.0),
                   watcher_pid=_int_or_none(d.get("watcher_pid")),
                   kind=str(d.get("kind", "periodic")),
                   request=None if d.get("request") is None else str(d["request"]),
                   note=None if d.get("note") is None else str(d["note"]),
                   groups=_groups(d.get("groups")))

    def encode(self, stacks: bool = True) -> bytes:
        return encode(self.to_json(stacks))

    @classmethod
    def decode(cls, data: bytes | None) -> NodeSummary | None:
        d = decode(data)
        if not isinstance(d, Mapping):
            return None
        try:
            return cls.from_json(d)
        except (KeyError, TypeError, ValueError):
            return None


@dataclass
class NodeInfo:
    node: str
    host: str
    local_ranks: list[int]
    watcher_pid: int
    time: float
    hosts_store: bool = False
    world: int | None = None
    local_world: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "host": self.host, "local_ranks": self.local_ranks,
                "watcher_pid": self.watcher_pid, "time": round(self.time, 3),
                "hosts_store": self.hosts_store, "world": self.world,
                "local_world": self.local_world}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> NodeInfo:
        return cls(node=str(d["node"]), host=str(d.get("host", "?")),
                   local_ranks=[int(r) for r in d.get("local_ranks") or []],
                   watcher_pid=int(d.get("watcher_pid") or 0), time=float(d.get("time") or 0.0),
                   hosts_store=bool(d.get("hosts_store")), world=_int_or_none(d.get("world")),
                   local_world=_int_or_none(d.get("local_world")))


@dataclass
class CaptureRequest:
    id: str
    reason: str
    by_node: str
    host: str
    time: float

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "reason": self.reason, "by_node": self.by_node,
                "host": self.host, "time": round(self.time, 6)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> CaptureRequest:
        return cls(id=str(d["id"]), reason=str(d.get("reason", "")),
                   by_node=str(d.get("by_node", "?")), host=str(d.get("host", "?")),
                   time=float(d.get("time") or 0.0))


@dataclass
class GlobalVerdict:
    """The one verdict every node prints, and the (compact) global set it came from.

    In the channel the record is small (``verdict``: first writer wins); the verdict itself (a
    diagnosis: on 1000 ranks a megabyte of JSON) and the global set travel beside it
    (``verdict-body/<analyst>``, ``global/<analyst>``, written before the record,
    compressed). A reader fetches all three and decodes the diagnosis when :attr:`verdict` is
    used and the set when :attr:`summaries` is: on 1000 nodes, every node parsing them at the
    same moment would be most of the cost."""

    request: str
    by_node: str
    time: float
    verdict_data: dict[str, Any] | None
    captured: list[str]
    missing: list[str]
    hosts: dict[str, str]
    unknown_ranks: list[int]
    local_only: bool = False
    note: str | None = None
    global_raw: bytes | None = field(default=None, repr=False)  # encoded summaries
    _summaries: dict[str, NodeSummary] | None = field(default=None, repr=False)
    verdict_raw: bytes | None = field(default=None, repr=False)  # the encoded diagnosis

    @property
    def verdict(self) -> dict[str, Any]:
        """The diagnosis (``Diagnosis.to_dict``), decoded on first use."""
        if self.verdict_data is None:
            got = decode(self.verdict_raw)
            self.verdict_data = dict(got) if isinstance(got, Mapping) else {}
        return self.verdict_data

    @property
    def summaries(self) -> dict[str, NodeSummary]:
        if self._summaries is None:
            self._summaries = _summaries_from_json(decode(self.global_raw))
        return self._summaries

    def record_json(self) -> dict[str, Any]:
        """What the ``verdict`` key holds: everything but the diagnosis and the global set."""
        d = {"schema": SCHEMA, "request": self.request, "by_node": self.by_node,
             "time": round(self.time, 6), "captured": self.captured,
             "missing": self.missing, "hosts": self.hosts, "unknown_ranks": self.unknown_ranks,
             "local_only": self.local_only}
        if self.note:
            d["note"] = self.note
        return d

    def head_json(self) -> dict[str, Any]:
        """Everything but the global set."""
        return self.record_json() | {"verdict": self.verdict}

    def to_json(self) -> dict[str, Any]:
        """Everything, the global set included (for the run directory)."""
        return self.head_json() | {
            "summaries": {n: s.to_json(stacks=False) for n, s in self.summaries.items()}}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], global_raw: bytes | None = None,
                  verdict_raw: bytes | None = None) -> GlobalVerdict:
        body = d.get("verdict")
        v = cls(request=str(d.get("request", "")), by_node=str(d.get("by_node", "?")),
                time=float(d.get("time") or 0.0),
                verdict_data=dict(body) if isinstance(body, Mapping) else None,
                verdict_raw=verdict_raw,
                captured=[str(n) for n in d.get("captured") or []],
                missing=[str(n) for n in d.get("missing") or []],
                hosts={str(k): str(v) for k, v in (d.get("hosts") or {}).items()},
                unknown_ranks=[int(r) for r in d.get("unknown_ranks") or []],
                local_only=bool(d.get("local_only")),
                note=None if d.get("note") is None else str(d["note"]), global_raw=global_raw)
        if "summaries" in d:
            v._summaries = _summaries_from_json(d["summaries"])
        return v


def _summaries_from_json(d: Any) -> dict[str, NodeSummary]:
    out: dict[str, NodeSummary] = {}
    for n, s in (d.items() if isinstance(d, Mapping) else ()):
        with contextlib.suppress(KeyError, TypeError, ValueError, AttributeError):
            out[str(n)] = NodeSummary.from_json(s)
    return out


@dataclass
class RoundResult:
    verdict: GlobalVerdict
    request: CaptureRequest
    captured: dict[str, NodeSummary]
    missing: list[str]
    analysed_here: bool
    # monotonic seconds from seeing the request: captured (here), all captured, verdict known,
    # acks awaited (store host only)
    timings: dict[str, float] = field(default_factory=dict)
    not_ended: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- heartbeats


def _is_library(path: str) -> bool:
    p = path.replace("\\", "/")
    return ("/torch/" in p or p.startswith("torch/") or p.endswith("typing_extensions.py")
            or p.startswith("<frozen") or p.endswith(("/runpy.py", "/threading.py"))
            or any(t in p for t in _TOOL_FILES))


def _frames(raw: Any) -> list[tuple[str, int, str]]:
    out = []
    for f in raw or []:
        if isinstance(f, Mapping):
            out.append((str(f.get("filename", f.get("file", "?"))), int(f.get("line", 0) or 0),
                        str(f.get("name", f.get("function", "?")))))
        elif isinstance(f, (list, tuple)) and len(f) >= 3:
            out.append((str(f[0]), int(f[1] or 0), str(f[2])))
    return out


def _site(frames: list[tuple[str, int, str]]) -> str | None:
    for file, line, fn in frames:
        if not _is_library(file):
            return f"{file}:{line}:{fn}"
    return None


def parse_frame(s: str) -> list[Any]:
    """``file:line:function`` back into [file, line, function] (a path may hold ':')."""
    return _parse_frame(s)


def _parse_frame(s: str) -> list[Any]:
    file, _, rest = s.rpartition(":")  # file:line:function (a path may hold ':')
    file2, _, line = file.rpartition(":")
    if not file2:
        return [s, 0, "?"]
    return [file2, int(line) if line.isdigit() else 0, rest]


def summarize_heartbeats(hbs: Mapping[int, Mapping[str, Any]], *, node: str,
                         host: str | None = None,
                         moving: Mapping[int, bool] | None = None,
                         alive: Mapping[int, bool] | None = None,
                         exit_codes: Mapping[int, int | None] | None = None,
                         kind: str = "periodic", max_frames: int = 24,
                         now: float | None = None) -> NodeSummary:
    """A node's summary from its ranks' probe heartbeats (``ranks/rank*.hb.json``).

    ``moving``: whether the watcher saw each rank move lately (fingerprint or CPU); ``alive``
    and ``exit_codes`` from its process table."""
    ranks: list[RankSummary] = []
    world = local_world = None
    for r in sorted(hbs):
        hb = hbs[r]
        world = world or _int_or_none(hb.get("world"))
        local_world = local_world or _int_or_none(hb.get("local_world"))
        raw_progress = hb.get("progress")
        progress: Mapping[str, Any] = raw_progress if isinstance(raw_progress, Mapping) else {}
        pending = [p for p in (PendingCollective.from_fr_entry(e) for e in hb.get("pending") or []
                               if isinstance(e, Mapping)) if p is not None]
        pending.sort(key=lambda p: (p.t_ns or 0, p.seq))
        enq: dict[str, int] = {}
        done: dict[str, int] = {}
        for pg, st in (hb.get("pg_status") or {}).items():
            if isinstance(st, Mapping):
                e, c = _int_or_none(st.get("enqueued")), _int_or_none(st.get("completed"))
                if e is not None:
                    enq[str(pg)] = e
                if c is not None:
                    done[str(pg)] = c
        main = _frames(hb.get("main_frame"))
        fr_frames: list[tuple[str, int, str]] = []
        for e in hb.get("pending") or []:
            if isinstance(e, Mapping) and e.get("frames"):
                fr_frames = _frames(e.get("frames"))
                break
        site = _site(fr_frames) or _site(main)
        is_alive = None if alive is None else alive.get(r)
        code = None if exit_codes is None else exit_codes.get(r)
        mv = None if moving is None else moving.get(r)
        waiting = bool(pending) or any(enq.get(pg, -1) > c for pg, c in done.items())
        if is_alive is False or code is not None or progress.get("phase") == "exiting":
            state = "exited"
        elif waiting and not mv:
            state = "in_collective"
        elif mv is None:
            state = "running"
        else:
            state = "computing" if mv else "idle"
        ranks.append(RankSummary(
            rank=int(r), pid=_int_or_none(hb.get("pid")),
            local_rank=_int_or_none(hb.get("local_rank")),
            state=state, pending=pending, enqueued=enq, completed=done, callsite=site,
            stack=[f"{f}:{ln}:{fn}" for f, ln, fn in main[:max_frames]],
            step=_int_or_none(progress.get("step")),
            phase=None if progress.get("phase") is None else str(progress.get("phase")),
            moving=mv,
            beat_time=hb.get("time") if isinstance(hb.get("time"), (int, float)) else None,
            exit_code=code))
    h = host or next((str(hb["host"]) for hb in hbs.values() if hb.get("host")),
                     socket.gethostname())
    return NodeSummary(node=node, host=h, ranks=ranks, world=world, local_world=local_world,
                       time=time.time() if now is None else now, watcher_pid=os.getpid(), kind=kind)


def to_heartbeats(summaries: Iterable[NodeSummary]) -> dict[int, dict[str, Any]]:
    """Heartbeat-shaped records (the probe's format) for every rank of the given summaries,
    global rank -> record: what ``moe_hang.analysis`` reads (``quick_divergence``, or
    ``RankEvidence.heartbeat``) when a remote rank has no richer evidence."""
    out: dict[int, dict[str, Any]] = {}
    for s in summaries:
        for r in s.ranks:
            pg_status = {pg: {"enqueued": r.enqueued.get(pg, -1), "completed": c}
                         for pg, c in r.completed.items()}
            for pg, e in r.enqueued.items():
                pg_status.setdefault(pg, {"enqueued": e, "completed": -1})
            progress: dict[str, Any] = {}
            if r.step is not None:
                progress["step"] = r.step
            if r.phase is not None:
                progress["phase"] = r.phase
            out[r.rank] = {
                "rank": r.rank, "pid": r.pid, "host": s.host, "node": s.node, "world": s.world,
                "local_rank": r.local_rank, "local_world": s.local_world, "time": r.beat_time,
                "progress": progress, "pg_status": pg_status,
                "pending": [p.to_fr_entry() for p in r.pending],
                "main_frame": [_parse_frame(f) for f in r.stack] or None,
                "state": r.state, "callsite": r.callsite}
    return out


def expected_nodes(world: int | None, local_world: int | None,
                   group_world: int | None = None) -> list[str]:
    """Node ids "0".."N-1" (torchrun's group ranks): GROUP_WORLD_SIZE, else
    WORLD_SIZE / LOCAL_WORLD_SIZE (every node runs as many ranks)."""
    n = group_world
    if n is None and world and local_world:
        n = -(-int(world) // int(local_world))
    return [str(i) for i in range(n or 0)]


def node_id_from_heartbeats(hbs: Mapping[int, Mapping[str, Any]]) -> str | None:
    """torchrun's group rank of this node, from its ranks: global ranks are handed out in
    group-rank order, LOCAL_WORLD_SIZE at a time."""
    for r, hb in sorted(hbs.items()):
        lr, lw = _int_or_none(hb.get("local_rank")), _int_or_none(hb.get("local_world"))
        if lr is not None and lw:
            return str((int(r) - lr) // lw)
    return None


def ranks_of_nodes(nodes: Iterable[str], local_world: int | None) -> list[int]:
    out: list[int] = []
    if not local_world:
        return out
    for n in nodes:
        if n.isdigit():
            out.extend(range(int(n) * local_world, (int(n) + 1) * local_world))
    return sorted(out)


def remote_moving(summaries: Mapping[str, NodeSummary], me: str, *, now: float | None = None,
                  fresh_s: float = 10.0) -> list[int]:
    """Ranks on other nodes whose watcher saw them move in a recent summary: while there are
    some, a local stall is a straggler somewhere else, not a global hang."""
    t = time.time() if now is None else now
    return sorted(r.rank for n, s in summaries.items() if n != me and t - s.time <= fresh_s
                  for r in s.ranks if r.moving)


def _node_sort_key(n: str) -> tuple[int, int, str]:
    return (0, int(n), "") if n.isdigit() else (1, 0, n)


# ----------------------------------------------------------------------------- the job's store


@dataclass
class StoreEndpoint:
    """Where a job's store is, as its launcher was told."""

    host: str
    port: int
    run_id: str
    backend: str  # c10d | static | env
    nnodes_min: int = 1
    nnodes_max: int = 1
    node_rank: int | None = None  # static rendezvous only
    source: str = "torchrun"

    @property
    def multi_node(self) -> bool:
        return self.nnodes_max > 1


_TORCHRUN_FLAGS = {"standalone", "m", "module", "no_python", "run_path", "virtual_local_rank",
                   "h", "help"}
_TORCHRUN_VALUES = {"nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id",
                    "rdzv_conf", "max_restarts", "monitor_interval", "start_method",
                    "event_log_handler", "role", "log_dir", "r", "redirects", "t", "tee",
                    "local_ranks_filter", "duplicate_stdout_filters", "duplicate_stderr_filters",
                    "node_rank", "master_addr", "master_port", "local_addr", "logs_specs",
                    "numa_binding", "signals_to_handle", "shutdown_timeout"}


def _torchrun_args(argv: Sequence[str]) -> list[str] | None:
    for i, a in enumerate(argv):
        base = os.path.basename(a)
        if base == "torchrun":
            return list(argv[i + 1:])
        if a in ("torch.distributed.run", "torch.distributed.launch") and i and argv[i - 1] == "-m":
            return list(argv[i + 1:])
    return None


def _host_port(endpoint: str, default_port: int) -> tuple[str, int]:
    ep = endpoint.strip()
    m = re.match(r"^\[([^\]]+)\](?::(\d+))?$", ep)  # [v6]:port
    if m:
        return m.group(1), int(m.group(2) or default_port)
    host, sep, port = ep.rpartition(":")
    if sep and port.isdigit() and ":" not in host:
        return host or "localhost", int(port)
    return ep, default_port


def endpoint_from_torchrun(argv: Sequence[str],
                           env: Mapping[str, str] | None = None) -> StoreEndpoint | None:
    """The store of a job started as ``torchrun ...`` / ``python -m torch.distributed.run ...``
    (also behind ``srun``): the rendezvous endpoint for ``--rdzv-backend c10d``,
    ``--master-addr:--master-port`` for static rendezvous; ``PET_*`` variables fill in flags
    not given. None when there is no TCPStore to use (not torchrun, ``--standalone``, etcd)."""
    args = _torchrun_args(argv)
    if args is None:
        return None
    e = os.environ if env is None else env
    opts: dict[str, str] = {}
    flags: set[str] = set()
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--" or not a.startswith("-") or a == "-":
            break
        name, eq, val = a.lstrip("-").partition("=")
        name = name.replace("-", "_")
        if name in _TORCHRUN_VALUES:
            if not eq:
                i += 1
                val = args[i] if i < len(args) else ""
            opts[name] = val
        elif name in _TORCHRUN_FLAGS:
            flags.add(name)
        i += 1

    def opt(name: str, default: str | None = None) -> str | None:
        return opts.get(name) or e.get(f"PET_{name.upper()}") or default

    if "standalone" in flags or e.get("PET_STANDALONE"):
        return None
    nnodes = opt("nnodes", "1") or "1"
    lo, _, hi = nnodes.partition(":")
    try:
        nmin, nmax = int(lo), int(hi or lo)
    except ValueError:
        nmin = nmax = 1
    backend = (opt("rdzv_backend", "static") or "static").lower()
    run_id = opt("rdzv_id", "none") or "none"
    endpoint = opt("rdzv_endpoint", "") or ""
    if backend == "c10d":
        if not endpoint:
            return None
        host, port = _host_port(endpoint, 29400)
        return StoreEndpoint(host, port, run_id, "c10d", nmin, nmax)
    if backend == "static":
        if endpoint:
            host, port = _host_port(endpoint, 29500)
        else:
            host = opt("master_addr", "127.0.0.1") or "127.0.0.1"
            mp = opt("master_port")
            if mp is None and nmax == 1:
                return None  # torchrun turns this into a private c10d store on localhost:0
            port = int(mp or 29500)
        return StoreEndpoint(host, port, run_id, "static", nmin, nmax,
                             node_rank=_int_or_none(opt("node_rank", "0")))
    return None


def endpoint_from_rank_env(env: Mapping[str, str]) -> StoreEndpoint | None:
    """The store a rank's ``env://`` init uses (MASTER_ADDR:MASTER_PORT). Under torchrun with
    c10d that is a second store, on group rank 0's agent; with
    ``TORCHELASTIC_USE_AGENT_STORE=False`` (or without torchrun) rank 0's own process hosts it,
    so it lives only as long as rank 0 and only after ``init_process_group``."""
    addr, port = env.get("MASTER_ADDR"), _int_or_none(env.get("MASTER_PORT"))
    if not addr or port is None:
        return None
    world, lw = _int_or_none(env.get("WORLD_SIZE")), _int_or_none(env.get("LOCAL_WORLD_SIZE"))
    gw = _int_or_none(env.get("GROUP_WORLD_SIZE"))
    n = gw or (-(-world // lw) if world and lw else 1)
    return StoreEndpoint(addr, port, env.get("TORCHELASTIC_RUN_ID") or "none", "env", n, n,
                         source="rank env")


def _listen_inodes(pid: int, port: int) -> set[str]:
    inodes: set[str] = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    return inodes


def store_listener_pid(port: int, pids: Iterable[int]) -> int | None:
    """Which of ``pids`` (this node's job: the torchrun agent and its descendants) listens on
    ``port``: the node hosting the store, whose watcher must end its job last. Reads /proc
    (each process's own network namespace); None if none of them does."""
    pids = list(pids)
    wanted: set[str] = set()
    for pid in pids[:1] or []:
        wanted |= _listen_inodes(pid, port)
    if not wanted:
        for pid in pids[1:]:
            wanted |= _listen_inodes(pid, port)
    if not wanted:
        return None
    targets = {f"socket:[{i}]" for i in wanted}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in targets:
                    return pid
    return None


# ----------------------------------------------------------------------------- the protocol


Analyse = Callable[[dict[str, NodeSummary], list[str]], dict[str, Any]]


class Coordinator:
    """One node's side of the protocol. No method raises on a channel failure: each returns
    its "nothing" (False, None, empty) and :attr:`gone` says why; the caller then goes on
    local-only."""

    def __init__(self, channel: Channel, node: str, host: str | None = None, *,
                 watcher_pid: int | None = None, poll_s: float = 0.05,
                 stale_request_s: float = 120.0) -> None:
        self.channel = channel
        self.node = sanitize(node)
        self.host = host or socket.gethostname()
        self.watcher_pid = os.getpid() if watcher_pid is None else watcher_pid
        self.poll_s = poll_s
        self.t0 = time.time()
        # a request older than this watcher (minus clock skew) belongs to an earlier job that
        # used the same shared directory
        self.stale_request_s = stale_request_s
        self.local_world: int | None = None
        self.hosts_store = False
        self._beats = 0
        self._request: CaptureRequest | None = None
        self.request_event = threading.Event()
        self._offered: NodeSummary | None = None
        self._offered_fp: str | None = None
        self._published_fp: str | None = None
        self._last_pub = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._verdict_seen: float | None = None
        # rounds: a capture that did not end the job (on request, an uncertain verdict) is
        # followed by another one under fresh keys (r<k>/request, ...); round 0 has none
        self.round = 0

    @property
    def gone(self) -> str | None:
        return self.channel.gone

    def _rk(self, name: str, rnd: int | None = None) -> str:
        """A key of the current round (``rnd``: of that one)."""
        k = self.round if rnd is None else rnd
        return name if k == 0 else f"r{k}/{name}"

    def next_round(self) -> int:
        """After a round that did not end the job: the next capture request is a new one.
        Every node moves on once it has the verdict; the round number is also kept in the
        channel, for a watcher that registers later."""
        with self._lock:
            self.round += 1
            self._request = None
            self.request_event.clear()
            rnd = self.round
        self._done(lambda: self.channel.put("round", str(rnd).encode()))
        return rnd

    def _current_round(self) -> None:
        raw = self._try(lambda: self.channel.get("round"), None)
        with contextlib.suppress(ValueError, TypeError):
            rnd = int((raw or b"0").decode())
            with self._lock:
                if rnd > self.round:
                    self.round, self._request = rnd, None
                    self.request_event.clear()

    def _try(self, fn: Callable[[], T], default: T) -> T:
        try:
            return fn()
        except ChannelGone:
            return default

    def _done(self, fn: Callable[[], None]) -> bool:
        try:
            fn()
            return True
        except ChannelGone:
            return False

    # ------------------------------------------------------------------ membership

    def register(self, local_ranks: Sequence[int], *, hosts_store: bool = False,
                 world: int | None = None, local_world: int | None = None) -> bool:
        self.hosts_store = hosts_store
        self.local_world = local_world or len(local_ranks) or None
        info = NodeInfo(self.node, self.host, sorted(int(r) for r in local_ranks),
                        self.watcher_pid, time.time(), hosts_store, world, self.local_world)

        self.beat()
        return self._done(lambda: self.channel.put_member("node", self.node,
                                                          encode(info.to_json())))

    def beat(self) -> bool:
        """Liveness: a counter others watch change (no clocks compared across nodes)."""
        self._beats += 1
        data = str(self._beats).encode()
        return self._done(lambda: self.channel.put(f"alive/{self.node}", data))

    def nodes(self) -> dict[str, NodeInfo]:
        def do() -> dict[str, NodeInfo]:
            names = self.channel.members("node")
            out: dict[str, NodeInfo] = {}
            for n, raw in zip(names, self.channel.get_many([f"node/{n}" for n in names]),
                              strict=True):
                d = decode(raw)
                if isinstance(d, Mapping):
                    with contextlib.suppress(KeyError, TypeError, ValueError):
                        out[n] = NodeInfo.from_json(d)
            return out

        return self._try(do, {})

    # ------------------------------------------------------------------ summaries

    def publish_summary(self, summary: NodeSummary) -> bool:
        summary.node = self.node
        data = summary.encode()
        return self._done(lambda: self.channel.put_member("summary", self.node, data))

    def offer_summary(self, summary: NodeSummary) -> None:
        """Hand the latest summary to the background thread (published when it changed, at
        most every ``publish_every_s``): the watch loop never waits on the channel."""
        fp = json.dumps([r.to_json(stacks=True) | {"beat_time": None} for r in summary.ranks],
                        sort_keys=True, default=str)
        with self._lock:
            self._offered, self._offered_fp = summary, fp

    def _read_ns(self, ns: str, nodes: Sequence[str] | None) -> dict[str, NodeSummary]:
        if ns == "captured":
            ns = self._rk(ns)
        names = list(nodes) if nodes is not None else self.channel.members(ns)
        out: dict[str, NodeSummary] = {}
        for n, raw in zip(names, self.channel.get_many([f"{ns}/{sanitize(n)}" for n in names]),
                          strict=True):
            s = NodeSummary.decode(raw)
            if s is not None:
                out[n] = s
        return out

    def read_summaries(self, nodes: Sequence[str] | None = None,
                       kind: str = "summary") -> dict[str, NodeSummary]:
        """The latest published summaries (``kind="captured"``: the captures), node -> summary.
        What ``diagnose`` on one node reads about the others."""
        return self._try(lambda: self._read_ns(kind, nodes), {})

    # ------------------------------------------------------------------ capture

    def _accept(self, raw: bytes | None, rnd: int | None = None) -> CaptureRequest | None:
        """``raw`` read for round ``rnd`` (None: the current one) becomes the request of this
        round, unless the round moved on meanwhile."""
        d = decode(raw)
        if not isinstance(d, Mapping):
            return None
        try:
            req = CaptureRequest.from_json(d)
        except (KeyError, TypeError, ValueError):
            return None
        if req.time < self.t0 - self.stale_request_s:
            return None
        with self._lock:
            if rnd is not None and rnd != self.round:
                return None
            if self._request is None:
                self._request = req
                self.request_event.set()
            return self._request

    def request_capture(self, reason: str, by_node: str | None = None) -> CaptureRequest | None:
        """Ask every node to capture. The first request wins (atomic compare-and-set): the one
        returned may be another node's. None if the channel is gone."""
        me = sanitize(by_node) if by_node else self.node
        now = time.time()
        req = CaptureRequest(f"{me}-{time.time_ns()}-{os.getpid()}", reason[:500], me,
                             self.host, now)
        rnd = self.round
        raw = self._try(lambda: self.channel.put_first(self._rk("request", rnd),
                                                       encode(req.to_json())), None)
        if raw is None:
            return None
        got = self._accept(raw, rnd)
        if got is None:  # a stale request of an earlier job holds the key: ours stands locally
            with self._lock:
                self._request = self._request or req
                self.request_event.set()
                return self._request
        return got

    def poll_capture_request(self) -> CaptureRequest | None:
        """Non-blocking. With the background thread running this costs nothing."""
        if self._request is not None:
            return self._request
        if self._thread is not None and self._thread.is_alive():
            return None
        rnd = self.round
        return self._accept(self._try(lambda: self.channel.get(self._rk("request", rnd)), None),
                            rnd)

    def wait_capture_request(self, timeout: float) -> CaptureRequest | None:
        if self._request is not None:
            return self._request
        rnd = self.round
        if self._try(lambda: self.channel.wait(self._rk("request", rnd), timeout), False):
            return self._accept(self._try(lambda: self.channel.get(self._rk("request", rnd)),
                                          None), rnd)
        return None

    def publish_capture(self, summary: NodeSummary, request: CaptureRequest | None) -> bool:
        summary.node, summary.kind = self.node, "capture"
        summary.request = request.id if request else None
        data = summary.encode()
        ns = self._rk("captured")
        return self._done(lambda: self.channel.put_member(ns, self.node, data))

    def wait_all_captured(self, expected: Sequence[str], deadline: float, *,
                          request: CaptureRequest | None = None, dead_after_s: float = 5.0,
                          unregistered_grace_s: float = 5.0,
                          ) -> tuple[dict[str, NodeSummary], list[str]]:
        """Until every expected node published its capture (for ``request``), or ``deadline``
        (``time.monotonic()``). Gives up early on a node that never registered (after
        ``unregistered_grace_s``) and on one whose watcher stopped beating for ``dead_after_s``.
        Returns (captured, missing)."""
        want = [sanitize(n) for n in expected] or [self.node]
        captured: dict[str, NodeSummary] = {}
        t_start = time.monotonic()
        last_alive: dict[str, tuple[bytes | None, float]] = {}
        given_up: set[str] = set()
        next_liveness = t_start + min(1.0, dead_after_s / 3)
        while not self.gone:
            pending = [n for n in want if n not in captured and n not in given_up]
            if not pending:
                break
            listed: list[str] = self._try(
                functools.partial(self.channel.members, self._rk("captured"), pending), [])
            fresh = [n for n in pending if n in listed]
            if fresh:
                got: list[bytes | None] = self._try(functools.partial(
                    self.channel.get_many, [self._rk(f"captured/{n}") for n in fresh]), [])
                for n, raw in zip(fresh, got, strict=False):
                    s = NodeSummary.decode(raw)
                    if s is not None and (request is None or s.request == request.id):
                        captured[n] = s
            now = time.monotonic()
            if now >= deadline:
                break
            if now >= next_liveness:
                next_liveness = now + min(1.0, dead_after_s / 3)
                if self._thread is None:
                    self.beat()  # nobody else beats for us while we wait
                pending = [n for n in want if n not in captured and n not in given_up]
                no_beats: list[bytes | None] = [None] * len(pending)
                nodes_seen: list[str] = self._try(
                    functools.partial(self.channel.members, "node", pending), [])
                registered = set(nodes_seen)
                beats = self._try(functools.partial(
                    self.channel.get_many, [f"alive/{n}" for n in pending]), no_beats)
                for n, b in zip(pending, beats, strict=False):
                    if n not in registered:
                        if now - t_start >= unregistered_grace_s:
                            given_up.add(n)
                        continue
                    seen = last_alive.get(n)
                    if seen is None or seen[0] != b:
                        last_alive[n] = (b, now)
                    elif b is not None and now - seen[1] >= dead_after_s:
                        given_up.add(n)  # registered, beat, then stopped: its watcher died
            time.sleep(min(self.poll_s, max(0.0, deadline - time.monotonic())))
        missing = sorted((n for n in want if n not in captured), key=_node_sort_key)
        return captured, missing

    # ------------------------------------------------------------------ verdict

    def make_verdict(self, verdict: Mapping[str, Any], request: CaptureRequest,
                     captured: Mapping[str, NodeSummary], missing: Sequence[str], *,
                     world: int | None = None, local_only: bool = False,
                     note: str | None = None) -> GlobalVerdict:
        lw = self.local_world or next((s.local_world for s in captured.values() if s.local_world),
                                      None)
        w = world or next((s.world for s in captured.values() if s.world), None)
        covered = {r.rank for s in captured.values() for r in s.ranks}
        unknown = sorted(set(range(w)) - covered) if w else ranks_of_nodes(missing, lw)
        return GlobalVerdict(
            request=request.id, by_node=self.node, time=time.time(), verdict_data=dict(verdict),
            captured=sorted(captured, key=_node_sort_key), missing=list(missing),
            hosts={n: s.host for n, s in sorted(captured.items())}, unknown_ranks=unknown,
            local_only=local_only, note=note, _summaries=dict(captured))

    def publish_verdict(self, verdict: GlobalVerdict) -> GlobalVerdict | None:
        """First verdict wins; returns the one every node prints (perhaps another node's).
        The global set goes first, under this node's name: a verdict seen implies its set."""
        if verdict.global_raw is None:
            verdict.global_raw = encode({n: s.to_json(stacks=False)
                                         for n, s in verdict.summaries.items()})
        data = verdict.global_raw
        gkey, vkey = self._rk(f"global/{self.node}"), self._rk("verdict")
        bkey = self._rk(f"verdict-body/{self.node}")
        if verdict.verdict_raw is None:
            verdict.verdict_raw = encode(verdict.verdict)
        body = verdict.verdict_raw
        if not self._done(lambda: self.channel.put(gkey, data)) or \
                not self._done(lambda: self.channel.put(bkey, body)):
            return None
        head = encode(verdict.record_json())
        raw = self._try(lambda: self.channel.put_first(vkey, head), None)
        if raw == head:
            return verdict
        return self._decode_verdict(raw)

    def _decode_verdict(self, raw: bytes | None) -> GlobalVerdict | None:
        d = decode(raw)
        if not isinstance(d, Mapping):
            return None
        try:
            by = sanitize(str(d.get("by_node", "")))
            gkey, bkey = self._rk(f"global/{by}"), self._rk(f"verdict-body/{by}")
            nothing: list[bytes | None] = [None, None]
            glob, body = self._try(lambda: self.channel.get_many([gkey, bkey]), nothing)
            return GlobalVerdict.from_json(d, glob, body)
        except (KeyError, TypeError, ValueError):
            return None

    def read_verdict(self, timeout: float = 0.0) -> GlobalVerdict | None:
        vkey = self._rk("verdict")
        if timeout > 0 and not self._try(lambda: self.channel.wait(vkey, timeout), False):
            return None
        return self._decode_verdict(self._try(lambda: self.channel.get(vkey), None))

    # ------------------------------------------------------------------ ending

    def ack_ended(self) -> bool:
        """This node has the verdict and is about to end its job."""
        now = str(time.time()).encode()
        ns = self._rk("ended")
        return self._done(lambda: self.channel.put_member(ns, self.node, now))

    def wait_ended(self, nodes: Sequence[str], timeout: float) -> list[str]:
        """On the node hosting the store: wait (bounded) until ``nodes`` acknowledged; returns
        those that did not."""
        want = {sanitize(n) for n in nodes} - {self.node}
        end = time.monotonic() + timeout
        while want and not self.gone:
            acked: list[str] = self._try(
                functools.partial(self.channel.members, self._rk("ended"), sorted(want)), [])
            want -= set(acked)
            if not want or time.monotonic() >= end:
                break
            time.sleep(self.poll_s)
        return sorted(want, key=_node_sort_key)

    # ------------------------------------------------------------------ background

    def start(self, interval: float = 1.0, publish_every_s: float = 2.0) -> None:
        """Background thread: liveness beats, offered summaries, and the capture request
        (a blocking wait on the store: seen within milliseconds, no polling)."""
        if self._thread is not None:
            return

        self._current_round()

        def loop() -> None:
            while not self._stop.is_set() and not self.gone:
                if self._request is None:
                    rnd = self.round
                    key = self._rk("request", rnd)
                    if self._try(functools.partial(self.channel.wait, key, interval), False):
                        self._accept(self._try(functools.partial(self.channel.get, key), None),
                                     rnd)
                else:
                    self._stop.wait(interval)
                if self._stop.is_set():
                    break
                self.beat()
                with self._lock:
                    offered, fp = self._offered, self._offered_fp
                now = time.monotonic()
                if (offered is not None and fp != self._published_fp
                        and now - self._last_pub >= publish_every_s
                        and self.publish_summary(offered)):
                    self._published_fp, self._last_pub = fp, now

        self._thread = threading.Thread(target=loop, name="moe-hang-coord", daemon=True)
        self._thread.start()

    def capture_requested(self) -> CaptureRequest | None:
        """The request seen by the background thread (or made here), without any I/O."""
        return self._request

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self) -> None:
        self.stop()
        self.channel.close()

    # ------------------------------------------------------------------ one round

    def _alive_counter(self, node: str) -> bytes | None:
        return self._try(lambda: self.channel.get(f"alive/{sanitize(node)}"), None)

    def _await_verdict(self, analyst: str, timeout: float,
                       dead_after_s: float) -> tuple[GlobalVerdict | None, str | None]:
        """A node that does not analyse waits for the analyst's verdict: a blocking wait on
        the store (no polling), in slices, watching the analyst's beat. Returns (verdict, why
        not), the reason once the analyst stopped beating for ``dead_after_s``."""
        end = time.monotonic() + timeout
        beat, since = self._alive_counter(analyst), time.monotonic()
        while not self.gone:
            left = end - time.monotonic()
            if left <= 0:
                return None, "no verdict in time"
            if self._try(functools.partial(self.channel.wait, self._rk("verdict"), min(1.0, left)),
                         False):
                self._verdict_seen = time.monotonic()  # before reading it
                return self.read_verdict(), None
            b, now = self._alive_counter(analyst), time.monotonic()
            if b != beat:
                beat, since = b, now
            elif now - since >= dead_after_s:
                return None, f"node {analyst} (the analyst) stopped answering"
        return None, self.gone

    def run_round(self, request: CaptureRequest, capture: Callable[[], NodeSummary],
                  analyse: Analyse, expected: Sequence[str], *, world: int | None = None,
                  capture_timeout_s: float = 30.0, verdict_timeout_s: float = 20.0,
                  end_wait_s: float = 15.0, dead_after_s: float = 5.0,
                  unregistered_grace_s: float = 5.0) -> RoundResult:
        """Everything from a capture request to the moment this node may end its job.

        Every node captures and publishes. The requester (or, when the request came from
        outside the watchers, e.g. ``diagnose``, the lowest expected node) waits for all
        captures (or the deadline), analyses and publishes the verdict with the global set;
        every other node
        waits for that verdict (it does not poll the captures: at 1000 nodes that would be
        1000 pollers). If the requester stops beating, the others wait for the captures
        themselves and analyse: the first verdict published wins, so all print the same one.
        Then acknowledgements, and the node hosting the store waits for them. Bounded by
        ``capture_timeout_s + verdict_timeout_s + end_wait_s`` plus the local capture.
        Call :meth:`start` first: the requester's beats are what the others watch."""
        t0 = time.monotonic()
        timings: dict[str, float] = {}
        mine = capture()
        timings["captured_here"] = time.monotonic() - t0
        self.publish_capture(mine, request)
        want = [sanitize(n) for n in expected]
        captured: dict[str, NodeSummary] = {self.node: mine}
        missing: list[str] = []
        analysed_here = False
        why: str | None = None

        def gather(until: float) -> None:
            nonlocal captured, missing
            got, missing = self.wait_all_captured(
                want, until, request=request, dead_after_s=dead_after_s,
                unregistered_grace_s=unregistered_grace_s)
            got.setdefault(self.node, mine)
            captured = got
            missing = [n for n in missing if n != self.node]
            timings["all_captured"] = time.monotonic() - t0

        def analyse_and_publish() -> GlobalVerdict | None:
            nonlocal analysed_here
            analysed_here = True
            return self.publish_verdict(self.make_verdict(
                analyse(captured, missing), request, captured, missing, world=world))

        verdict: GlobalVerdict | None = None
        self._verdict_seen = None
        analyst = (request.by_node if request.by_node in want or not want
                   else sorted(want, key=_node_sort_key)[0])
        if self.gone:
            why = self.gone
        elif analyst == self.node:
            gather(t0 + capture_timeout_s)
            verdict = analyse_and_publish()
        else:
            verdict, why = self._await_verdict(analyst, capture_timeout_s + verdict_timeout_s,
                                               dead_after_s)
            if verdict is None and not self.gone:
                gather(t0 + capture_timeout_s + verdict_timeout_s)
                verdict = analyse_and_publish()
        if verdict is not None and verdict.request != request.id:
            why = (f"{self.channel.describe()} holds the verdict of another round "
                   f"({verdict.request}): give each job its own shared directory")
            verdict = None
        if verdict is None:
            others = sorted(set(want) - {self.node}, key=_node_sort_key)
            note = f"{self.gone or why or 'no verdict'}: local ranks only"
            verdict = self.make_verdict(analyse({self.node: mine}, others), request,
                                        {self.node: mine}, others, world=world,
                                        local_only=True, note=note)
            analysed_here, captured, missing = True, {self.node: mine}, others
        timings["verdict"] = time.monotonic() - t0
        timings["verdict_seen"] = (self._verdict_seen or time.monotonic()) - t0
        not_ended: list[str] = []
        if not verdict.local_only:
            missing = verdict.missing  # the global set itself: verdict.summaries (decoded lazily)
            self.ack_ended()
            if self.hosts_store:
                not_ended = self.wait_ended(verdict.captured, end_wait_s)
        timings["ended"] = time.monotonic() - t0
        return RoundResult(verdict, request, captured, missing, analysed_here, timings, not_ended)


# ----------------------------------------------------------------------------- a verdict


def basic_verdict(summaries: Mapping[str, NodeSummary], missing: Sequence[str],
                  world: int | None = None) -> dict[str, Any]:
    """A small verdict from summaries alone (tests, the benchmark, and a last resort): ranks
    pending at the same (group, seq) with a different op/size/dtype (desync, the minority to
    blame); otherwise ranks of captured nodes that are not in the collective others wait in
    (hang). Ranks of missing nodes are unknown, never culprits."""
    ranks = {r.rank: (s, r) for s in summaries.values() for r in s.ranks}
    at: dict[tuple[str, int], dict[Any, list[int]]] = {}
    for rank, (_s, r) in ranks.items():
        if r.pending:
            p = r.pending[0]
            at.setdefault((p.pg_id, p.seq), {}).setdefault(p.signature(), []).append(rank)
    for (pg, seq), sigs in sorted(at.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if len(sigs) > 1:
            groups = sorted(sigs.values(), key=lambda g: (len(g), g))
            culprits = sorted(r for g in groups[:-1] for r in g)
            per = {str(rs[0]): {"op": sig[0], "sizes": [list(x) for x in sig[1]],
                                "callsite": ranks[rs[0]][1].callsite, "host": ranks[rs[0]][0].host}
                   for sig, rs in sigs.items()}
            return {"verdict": "desync", "pg": pg, "seq": seq, "culprit_ranks": culprits,
                    "summary": f"ranks posted different collectives at seq {seq} of group {pg}: "
                               + "; ".join(f"rank {k} {v['op']}{v['sizes']} on {v['host']}"
                                           for k, v in per.items()),
                    "per_rank": per, "unknown_nodes": list(missing)}
    waiting = sorted(r for r, (_s, x) in ranks.items() if x.pending)
    if waiting:
        not_there = sorted(r for r, (_s, x) in ranks.items() if not x.pending)
        return {"verdict": "hang", "culprit_ranks": not_there, "waiting_ranks": waiting,
                "summary": (f"{len(waiting)} ranks wait in a collective; "
                            + (f"ranks {not_there} are elsewhere" if not_there
                               else "every captured rank is in it")
                            + (f"; nodes {list(missing)} unknown" if missing else "")),
                "unknown_nodes": list(missing)}
    return {"verdict": "inconclusive", "culprit_ranks": [], "unknown_nodes": list(missing),
            "summary": "no rank waits in a collective"}
