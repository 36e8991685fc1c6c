"""A node's capture as it travels to the node that analyses (multi-node watch): the run
directory's own files — each rank's probe files and py-spy stacks, ``processes.json``,
``source.json``, the end of ``job.log`` — as text in one JSON object, bounded (:func:`pack`);
written back there as a capture directory of its own (:func:`unpack`, ``coord/nodes/<node>/``)
and read with the same loader as that node's own capture.

One format for a rank wherever it ran: a remote rank is the same evidence as a local one
(the summaries this replaces carried what someone had thought of, and each fix of a wrong
two-node verdict was "the summary did not carry X"), and the run directory keeps what the
verdict came from. A value from another node is input, not trusted: only the files named
here are written, under names built here, for ranks of the job, never through a link.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe_hang.evidence.flight_recorder import DumpError, load_raw
from moe_hang.evidence.posted_log import tail
from moe_hang.evidence.torchrun_log import read_job_log
from moe_hang.probe.layout import RankFiles, RunLayout

VERSION = 1
# the text of one node's capture (the channel decodes up to 64 MiB; the text inside JSON
# strings grows by its escapes, about a tenth)
BUDGET = 32 << 20
SHARE_MIN = 256 << 10  # each rank's share, however many ranks the node runs
TEXT_MAX = 1 << 20  # a stack, an exception record, a process table: past this, left out
LOG_TAIL = 1 << 20  # the job log's end: torchrun's failure report, the aborts, tracebacks
MAX_ENTRIES = 1024  # of a recorder dump, the newest (the probe's ring keeps 256 by default)
MAX_RANKS = 4096  # of one node
# what the loader reads of a rank (evidence/load.py), by the name's part after "rank{R}.";
# the small ones first: each rank's share goes to them, then to its dump and its posted log
SMALL = (RankFiles.HEARTBEAT, RankFiles.ERROR, RankFiles.THREAD_ERRORS, RankFiles.GROUPS,
         RankFiles.DUMP_MARKER, RankFiles.FATAL, RankFiles.STACK)
STACK_FILES = (RankFiles.PYSPY, RankFiles.PYSPY_ERROR, RankFiles.HELPERS)
LINE_LOGS = (RankFiles.TOKENS, RankFiles.ROUTING)
RANK_FILES = (*SMALL, RankFiles.FR, RankFiles.FR_SAVED, RankFiles.POSTED, *LINE_LOGS)
_NODE_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def pack(layout: RunLayout, ranks: list[int]) -> dict[str, Any]:
    """This node's capture of ``ranks``, within :data:`BUDGET`: each rank's share goes to its
    small files first, then half of what is left to its recorder dump (the newest entries)
    and the rest to its posted log (the newest lines, as the probe trims it). A file that
    does not fit is left out and named in ``left_out`` (the analysing node says so)."""
    share = max(SHARE_MIN, (BUDGET - 2 * TEXT_MAX - LOG_TAIL) // max(1, len(ranks)))
    out: dict[str, Any] = {"version": VERSION, "ranks": {}, "files": {}, "left_out": {}}
    for r in ranks[:MAX_RANKS]:
        got, left = _pack_rank(layout.rank(r), share)
        out["ranks"][str(r)] = got
        if left:
            out["left_out"][str(r)] = left
    for path in (layout.processes, layout.source):
        if (text := _read(path, _small)) is not None:
            out["files"][path.name] = text
    log = read_job_log(layout.job_log, LOG_TAIL)  # its end, however long the job ran
    with contextlib.suppress(OSError):
        if layout.job_log.stat().st_size > LOG_TAIL:  # cut inside a line: from the next
            log = log[log.find("\n") + 1:]
    if log:
        out["files"][layout.job_log.name] = log
    return out


def _pack_rank(files: RankFiles, share: int) -> tuple[dict[str, str], list[str]]:
    got: dict[str, str] = {}
    left: list[str] = []

    def put(name: str, text: str | None, exists: bool) -> None:
        nonlocal share
        if text is not None and len(text) <= share:
            got[name] = text
            share -= len(text)
        elif exists:
            left.append(name)

    for name in SMALL:
        path = files.in_ranks(name)
        put(name, _read(path, _small), path.exists())
    for name in STACK_FILES:
        path = files.in_stacks(name)
        put(f"stacks/{name}", _read(path, _small), path.exists())
    for name in LINE_LOGS:
        path = files.in_ranks(name)
        put(name, _read(path, lambda b: _last_lines(b, min(TEXT_MAX // 4, share // 8))),
            path.exists())
    # the loader reads the probe's saved recorder only where there is no dump at capture
    dump = files.fr if files.fr.exists() else files.fr_saved
    put(dump.name.removeprefix(f"rank{files.rank}."), _dump(dump, share // 2), dump.exists())
    # (the records a cut log keeps ahead of its newest lines are not in tail's count)
    put(RankFiles.POSTED, _read(files.posted, lambda b: tail(b, share * 7 // 8)),
        files.posted.exists())
    return got, left


def unpack(data: Any, dest: Path, world: int | None = None) -> RunLayout | None:
    """A bundle written out as a capture directory at ``dest`` (replaced: the latest round's),
    private, never through a link; only ranks of the job (below ``world``, where known).
    None when ``data`` is no bundle, or ``dest`` cannot be made safely (nothing written)."""
    if not isinstance(data, dict) or data.get("version") != VERSION \
            or not isinstance(data.get("ranks"), dict) or not isinstance(data.get("files"), dict):
        return None
    if not _private_dir(dest.parent) or dest.is_symlink():
        return None
    shutil.rmtree(dest, ignore_errors=True)
    layout = RunLayout(dest)
    try:
        for d in (dest, layout.ranks_dir, layout.stacks_dir):
            d.mkdir(mode=0o700)
    except OSError:
        return None
    names = {layout.processes.name, layout.source.name, layout.job_log.name}
    for name, text in data["files"].items():
        if name in names and isinstance(text, str):
            _write(dest / name, text)
    for key, got in list(data["ranks"].items())[:MAX_RANKS]:
        r = _rank(key, world)
        if r is None or not isinstance(got, dict):
            continue
        files = layout.rank(r)
        for name, text in got.items():
            if not isinstance(text, str):
                continue
            if name in RANK_FILES:
                _write(files.in_ranks(name), text)
            elif name.startswith("stacks/") and name[7:] in STACK_FILES:
                _write(files.in_stacks(name[7:]), text)
    return layout


def left_out(data: Any) -> dict[int, list[str]]:
    """What a bundle says it left out of each rank (its files past the node's budget)."""
    raw = data.get("left_out") if isinstance(data, dict) else None
    out: dict[int, list[str]] = {}
    for key, names in (raw.items() if isinstance(raw, dict) else ()):
        if (r := _rank(key, None)) is not None and isinstance(names, list):
            out[r] = [str(n)[:40] for n in names[:32]]
    return out


def node_dir(root: Path, node: str) -> Path | None:
    """Where node ``node``'s bundle is written under ``root``; None for a name that is not
    one (a value from the channel)."""
    ok = 0 < len(node) <= 64 and set(node) <= _NODE_CHARS and node not in (".", "..")
    return root / node if ok else None


def _rank(key: Any, world: int | None) -> int | None:
    if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 7):
        return None
    r = int(key)
    return r if world is None or r < world else None


def _private_dir(path: Path) -> bool:
    """``path`` is (made) a directory of ours, mode 0700, and not a link."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        if path.is_symlink() or not path.is_dir():
            return False
        os.chmod(path, 0o700)
    except OSError:
        return False
    return True


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
    """A recorder dump as torch's JSON layout, its newest entries (at most
    :data:`MAX_ENTRIES`) within ``budget``; a file that is no dump, as it is (when small), for
    the loader to say so there."""
    try:
        raw = load_raw(path)
    except FileNotFoundError:
        return None
    except (OSError, DumpError, ValueError):
        return _read(path, _small)  # unreadable there as here: the loader says why
    entries = raw.get("entries")
    if not isinstance(entries, list):
        entries = []
    rest = json.dumps(dict(raw, entries=[]), default=str, separators=(",", ":"))
    kept: list[Any] = []
    size = len(rest)
    for e in reversed(entries[-MAX_ENTRIES:]):
        size += len(json.dumps(e, default=str, separators=(",", ":"))) + 1
        if size > budget:
            break
        kept.append(e)
    return json.dumps(dict(raw, entries=kept[::-1]), default=str, separators=(",", ":"))


def _last_lines(data: bytes, n: int) -> bytes:
    """The whole lines of the last ``n`` bytes."""
    if len(data) <= n:
        return data
    end = data[-n:] if n > 0 else b""
    return end[end.find(b"\n") + 1:]


def _write(path: Path, text: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as f:
            f.write(text)
