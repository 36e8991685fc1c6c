"""A node's capture as it travels to the node that analyses (multi-node watch): the run
directory's own files — each rank's probe files and py-spy stacks, ``processes.json``,
``source.json``, the end of ``job.log`` — as text in one JSON object, bounded (:func:`pack`);
written back there as a capture directory of its own (:func:`unpack`, ``coord/nodes/<node>/``)
and read with the same loader as that node's own capture.

One format for a rank wherever it ran: a remote rank is the same evidence as a local one
(the summaries this replaces carried what someone had thought of, and each fix of a wrong
two-node verdict was "the summary did not carry X"), and the run directory keeps what the
verdict came from. A value from another node is input, not trusted: only the files named
here are written, under names built here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe_hang.evidence.flight_recorder import DumpError, load_raw
from moe_hang.evidence.posted_log import tail
from moe_hang.probe.layout import RankFiles, RunLayout

VERSION = 1
BUDGET = 32 << 20  # decoded bytes of one node's bundle (the channel decodes up to 64 MiB)
TEXT_MAX = 1 << 20  # a stack, an exception record, a process table: past this, left out
LOG_TAIL = 1 << 20  # the job log's end: torchrun's failure report, the aborts, tracebacks
# what the loader reads of a rank (evidence/load.py), by the name's part after "rank{R}."
RANK_FILES = (RankFiles.HEARTBEAT, RankFiles.FR, RankFiles.FR_SAVED, RankFiles.POSTED,
              RankFiles.TOKENS, RankFiles.ROUTING, RankFiles.STACK, RankFiles.FATAL,
              RankFiles.ERROR, RankFiles.GROUPS, RankFiles.DUMP_MARKER)
STACK_FILES = (RankFiles.PYSPY, RankFiles.PYSPY_ERROR, RankFiles.HELPERS)
DUMPS = (RankFiles.FR, RankFiles.FR_SAVED)
LINE_LOGS = (RankFiles.TOKENS, RankFiles.ROUTING)
_NODE = re.compile(r"[A-Za-z0-9._-]{1,64}")


def pack(layout: RunLayout, ranks: list[int]) -> dict[str, Any]:
    """This node's capture of ``ranks``, bounded by :data:`BUDGET`: a recorder dump keeps
    its newest entries and a posted log its newest lines (as the probe trims it) within the
    rank's share; a text past :data:`TEXT_MAX` is left out (the loader notes what it lacks)."""
    share = BUDGET // max(1, len(ranks)) - TEXT_MAX
    out: dict[str, Any] = {"version": VERSION, "ranks": {}, "files": {}}
    for r in ranks:
        files = layout.rank(r)
        got: dict[str, str] = {}
        for name in RANK_FILES:
            path = files.in_ranks(name)
            if name in DUMPS:
                text = _dump(path, share // 2)
            elif name == RankFiles.POSTED:
                text = _read(path, lambda b: tail(b, share // 2))
            elif name in LINE_LOGS:
                text = _read(path, lambda b: _last_lines(b, TEXT_MAX // 4))
            else:
                text = _read(path, _small)
            if text is not None:
                got[name] = text
        for name in STACK_FILES:
            text = _read(files.in_stacks(name), _small)
            if text is not None:
                got[f"stacks/{name}"] = text
        out["ranks"][str(r)] = got
    for path in (layout.processes, layout.source):
        if (text := _read(path, _small)) is not None:
            out["files"][path.name] = text
    if (text := _read(layout.job_log, lambda b: _last_lines(b, LOG_TAIL))) is not None:
        out["files"][layout.job_log.name] = text
    return out


def unpack(data: Any, dest: Path) -> RunLayout | None:
    """A bundle written out as a capture directory at ``dest`` (replaced: the latest round's),
    private; None when ``data`` is no bundle (nothing is written then)."""
    if not isinstance(data, dict) or data.get("version") != VERSION \
            or not isinstance(data.get("ranks"), dict) or not isinstance(data.get("files"), dict):
        return None
    layout = RunLayout(dest)
    shutil.rmtree(dest, ignore_errors=True)
    for d in (dest, layout.ranks_dir, layout.stacks_dir):
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(d, 0o700)
    names = {layout.processes.name, layout.source.name, layout.job_log.name}
    for name, text in data["files"].items():
        if name in names and isinstance(text, str):
            _write(dest / name, text)
    for key, got in data["ranks"].items():
        if not (isinstance(key, str) and key.isdigit() and isinstance(got, dict)):
            continue
        files = layout.rank(int(key))
        for name, text in got.items():
            if not isinstance(text, str):
                continue
            if name in RANK_FILES:
                _write(files.in_ranks(name), text)
            elif name.startswith("stacks/") and name[7:] in STACK_FILES:
                _write(files.in_stacks(name[7:]), text)
    return layout


def node_dir(root: Path, node: str) -> Path | None:
    """Where node ``node``'s bundle is written under ``root``; None for a name that is not
    one (a value from the channel)."""
    return root / node if _NODE.fullmatch(node) and node not in (".", "..") else None


def _read(path: Path, keep: Callable[[bytes], bytes | None]) -> str | None:
    try:
        with open(path, "rb") as f:
            raw = f.read(64 << 20)
    except OSError:
        return None
    got = keep(raw)
    return got.decode(errors="replace") if got is not None else None


def _small(data: bytes) -> bytes | None:
    return data if len(data) <= TEXT_MAX else None


def _dump(path: Path, budget: int) -> str | None:
    """A recorder dump as torch's JSON layout, its newest entries within ``budget``; a file
    that is no dump, as it is (when small), for the loader to say so there."""
    try:
        raw = load_raw(path)
    except FileNotFoundError:
        return None
    except (OSError, DumpError, ValueError):
        return _read(path, _small)  # unreadable there as here: the loader says why
    entries = raw.get("entries")
    if isinstance(entries, list):
        kept, size = [], 0
        for e in reversed(entries):
            size += len(json.dumps(e, default=str))
            if size > budget:
                break
            kept.append(e)
        raw = dict(raw, entries=kept[::-1])
    return json.dumps(raw, default=str, separators=(",", ":"))


def _last_lines(data: bytes, n: int) -> bytes:
    """The whole lines of the last ``n`` bytes."""
    if len(data) <= n:
        return data
    end = data[-n:]
    return end[end.find(b"\n") + 1:]


def _write(path: Path, text: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as f:
            f.write(text)
