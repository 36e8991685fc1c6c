"""A bounded append-only file of JSON lines (the posted log's file: :mod:`.history` says what
goes in it) — stdlib only, it runs in every rank.

Every batch of records is one ``write`` of whole lines to an ``O_APPEND`` descriptor: a reader
never sees half a record, but the last line of a process killed mid-write (the next process of
the rank starts on a fresh line). Past ``MAX_BYTES`` the file is rewritten (temp + rename)
keeping its newest half, behind the writer's ``start`` record, every ``stack`` record the kept
entries may use, and a ``gap`` record for the record ids it dropped.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MAX_BYTES = 4 << 20  # past this the file keeps its newest half: thousands of entries remain
MAX_STACKS = 4096  # distinct stacks remembered for rewriting the file (then forgotten)


_NONE: frozenset[str] = frozenset()


class _Batch:
    """One write: where it starts, its first record id, the stacks its entries use."""

    __slots__ = ("first", "offset", "uses")

    def __init__(self, offset: int, first: int | None, uses: frozenset[str]):
        self.offset, self.first, self.uses = offset, first, uses


class PostedLog:
    """The file: whole-line appends, and the rewrite that bounds it."""

    def __init__(self, path: Path, max_bytes: int = MAX_BYTES):
        self.path, self.max_bytes = path, max_bytes
        self._fd: int | None = None
        self._size = 0
        self._stacks: dict[str, bytes] = {}  # the stacks in the file: id -> their line
        self._start = b""
        self._batches: deque[_Batch] = deque(maxlen=100_000)  # since the last rewrite

    def open(self, start: dict[str, Any]) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._size = os.fstat(self._fd).st_size
        head = b""
        if self._size:  # an earlier process of this rank (a restart) may have died mid-line
            with open(self.path, "rb") as f:
                f.seek(self._size - 1)
                head = b"" if f.read(1) == b"\n" else b"\n"
        self._start = _line(start)
        self._append(head + self._start, None, _NONE)

    def known_stack(self, sid: str) -> bool:
        return sid in self._stacks

    def write(self, records: Iterable[dict[str, Any]]) -> None:
        """Whole lines in one ``write``: a reader never sees half a record but the last."""
        first: int | None = None
        uses: set[str] = set()
        lines = []
        for r in records:
            line = _line(r)
            if r["kind"] == "stack":
                if len(self._stacks) >= MAX_STACKS:
                    self._stacks.clear()  # written again where next used
                self._stacks[r["id"]] = line
            elif r["kind"] == "entry":
                first = r.get("record_id") if first is None else first
                if "stack" in r:
                    uses.add(r["stack"])
            lines.append(line)
        if lines:
            self._append(b"".join(lines), first, frozenset(uses) if uses else _NONE)
        if self._size > self.max_bytes:
            self._trim()

    def _append(self, data: bytes, first: int | None, uses: frozenset[str]) -> None:
        if self._fd is None:
            return
        self._batches.append(_Batch(self._size, first, uses))
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self._size += len(data)

    def _trim(self) -> None:
        """The newest half, from a batch boundary (see the module's docstring)."""
        kept = [b for b in self._batches if b.offset >= self._size // 2]
        cut = kept[0].offset if kept else self._size
        kept_first = next((b.first for b in kept if b.first is not None), None)
        dropped = [b.first for b in self._batches if b.offset < cut and b.first is not None]
        with open(self.path, "rb") as src:
            src.seek(cut)
            tail = src.read()
        # every stack a kept entry uses, ahead of it (re-defining one the tail has is harmless)
        used = {sid for b in kept for sid in b.uses if sid in self._stacks}
        self._stacks = {sid: self._stacks[sid] for sid in used}
        head = [self._start, *self._stacks.values()]
        if dropped and kept_first is not None and kept_first > min(dropped):
            head.append(_line({"kind": "gap", "from": min(dropped), "to": kept_first - 1,
                               "why": "trimmed"}))
        data = b"".join(head) + tail
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        old, self._fd = self._fd, os.open(self.path, os.O_WRONLY | os.O_APPEND)
        if old is not None:
            os.close(old)
        self._size = len(data)
        shift = cut - (len(data) - len(tail))
        for b in kept:
            b.offset -= shift
        self._batches = deque(kept, maxlen=self._batches.maxlen)


# one encoder for every line (json.dumps with options builds a new one per call)
_ENCODE = json.JSONEncoder(separators=(",", ":"), default=str).encode


def _line(rec: dict[str, Any]) -> bytes:
    return _ENCODE(rec).encode() + b"\n"
