"""NCCL RAS at capture time: two reports a few seconds apart from a live job, written into the
run directory (``ras/poll1.json``, ``ras/poll2.json``, ``ras/polls.json``), read back by
:func:`moe_hang.evidence.ras_files.attach_run_ras` — NCCL jobs only, bounded.

A job is NCCL when its recorder or its probe's heartbeats say so (``nccl:`` entries, the
backend it reported), or, when neither says anything, when an ``NCCL_*`` variable is in its
allowlisted environment; a gloo job is never asked (nothing listens there, and asking costs
the interval). ``NCCL_RAS_ENABLE=0`` turns RAS off: then it is not asked either, and the
capture says so. The endpoint is the job's ``NCCL_RAS_ADDR`` when it set one. Each query is
bounded (RAS's own per-peer timeout plus a margin), and the pair by twice that plus the
interval; a failure is a note in ``polls.json``, never an error of the capture.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import psutil

from moe_hang.capture.ras import (
    ENV_RAS_ADDR,
    RasAnswer,
    RasPair,
    ras_endpoint,
    take_two,
)
from moe_hang.errors import MoeHangError
from moe_hang.evidence import flight_recorder as fr
from moe_hang.evidence.probe_records import Heartbeat
from moe_hang.probe.env import write_atomic
from moe_hang.probe.layout import RankFiles, RunLayout
from moe_hang.runtime import rundir
from moe_hang.settings import Settings

ENV_RAS_ENABLE = "NCCL_RAS_ENABLE"
Say = Callable[[str], None]


def backend_of(heartbeats: Iterable[Heartbeat], dumps: Iterable[Path],
               envs: Iterable[Mapping[str, str]]) -> str | None:
    """"nccl", "gloo", or None (nothing says): the recorder and the heartbeats first (any NCCL
    group makes it an NCCL job), the environment's NCCL_* only when they say nothing."""
    seen: set[str] = set()
    for hb in heartbeats:
        if hb.backend:
            seen.add(hb.backend)
        for e in hb.pending:
            name = str(e.get("profiling_name", ""))
            if ":" in name:
                seen.add(name.split(":", 1)[0])
    if not seen:
        for p in dumps:  # one readable dump says enough
            with contextlib.suppress(OSError, fr.DumpError):
                backend = fr.load(p, context=1).backend
                if backend:
                    seen.add(backend)
                    break
    if "nccl" in seen:
        return "nccl"
    if seen:
        return sorted(seen)[0]
    if any(k.startswith("NCCL_") for env in envs for k in env):
        return "nccl"
    return None


def local_aliases() -> dict[str, str]:
    """This machine's addresses -> its host name (RAS names processes by address, the tool
    by the name the probe and discovery record: socket.gethostname())."""
    name = socket.gethostname()
    out: dict[str, str] = {}
    with contextlib.suppress(OSError, RuntimeError):
        for addrs in psutil.net_if_addrs().values():
            for a in addrs:
                if a.family in (socket.AF_INET, socket.AF_INET6) and a.address:
                    out[a.address.split("%", 1)[0]] = name
    return out


def _write(layout: RunLayout, pair: RasPair, aliases: dict[str, str]) -> None:
    layout.ras_dir.mkdir(exist_ok=True, mode=0o700)
    polls: list[dict[str, Any]] = []
    answers: list[RasAnswer] = [a for a in (pair.first, pair.second) if a is not None]
    for i, a in enumerate(answers, 1):
        entry: dict[str, Any] = {"source": f"RAS at {a.endpoint} ({a.via})",
                                 "seconds": round(a.seconds, 3)}
        if a.text:
            path = layout.ras_poll(i, a.fmt or "text")
            write_atomic(path, a.text.encode())
            entry["file"] = path.name
        if a.error:
            entry["error"] = f"RAS at {a.endpoint}: {a.error}"
        polls.append(entry)
    rundir.write_json(layout.ras_meta, {"polls": polls, "interval_s": pair.interval_s,
                                        "aliases": aliases})


def poll_into(layout: RunLayout, *, backend: str | None, env: Mapping[str, str],
              settings: Settings, say: Say | None = None,
              take: Callable[..., RasPair] = take_two) -> bool:
    """Two RAS reports ``settings.ras_interval_s`` apart into the run directory, if the job
    is NCCL's and RAS is on; True when it asked. ``env``: the job's (allowlisted)
    environment."""
    if backend != "nccl":
        return False
    if env.get(ENV_RAS_ENABLE, "").strip() == "0":
        layout.ras_dir.mkdir(exist_ok=True, mode=0o700)
        rundir.write_json(layout.ras_meta, {"polls": [], "notes": [
            f"{ENV_RAS_ENABLE}=0 in the job's environment: RAS is off, not asked"]})
        return False
    try:
        endpoint = ras_endpoint(env.get(ENV_RAS_ADDR) or None)
    except MoeHangError as exc:  # the job's own setting: a note here, not our error
        layout.ras_dir.mkdir(exist_ok=True, mode=0o700)
        rundir.write_json(layout.ras_meta, {"polls": [], "notes": [str(exc)]})
        return False
    if say is not None:
        say(f"asking NCCL RAS at {endpoint} twice, {settings.ras_interval_s:.0f} s apart")
    pair = take(settings.ras_interval_s, endpoint, ras_timeout_s=settings.ras_timeout_s,
                deadline_s=settings.ras_query_deadline_s)
    _write(layout, pair, local_aliases())
    return True


def _job_env(envs: Iterable[Mapping[str, str]]) -> dict[str, str]:
    """The NCCL_* settings the ranks share (the first rank's where they differ)."""
    out: dict[str, str] = {}
    for env in envs:
        for k, v in env.items():
            if k.startswith("NCCL_"):
                out.setdefault(k, v)
    return out


def capture_ras(layout: RunLayout, heartbeats: Iterable[Heartbeat] = (),
                envs: Iterable[Mapping[str, str]] = (), say: Say | None = None, *,
                settings: Settings) -> bool:
    """At a capture (``watch``'s, ``diagnose``'s): the job's backend from what the capture
    holds, then :func:`poll_into`. ``heartbeats``: the ranks' latest (else read from the run
    directory); ``envs``: the ranks' allowlisted environments."""
    hbs = list(heartbeats) or _heartbeats(layout)
    env_list = [dict(e) for e in envs]
    backend = backend_of(hbs, _fr_files(layout), env_list)
    return poll_into(layout, backend=backend, env=_job_env(env_list), settings=settings,
                     say=say)


def _heartbeats(layout: RunLayout) -> list[Heartbeat]:
    out = []
    for p in layout.files_of(RankFiles.HEARTBEAT):
        with contextlib.suppress(OSError, ValueError):
            hb = Heartbeat.parse(json.loads(p.read_text()))
            if hb is not None:
                out.append(hb)
    return out


def _fr_files(layout: RunLayout) -> list[Path]:
    return [layout.rank(r).fr for r in sorted(layout.rank_numbers())
            if layout.rank(r).fr.exists()]
