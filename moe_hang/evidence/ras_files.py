"""NCCL RAS reports as a diagnosis's evidence: the files a user gives (``--ras FILE``, one per
poll) and the polls a capture took (``ras/`` of a run directory), attached to
:class:`~moe_hang.evidence.model.Evidence` with the job's processes to map global ranks —
pure (reads files only)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moe_hang.evidence.model import Evidence
from moe_hang.evidence.ras import (
    ProcessKey,
    RasPoll,
    RasReportError,
    differ,
    load_report,
    ras_evidence,
)
from moe_hang.probe.layout import RunLayout


def read_ras_files(paths: Sequence[Path]) -> list[RasPoll]:
    """``--ras FILE`` (repeatable): every file a RAS report (``ncclras`` / ``ncclras -f
    json`` output) of one job. :class:`RasReportError` names the file that is not."""
    polls = [RasPoll(load_report(p.expanduser()), str(p)) for p in paths]
    why = differ(polls)
    if why is not None:
        raise RasReportError(why)
    return polls


def known_processes(ev: Evidence) -> dict[ProcessKey, int]:
    """(host, pid) -> global rank of every rank the tool knows both of."""
    return {(e.host, e.pid): r for r, e in ev.ranks.items()
            if e.host is not None and e.pid is not None}


def other_job(ev: Evidence, polls: Sequence[RasPoll]) -> str | None:
    """Why these RAS reports cannot be of the job the rest of the evidence is (None when they
    may be): a communicator larger than its world."""
    world = ev.world_size
    if not world or not ev.ranks:
        return None
    for p in polls:
        big = max((c.size for c in p.report.communicators), default=0)
        if big > world:
            return (f"{p.source} has a communicator of {big} ranks, but the job has "
                    f"{world}: not this job's RAS report")
    return None


def attach_ras(ev: Evidence, polls: Sequence[RasPoll], *, interval_s: float | None = None,
               aliases: dict[str, str] | None = None, notes: Sequence[str] = ()) -> None:
    """``ev.ras`` from these polls (replacing what was there)."""
    ev.ras = ras_evidence(polls, known=known_processes(ev), aliases=aliases,
                          world_size=ev.world_size, interval_s=interval_s, notes=notes)


def _meta(layout: RunLayout) -> dict[str, Any] | None:
    try:
        data = json.loads(layout.ras_meta.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def attach_run_ras(ev: Evidence, root: Path) -> None:
    """The polls a capture took (``ras/polls.json`` and the reports beside it), if any; a
    report that cannot be read is a note, not an error (the capture stands without it)."""
    layout = RunLayout(root)
    meta = _meta(layout)
    if meta is None:
        return
    polls: list[RasPoll] = []
    notes = [str(n) for n in meta.get("notes") or []]
    for p in meta.get("polls") or []:
        if not isinstance(p, dict):
            continue
        if p.get("error"):
            notes.append(str(p["error"]))
            continue
        path = layout.ras_dir / Path(str(p.get("file", ""))).name
        try:
            polls.append(RasPoll(load_report(path), str(p.get("source") or path)))
        except RasReportError as exc:
            notes.append(str(exc))
    interval = meta.get("interval_s")
    aliases = meta.get("aliases")
    attach_ras(ev, polls, interval_s=float(interval) if isinstance(interval, (int, float))
               else None,
               aliases={str(k): str(v) for k, v in aliases.items()}
               if isinstance(aliases, dict) else None, notes=notes)
