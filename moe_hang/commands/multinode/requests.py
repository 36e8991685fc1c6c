"""What a capture request was made for (its kind), and what that makes of the job."""

from __future__ import annotations

from moe_hang.runtime.coord import CaptureRequest

# what the request's kind makes of the job: the analysis' job kind
_JOB_OF = {"stalled": "stalled", "final": "stalled", "desync": "desync", "failed": "failed"}
# request kinds after which nothing is ended (a capture on demand)
ON_DEMAND = ("requested", "diagnose")


def request_kind(req: CaptureRequest | None) -> str:
    """What the request was made for ("stalled: no progress ..." -> "stalled")."""
    if req is None:
        return "requested"
    kind, sep, _ = req.reason.partition(":")
    return kind if sep and kind in (*_JOB_OF, *ON_DEMAND) else "requested"


def _reason_text(req: CaptureRequest | None) -> str:
    return req.reason.partition(":")[2].strip() if req is not None else ""
