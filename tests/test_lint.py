"""The code stays ruff- and mypy-clean (the dev tools come with `make setup`)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    exe = BIN / name
    if exe.exists():
        return str(exe)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed")
    return found


@pytest.mark.timeout(300)
def test_ruff_clean():
    proc = subprocess.run([_tool("ruff"), "check", "moe_hang", "tests", "scripts"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(300)
def test_mypy_clean():
    proc = subprocess.run([_tool("mypy")], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
