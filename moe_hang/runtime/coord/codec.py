"""Values in the channel: compact JSON (compressed past a few hundred bytes), decoded as
untrusted input."""

from __future__ import annotations

import json
import zlib
from typing import Any

SCHEMA = 1
_MAX_DECODED = 64 << 20


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
    except (ValueError, zlib.error, RecursionError):
        return None


def _int_or_none(v: Any) -> int | None:
    try:
        return None if v is None else int(v)
    except (TypeError, ValueError):
        return None
