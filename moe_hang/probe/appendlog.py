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


class PostedLog:
    """The file: whole-line appends, and the rewrite that bounds it."""

    def __init__(self, path: Path, max_bytes: int = MAX_BYTES):
        self.path, self.max_bytes = path, max_bytes
        self._fd: int | None = None
        self._size = 0
        self._stacks: dict[str, bytes] = {}  # id -> its line, re-written with a kept tail
        self._start = b""
        # (offset, first record id) of each batch since the last rewrite: where to cut
        self._batches: deque[tuple[int, int | None]] = deque(maxlen=100_000)

    def open(self, start: dict[str, Any]) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._size = os.fstat(self._fd).st_size
        head = b""
        if self._size:  # an earlier process of this rank (a restart) may have died mid-line
            with open(self.path, "rb") as f:
                f.seek(self._size - 1)
                head = b"" if f.read(1) == b"\n" else b"\n"
        self._start = _line(start)
        self._append(head + self._start, None)

    def known_stack(self, sid: str) -> bool:
        return sid in self._stacks

    def write(self, records: Iterable[dict[str, Any]]) -> None:
        """Whole lines in one ``write``: a reader never sees half a record but the last."""
        first: int | None = None
        lines = []
        for r in records:
            line = _line(r)
            if r["kind"] == "stack":
                if len(self._stacks) >= MAX_STACKS:
                    self._stacks.clear()
                self._stacks[r["id"]] = line
            elif r["kind"] == "entry" and first is None:
                first = r.get("record_id")
            lines.append(line)
        if lines:
            self._append(b"".join(lines), first)
        if self._size > self.max_bytes:
            self._trim()

    def _append(self, data: bytes, first: int | None) -> None:
        if self._fd is None:
            return
        self._batches.append((self._size, first))
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self._size += len(data)

    def _trim(self) -> None:
        """The newest half, from a batch boundary (see the module's docstring)."""
        cut = next((o for o, _ in self._batches if o >= self._size // 2), self._size)
        kept_first = next((f for o, f in self._batches if o >= cut and f is not None), None)
        dropped = [f for o, f in self._batches if o < cut and f is not None]
        with open(self.path, "rb") as src:
            src.seek(cut)
            tail = src.read()
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
        shift = cut - len(data) + len(tail)
        self._batches = deque(((o - shift, f) for o, f in self._batches if o >= cut),
                              maxlen=self._batches.maxlen)


# one encoder for every line (json.dumps with options builds a new one per call)
_ENCODE = json.JSONEncoder(separators=(",", ":"), default=str).encode


def _line(rec: dict[str, Any]) -> bytes:
    return _ENCODE(rec).encode() + b"\n"
