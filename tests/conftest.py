"""Shared helpers: run the real CLI, and prove no process outlives it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
JOBS = Path(__file__).resolve().parent / "jobs"


def moe_hang_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "moe_hang.cli", *args]


def run_cli(*args: str, timeout: float = 120, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    return subprocess.run(moe_hang_argv(*args), capture_output=True, text=True, timeout=timeout,
                          cwd=cwd or ROOT, env=full_env, stdin=subprocess.DEVNULL)


def processes_mentioning(needle: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose command line mentions ``needle``."""
    found = []
    me = os.getpid()
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.pid == me or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if any(needle in part for part in (p.info["cmdline"] or [])):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def assert_no_survivors(needle: str, wait: float = 5.0) -> None:
    """Every process that mentioned ``needle`` (a run directory) is gone within ``wait``."""
    deadline = time.monotonic() + wait
    left = processes_mentioning(needle)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = processes_mentioning(needle)
    assert not left, f"processes survived: {[(p.pid, p.info['cmdline']) for p in left]}"


def load_json(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--matrix", action="store_true", default=False,
                     help="also run the full scenario matrix (make test-matrix)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--matrix"):
        return
    skip = pytest.mark.skip(reason="full matrix: run `make test-matrix`")
    for item in items:
        if "matrix" in item.keywords:
            item.add_marker(skip)
