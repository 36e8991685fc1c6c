"""What a capture request was made for: its reason starts with the event's kind
(``"stalled: no progress on any rank for 10.2 s"``)."""

from __future__ import annotations

from moe_hang.runtime.coord import CaptureRequest
from moe_hang.runtime.watchevent import EventKind


def request_kind(req: CaptureRequest | None) -> EventKind:
    """What the request was made for ("stalled: no progress ..." -> STALLED)."""
    if req is None:
        return EventKind.REQUESTED
    kind, sep, _ = req.reason.partition(":")
    try:
        return EventKind(kind) if sep else EventKind.REQUESTED
    except ValueError:
        return EventKind.REQUESTED


def reason_text(req: CaptureRequest | None) -> str:
    """The request's reason without its kind ("no progress on any rank for 10.2 s")."""
    return req.reason.partition(":")[2].strip() if req is not None else ""
