"""``--help`` reads as a person types: flags look like flags, defaults are real, PID is PID,
and every command shows an example."""

from __future__ import annotations

import re

import pytest
from conftest import run_cli

pytestmark = pytest.mark.timeout(120)

COMMANDS = ("repro", "verify", "watch", "diagnose", "analyze")


def _help(*args: str) -> str:
    proc = run_cli(*args, "--help", timeout=60, env={"COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    return {c: _help(c) for c in COMMANDS}


def _row(text: str, flag: str) -> str:
    return next(line for line in text.splitlines() if re.search(rf"│ {flag}\b", line))


def test_flags_take_no_value(helps):
    for name, text in [*helps.items(), ("main", _help())]:
        assert "<bool>" not in text, name
        assert max(len(x) for x in text.splitlines()) <= 80, name
    assert "<" not in _row(helps["repro"], "--json")
    assert "<" not in _row(helps["verify"], "--fixed")
    assert "<path>" in _row(helps["repro"], "--html")  # an option with a value keeps its type


def test_defaults_are_spelled_out(helps):
    for name in ("repro", "verify", "watch"):
        assert "runs/TIMESTAMP-LABEL/" in helps[name] and "runs/-" not in helps[name], name
    assert "(default: not kept)" in helps["diagnose"]


def test_usage_lines(helps):
    assert "Usage: moe-hang diagnose [OPTIONS] PID" in helps["diagnose"]
    assert "{pid}" not in helps["diagnose"] and "{PID}" not in helps["diagnose"]
    assert "Usage: moe-hang watch [OPTIONS] -- COMMAND..." in helps["watch"]
    assert "Usage: moe-hang analyze [OPTIONS] PATH..." in helps["analyze"]
    assert "--force" in helps["analyze"]


def test_every_command_has_an_example_and_verbose(helps):
    for name, text in helps.items():
        assert re.search(r"Examples?\b", text), name
        assert re.search(rf"^\s+moe-hang {name}\b", text, re.M), name
        assert "--verbose" in text, name
