"""Run directories: private (0700), never reused silently, written atomically."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from moe_hang import __version__
from moe_hang.errors import MoeHangError
from moe_hang.probe.env import write_atomic
from moe_hang.probe.layout import RunLayout

RUNS_DIR = "runs"


def _mkdir_private(path: Path) -> None:
    path.mkdir(mode=0o700)
    os.chmod(path, 0o700)  # mkdir's mode is masked by the umask


def create(out: str | os.PathLike[str] | None, label: str) -> Path:
    """``--out DIR`` (must not hold a previous run) or ``runs/<timestamp>-<label>/``."""
    try:
        return _create(out, label)
    except PermissionError as exc:
        where = f"--out {out}" if out is not None else f"{RUNS_DIR}/"
        raise MoeHangError(f"{where}: permission denied ({exc.filename or 'a parent'} is not "
                           "accessible)") from None


def _create(out: str | os.PathLike[str] | None, label: str) -> Path:
    if out is not None:
        path = Path(out)
        if path.exists() and not path.is_dir():
            raise MoeHangError(f"--out {path}: exists and is not a directory")
        if path.is_dir():
            if RunLayout(path).meta.exists() or RunLayout(path).diagnosis.exists():
                raise MoeHangError(
                    f"--out {path}: already holds a run; choose a new directory "
                    "(nothing was overwritten)")
            if any(path.iterdir()):
                raise MoeHangError(f"--out {path}: directory is not empty; choose a new one")
            if not os.access(path, os.W_OK | os.X_OK):
                raise MoeHangError(f"--out {path}: not writable")
            os.chmod(path, 0o700)
            return path
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.exists():
            try:
                parent.mkdir(parents=True, mode=0o700)
            except OSError as exc:
                raise MoeHangError(f"--out {path}: cannot create it ({exc.strerror})") from None
        if not os.access(parent, os.W_OK | os.X_OK):
            raise MoeHangError(f"--out {path}: {parent} is not writable")
        try:
            _mkdir_private(path)
        except OSError as exc:
            raise MoeHangError(f"--out {path}: cannot create it ({exc.strerror})") from None
        return path
    root = Path(RUNS_DIR)
    try:
        root.mkdir(exist_ok=True, mode=0o700)
    except OSError as exc:
        raise MoeHangError(f"cannot create {root}/ here ({exc.strerror}); pass --out DIR") from None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        path = root / (f"{stamp}-{label}" if i == 0 else f"{stamp}-{label}-{i}")
        try:
            _mkdir_private(path)
            return path
        except FileExistsError:
            continue  # a concurrent run took this name
        except OSError as exc:
            raise MoeHangError(f"cannot create {path} ({exc.strerror}); pass --out DIR") from None
    raise MoeHangError(f"cannot find a free run directory name under {root}/")


def write_json(path: Path, data: Any) -> None:
    write_atomic(path, (json.dumps(data, indent=2, default=str) + "\n").encode())


def append_jsonl(path: Path, data: Any) -> None:
    """One JSON line more (created 0600 when new)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write(json.dumps(data, default=str) + "\n")


def versions() -> dict[str, str]:
    out = {"moe_hang": __version__, "python": platform.python_version(),
           "platform": platform.platform()}
    try:
        from importlib.metadata import version

        for pkg in ("torch", "py-spy", "typer", "rich", "psutil"):
            try:
                out[pkg] = version(pkg)
            except Exception:
                out[pkg] = "not installed"
    except ImportError:
        pass
    return out


def meta(command: list[str], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"tool": "moe-hang", "versions": versions(), "host": socket.gethostname(),
            "command": command, "started": time.time(), **(extra or {})}


# -------------------------------------------------- the capture, kept apart from the teardown

_LOG_BYTES = "job.log.bytes"  # under .capture/: job.log's length when the ranks were captured


def snapshot_capture(layout: RunLayout) -> None:
    """The ranks' files as captured, and job.log's length then (``.capture/``): ending the
    job after the verdict makes its ranks raise, dump and log into the same directory, and
    ``analyze`` of it later must read the capture the verdict came from
    (:func:`keep_capture`). FIFOs and sockets are not copied."""
    snap = layout.snapshot_dir
    shutil.rmtree(snap, ignore_errors=True)

    def not_plain(d: str, names: list[str]) -> list[str]:
        return [n for n in names if not (Path(d) / n).is_file() and not (Path(d) / n).is_dir()]

    with contextlib.suppress(OSError, shutil.Error):
        shutil.copytree(layout.ranks_dir, snap / "ranks", ignore=not_plain)
        try:
            size = layout.job_log.stat().st_size
        except OSError:
            size = 0
        (snap / _LOG_BYTES).write_text(str(size))


def keep_capture(layout: RunLayout) -> str | None:
    """After the job ended because of the verdict: ``ranks/`` and job.log back to what was
    captured, what came after in ``teardown/``; the snapshot goes. Returns why not, where
    the swap failed (the directory then holds the teardown's files too)."""
    snap = layout.snapshot_dir
    try:
        if not (snap / "ranks").is_dir():
            return None
        size = int((snap / _LOG_BYTES).read_text())
        tear = layout.teardown_dir
        tear.mkdir(mode=0o700, exist_ok=True)
        os.replace(layout.ranks_dir, tear / "ranks")
        os.replace(snap / "ranks", layout.ranks_dir)
        with open(layout.job_log, "rb+") as f:
            f.seek(size)
            rest = f.read()
            f.truncate(size)
        RunLayout(tear).job_log.write_bytes(rest)
        return None
    except (OSError, ValueError) as exc:
        return f"could not keep the capture apart from the teardown ({exc})"
    finally:
        shutil.rmtree(snap, ignore_errors=True)


WATCHED_KEPT = 8  # captures kept of a job watched on: a flapping stall must not fill the disk
WATCHED_LOG_BYTES = 16 << 20


def keep_watched(layout: RunLayout) -> Path | None:
    """The capture a watched-on line came from, apart from what the job writes next (its
    ranks move on and rewrite their files): the snapshot's ``ranks/``, ``stacks/``, what
    ``analyze`` reads beside them and job.log up to the capture, as ``watched/<n>/``. None
    past the first ``WATCHED_KEPT``, or where it could not be copied (the line still said)."""
    snap = layout.snapshot_dir
    base = layout.watched_dir
    try:
        n = len(list(base.iterdir())) + 1 if base.is_dir() else 1
        if n > WATCHED_KEPT or not (snap / "ranks").is_dir():
            return None
        if not base.is_dir():
            _mkdir_private(base)
        dest = base / str(n)
        _mkdir_private(dest)
    except (OSError, ValueError):
        return None
    try:
        shutil.copytree(snap / "ranks", dest / "ranks")
        if layout.stacks_dir.is_dir():
            shutil.copytree(layout.stacks_dir, dest / "stacks")
        for f in (layout.meta, layout.processes, layout.source, layout.config):
            if f.is_file():
                shutil.copy2(f, dest / f.name)
        size = int((snap / _LOG_BYTES).read_text())
        with open(layout.job_log, "rb") as src, open(dest / layout.job_log.name, "wb") as out:
            # the log up to the capture: its last WATCHED_LOG_BYTES (a job's log may be GBs)
            src.seek(max(0, size - WATCHED_LOG_BYTES))
            left = min(size, WATCHED_LOG_BYTES)
            while left > 0 and (chunk := src.read(min(left, 1 << 20))):
                out.write(chunk)
                left -= len(chunk)
        return dest
    except (OSError, ValueError, shutil.Error):
        shutil.rmtree(dest, ignore_errors=True)  # a half copy is not kept (nor counted)
        return None


def drop_snapshot(layout: RunLayout) -> None:
    """No verdict ended the job (it ran on, or finished): the snapshot is not needed."""
    shutil.rmtree(layout.snapshot_dir, ignore_errors=True)
