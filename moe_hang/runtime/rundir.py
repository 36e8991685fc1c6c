"""Run directories: private (0700), never reused silently, written atomically."""

from __future__ import annotations

import json
import os
import platform
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
