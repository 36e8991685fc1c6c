"""The probes' heartbeat files of a run directory's ``ranks/``, read as they are at this moment
(a rank may be half-way through renaming one: it is read on the next poll)."""

from __future__ import annotations

import json
from pathlib import Path

from moe_hang.evidence.probe_records import Heartbeat
from moe_hang.probe.layout import RankFiles


def read_heartbeats(probe_dir: Path) -> dict[int, Heartbeat]:
    """rank -> its latest heartbeat."""
    out: dict[int, Heartbeat] = {}
    if not probe_dir.is_dir():
        return out
    for p in sorted(probe_dir.glob(f"rank*.{RankFiles.HEARTBEAT}")):
        try:
            hb = Heartbeat.parse(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue  # mid-rename or a rank that died writing: next poll
        if hb is not None:
            out[hb.rank] = hb
    return out
