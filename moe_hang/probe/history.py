"""A rank's collective history that outlives the rank: ``rank{R}.posted.jsonl``.

torch's Flight Recorder is a ring in the rank's memory: gloo's abort (SIGABRT from its I/O
thread), a SIGKILL or ``os._exit`` take it with them. The probe copies what it holds into an
append-only file of JSON lines, one record per recorder entry, on every tick where a group
posted something (:meth:`History.tick`) and once more on the way out (:meth:`History.last_gasp`,
with call-site frames: ``probe/lastgasp.py`` hooks gloo's ``std::terminate`` and ``os._exit``).
A SIGKILL or SIGSEGV cannot be caught: the file then ends at the last tick before it.

Records (``kind`` first; the reader is ``moe_hang.evidence.posted_log``, whose docstring lists
every field):

``start``  a process began writing (pid, restart): record ids restart at 0 with it
``entry``  one recorder entry, keyed by ``record_id``; a later one of the same id supersedes it
           (the same entry again with frames, or its final state on the way out)
``stack``  call-site frames by content hash (``id``), written before the first entry using them
``gap``    record ids ``from``..``to`` (inclusive) that the ring dropped before they were copied
``status`` each group's [enqueued, completed, started] counts when copied (later progress of
           entries written earlier)
``end``    the last gasp (``reason``: abort, os_exit, exception, sigterm, exit)

The file (:mod:`.appendlog`) takes whole lines in one ``write`` each (a kill mid-write tears
at most the last line, which the reader skips) and keeps its newest half past a few MB.
Stdlib only: it runs in every rank; torch is what the caller hands in.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import pickle
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any, Protocol

MAX_FRAMES = 40  # frames kept per stack: the innermost ones (the op and who called it) ...
OUTER_FRAMES = 8  # ... and the outermost (the script's own loop), when a stack is deeper
MAX_THREAD_NAMES = 4096
TorchWithin = Callable[[float | None], AbstractContextManager[Any]]


class Log(Protocol):  # appendlog.PostedLog, handed in (siblings load without a package)
    def open(self, start: dict[str, Any]) -> None: ...
    def write(self, records: Iterable[dict[str, Any]]) -> None: ...
    def known_stack(self, sid: str) -> bool: ...

COST_RATIO = 100.0  # copies spaced by 100 × what the last one cost: under 1 % of a core
LOCK_TIMEOUT_S = 1.0  # how long a last gasp waits for the probe's torch lock


def _frames(raw: Any) -> tuple[tuple[str, int, str], ...] | None:
    if not isinstance(raw, list) or not raw:
        return None
    out = []
    for f in raw:
        if isinstance(f, dict):
            out.append((str(f.get("filename", "?")), _int(f.get("line")) or 0,
                        str(f.get("name", "?"))))
    return tuple(out) or None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _pg(e: dict[str, Any]) -> tuple[str, str]:
    pg = e.get("process_group")
    if isinstance(pg, (list, tuple)) and pg:
        return str(pg[0]), str(pg[1]) if len(pg) > 1 else ""
    return str(e.get("pg_id", "0")), ""


def stack_record(frames: tuple[tuple[str, int, str], ...]) -> tuple[str, dict[str, Any]]:
    """(content id, the ``stack`` record): innermost first, the middle of a deep one cut."""
    cut = 0
    kept: list[tuple[str, int, str]] = list(frames)
    if len(kept) > MAX_FRAMES:
        cut = len(kept) - MAX_FRAMES
        kept = kept[:MAX_FRAMES - OUTER_FRAMES] + kept[-OUTER_FRAMES:]
    sid = hashlib.blake2b(repr(kept).encode(), digest_size=8).hexdigest()
    rec: dict[str, Any] = {"kind": "stack", "id": sid, "frames": [list(f) for f in kept]}
    if cut:
        rec["cut"] = cut  # frames left out between the innermost and the outermost
    return sid, rec


# what an entry record keeps of a recorder entry, under the recorder's own names (the reader
# hands them to the dump parser as they are); a None is left out
ENTRY_KEYS = ("record_id", "pg_id", "collective_seq_id", "p2p_seq_id", "op_id",
              "profiling_name", "is_p2p", "input_sizes", "input_dtypes", "output_sizes",
              "output_dtypes", "time_created_ns", "state", "retired",
              "time_discovered_started_ns", "time_discovered_completed_ns", "duration_ms")


class ThreadNames:
    """Python's names of the job's threads by thread id, as they were when each posted: a
    thread is often gone by the copy after its collectives, and a new thread may reuse its
    id. Threads started after :meth:`follow` are named from their start; the others (and
    renames) from the live threads at each copy."""

    def __init__(self) -> None:
        self._by_id: dict[str, list[tuple[int, str]]] = {}  # id -> [(since ns, name)]

    def saw(self, ident: int | None, name: str, since_ns: int) -> None:
        if ident is None:
            return
        known = self._by_id.setdefault(str(ident), [])
        if known and known[-1][1] == name:
            return
        if known and since_ns == 0:
            known[-1] = (known[-1][0], name)  # renamed (or reused unseen): from now on
        else:
            known.append((since_ns, name))
            del known[:-4]
        if len(self._by_id) > MAX_THREAD_NAMES:
            del self._by_id[next(iter(self._by_id))]

    def refresh(self) -> None:
        for t in threading.enumerate():
            self.saw(t.ident, t.name, 0)

    def name(self, tid: str, created_ns: Any) -> str | None:
        known = self._by_id.get(tid)
        if not known:
            return None
        if isinstance(created_ns, int):
            for since, name in reversed(known):
                if since <= created_ns:
                    return name
        return known[-1][1]

    def follow(self) -> None:
        """Name every thread the job starts from now on, as it starts (once a process)."""
        real = threading.Thread.start
        if getattr(real, "_moe_hang_real", None) is not None:
            return
        names = self

        def start(thread: threading.Thread) -> None:
            since = time.time_ns()  # the recorder's clock; before the thread can post
            real(thread)
            with contextlib.suppress(Exception):
                names.saw(thread.ident, thread.name, since)

        start._moe_hang_real = real  # type: ignore[attr-defined]
        threading.Thread.start = start  # type: ignore[method-assign,assignment]


def entry_record(e: dict[str, Any], thread_names: ThreadNames,
                 stack: str | None) -> dict[str, Any]:
    """One recorder entry as a log record (``stack``: the id of its frames' record)."""
    rec: dict[str, Any] = {"kind": "entry"}
    for k in ENTRY_KEYS:
        v = e.get(k)
        if v is not None:
            rec[k] = v
    rec["process_group"] = list(_pg(e))
    tid = e.get("thread_id")
    if tid is not None:
        rec["thread_id"] = str(tid)
    # the recorder's thread name is the OS one ("python" for every Python thread before
    # 3.14): the Python thread's own name says which thread of the job posted it
    thread = thread_names.name(str(tid), e.get("time_created_ns")) if tid is not None else None
    thread = thread or e.get("thread_name")
    if thread is not None:
        rec["thread_name"] = str(thread)
    if stack is not None:
        rec["stack"] = stack
    return rec


class History:
    """What this rank posted, copied from its recorder into the log.

    ``log``: the file (:class:`appendlog.PostedLog`). ``torch_within(timeout)`` is the probe's
    way into torch: a context manager giving torch, or None (shutting down, or its lock not
    taken within ``timeout``; None: wait)."""

    def __init__(self, log: Log, torch_within: TorchWithin, start: dict[str, Any]):
        self.log = log
        self._pid = os.getpid()  # a forked child (a DataLoader worker) is no rank: it never writes
        self._torch_within = torch_within
        self._start = start
        self._lock = threading.Lock()
        self._opened = False
        self._last_id: int | None = None  # the newest record id written
        self._written: dict[int, tuple[Any, Any, bool]] = {}  # id -> (state, retired, frames)
        self._frameless: set[int] = set()  # written from a copy without frames: may gain them
        self._enqueued: dict[str, int] | None = None  # the groups' counts when last copied
        self.thread_names = ThreadNames()
        self.cost = 0.0  # CPU seconds the last copy took
        self._at = -1e9
        self.ended = False

    # ------------------------------------------------------------------ when

    def due(self, status: dict[str, Any] | None, now: float) -> bool:
        """A group posted since the last copy, and the last copy's cost allows one now."""
        if status is None:
            return False
        enqueued = {pg: s["enqueued"] for pg, s in status.items()}
        return enqueued != self._enqueued and now - self._at >= COST_RATIO * self.cost

    def tick(self, status: dict[str, Any] | None, stacks: bool, force: bool = False
             ) -> bytes | None:
        """On a probe tick: copy what was posted since the last one (or, ``force``, copy
        anyway). Returns the recorder pickle it read (None: nothing read)."""
        now = time.monotonic()
        if (not force and not self.due(status, now)) or os.getpid() != self._pid:
            return None
        if not self._lock.acquire(timeout=LOCK_TIMEOUT_S):
            return None
        cpu = time.thread_time()  # this thread's CPU: what the copy costs, whatever the load
        try:
            raw = self._copy(stacks, None, final=False, status=status)
        finally:
            self._lock.release()
        self._at, self.cost = now, time.thread_time() - cpu
        return raw

    def last_gasp(self, reason: str, stacks: bool = True,
                  timeout: float = LOCK_TIMEOUT_S) -> None:
        """Everything still in the ring, with frames, then the ``end`` record: bounded by
        ``timeout`` on each lock (the recorder copy is skipped when torch's is not free)."""
        if os.getpid() != self._pid or not self._lock.acquire(timeout=timeout):
            return
        try:
            self._copy(stacks, timeout, final=True, status=None)
            if not self.ended:  # the first says how it ended (an exception, then the exit)
                self._write([{"kind": "end", "reason": reason, "time": time.time()}])
            self.ended = True
        finally:
            self._lock.release()

    # ------------------------------------------------------------------ how

    def _write(self, records: list[dict[str, Any]]) -> None:
        if not self._opened:
            self._opened = True
            self.log.open(self._start)
        self.log.write(records)

    def _copy(self, stacks: bool, timeout: float | None, final: bool,
              status: dict[str, Any] | None) -> bytes | None:
        with self._torch_within(timeout) as torch:
            if torch is None:
                return None
            raw = bytes(torch._C._distributed_c10d._dump_fr_trace(
                includeStackTraces=stacks))
        # torch wrote it in this very process: no foreign globals. Thousands of containers at
        # once would start the collector over torch's whole heap (a median 0.3 ms unpickle of
        # 256 entries averages 1.2 ms with it on); refcounting frees them all anyway
        gc.disable()
        try:
            dump = pickle.loads(raw)
        finally:
            gc.enable()
        self.thread_names.refresh()
        self._write(self._records(dump.get("entries") or [], stacks, final,
                                  status or _status(dump)))
        return raw

    def _records(self, entries: list[dict[str, Any]], stacks: bool, final: bool,
                 status: dict[str, Any] | None) -> list[dict[str, Any]]:
        entries = [e for e in entries if type(e.get("record_id")) is int]
        out: list[dict[str, Any]] = []
        if entries:
            entries.sort(key=lambda e: e["record_id"])  # as the ring holds them: linear
            out = self._entries(entries, stacks, final)
        if status:
            self._enqueued = {pg: s["enqueued"] for pg, s in status.items()}
            out.append({"kind": "status", "time": time.time(),
                        "pg": {pg: [s["enqueued"], s["completed"], s.get("started", -1)]
                               for pg, s in status.items()}})
        return out

    def _entries(self, entries: list[dict[str, Any]], stacks: bool,
                 final: bool) -> list[dict[str, Any]]:
        """The records of a dump's entries (sorted by id) not yet in the log as they are."""
        first, newest = entries[0]["record_id"], entries[-1]["record_id"]
        out: list[dict[str, Any]] = []
        if self._last_id is not None and newest < self._last_id:
            # the recorder was reset (its ids start over): a new history from here
            self._last_id, self._written = None, {}
            out.append({**self._start, "why": "recorder reset"})
        prev = self._last_id if self._last_id is not None else -1
        if first > prev + 1:  # posted and dropped from the ring between two copies
            out.append({"kind": "gap", "from": prev + 1, "to": first - 1, "why": "ring"})
        written = self._written
        while written and next(iter(written)) < first:  # out of the ring: never again
            del written[next(iter(written))]
        i = len(entries)
        while i and entries[i - 1]["record_id"] > prev:
            i -= 1
        if final:
            todo = entries  # what was written may have changed (its frames, its state)
        elif stacks and self._frameless:  # frames now: for those written without (once)
            todo = [e for e in entries[:i] if e["record_id"] in self._frameless] + entries[i:]
            self._frameless.clear()
        else:  # a plain tick: only what is new (the ring's tail), cheap at any ring size
            todo = entries[i:]
        new_stacks: set[str] = set()
        for e in todo:
            rid = e["record_id"]
            frames = _frames(e.get("frames"))
            sig = (e.get("state"), e.get("retired"), frames is not None)
            old = written.get(rid)
            # new; or again with the frames it lacked; or, on the way out, its final state
            if old is not None and not (frames is not None and not old[2]) \
                    and not (final and old[:2] != sig[:2]):
                continue
            sid = None
            if frames is not None:
                sid, rec = stack_record(frames)
                if sid not in new_stacks and not self.log.known_stack(sid):
                    new_stacks.add(sid)
                    out.append(rec)
            out.append(entry_record(e, self.thread_names, sid))
            written[rid] = sig
            if not stacks:
                self._frameless.add(rid)
        self._last_id = max(newest, prev)
        if len(self._frameless) > len(entries):
            self._frameless.intersection_update(written)  # only what the ring still has
        return out


def _status(dump: dict[str, Any]) -> dict[str, Any] | None:
    """The groups' counts from a dump's own ``pg_status`` (a last gasp reads no other)."""
    st = dump.get("pg_status")
    if not isinstance(st, dict):
        return None
    out = {}
    for pg, s in st.items():
        with contextlib.suppress(TypeError, ValueError, AttributeError):
            out[str(pg)] = {"enqueued": int(s.get("last_enqueued_collective", -1)),
                            "completed": int(s.get("last_completed_collective", -1)),
                            "started": int(s.get("last_started_collective", -1))}
    return out or None
