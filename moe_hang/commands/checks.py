"""Checks of where a command will write, made before anything is launched: a run that took
minutes must not end in "cannot write --html" (docs/DESIGN.md §4: bad input is one line and
exit 1, refused before anything starts).

Writability is tested by trying (a temporary file, removed at once): permission bits say
nothing for root, a read-only file system or a full quota.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from moe_hang.errors import MoeHangError

if TYPE_CHECKING:
    from moe_hang.evidence.ras import RasPoll


def _can_create_in(directory: Path) -> str | None:
    """None if a file can be created in ``directory``, else why not."""
    try:
        fd, name = tempfile.mkstemp(prefix=".moe-hang-check-", dir=directory)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)
    return None


def _nearest_existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_out(out: Path | None) -> None:
    """``--out DIR``: not a file, and creatable (missing parents are created, as
    :func:`moe_hang.runtime.rundir.create` does). Whether it already holds a run is checked
    where it is created."""
    if out is None:
        return
    if out.exists() and not out.is_dir():
        raise MoeHangError(f"--out {out}: exists and is not a directory")
    where = out if out.is_dir() else _nearest_existing(out)
    if not where.is_dir():
        raise MoeHangError(f"--out {out}: {where} is not a directory")
    why = _can_create_in(where)
    if why is not None:
        raise MoeHangError(f"--out {out}: {where} is not writable ({why})")


def check_html(html: Path | None, out: Path | None = None) -> None:
    """``--html FILE``: a file (not a directory) in an existing, writable directory — or
    directly in the ``--out`` directory this run is about to create."""
    if html is None:
        return
    if html.is_dir():
        raise MoeHangError(f"--html {html}: is a directory; give a file name, e.g. "
                           f"{html / 'report.html'}")
    parent = html.absolute().parent
    if out is not None and parent == out.absolute():
        return  # the run directory: created (and checked) with --out
    if not parent.exists():
        raise MoeHangError(f"--html {html}: directory {parent} does not exist")
    if not parent.is_dir():
        raise MoeHangError(f"--html {html}: {parent} is not a directory")
    if html.exists() and not os.access(html, os.W_OK):
        raise MoeHangError(f"--html {html}: exists and is not writable")
    why = _can_create_in(parent)
    if why is not None:
        raise MoeHangError(f"--html {html}: {parent} is not writable ({why})")


def check_ras(paths: list[Path] | None) -> list[RasPoll]:
    """``--ras FILE`` (repeatable): each a readable NCCL RAS report (``ncclras -f json >
    FILE``, or the text report) of one job, read now — a bad one is refused before anything
    starts. Returns the polls, [] without any."""
    if not paths:
        return []
    from moe_hang.evidence.ras import RasReportError
    from moe_hang.evidence.ras_files import read_ras_files

    try:
        return list(read_ras_files(paths))
    except RasReportError as exc:
        raise MoeHangError(f"--ras {exc}") from None
