"""The tool's own waits are one object, passed: ``MOE_HANG_<FIELD>`` overrides each, a bad value
is the user's one-line ``[error]`` before anything starts, and no module keeps a timing of its
own as a constant (moe_hang/settings.py; docs/DESIGN.md §12)."""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_cli

from moe_hang.errors import MoeHangError
from moe_hang.runtime.watchevent import WatchSettings
from moe_hang.settings import Settings, env_var

pytestmark = pytest.mark.timeout(120)

FIELDS = [f.name for f in dataclasses.fields(Settings)]


def test_nothing_set_is_the_defaults():
    assert Settings.from_env({}) == Settings()
    assert Settings.from_env({"MOE_HANG_DEBUG": "1", "MOE_HANG_PYSPY": "/bin/py-spy",
                              "PATH": "/usr/bin"}) == Settings()
    assert Settings().pyspy_timeout_s == 10.0 and Settings().ras_timeout_s == 5


@pytest.mark.parametrize("name", FIELDS)
def test_every_field_has_its_variable(name):
    got = Settings.from_env({env_var(name): " 7 "})
    assert getattr(got, name) == 7
    assert dataclasses.replace(got, **{name: getattr(Settings(), name)}) == Settings()


def test_the_names_read_as_the_fields():
    assert env_var("pyspy_timeout_s") == "MOE_HANG_PYSPY_TIMEOUT_S"
    got = Settings.from_env({"MOE_HANG_BEAT_STALE_S": "2.5", "MOE_HANG_HOLD_S": "600"})
    assert (got.beat_stale_s, got.hold_s) == (2.5, 600.0)


def test_the_old_pyspy_variable_still_counts_and_the_new_name_wins():
    assert Settings.from_env({"MOE_HANG_PYSPY_TIMEOUT": "20"}).pyspy_timeout_s == 20.0
    both = {"MOE_HANG_PYSPY_TIMEOUT": "20", "MOE_HANG_PYSPY_TIMEOUT_S": "3"}
    assert Settings.from_env(both).pyspy_timeout_s == 3.0


@pytest.mark.parametrize(("text", "why"), [
    ("soon", "not a number of seconds"), ("", "not a number of seconds"),
    ("0", "must be a positive number"), ("-5", "must be a positive number"),
    ("nan", "must be a positive number"), ("inf", "must be a positive number"),
])
def test_a_bad_value_names_its_variable(text, why):
    with pytest.raises(MoeHangError) as exc:
        Settings.from_env({"MOE_HANG_DUMP_TIMEOUT_S": text})
    msg = str(exc.value)
    assert msg.startswith(f"MOE_HANG_DUMP_TIMEOUT_S={text!r}: ") and why in msg
    assert "\n" not in msg
    with pytest.raises(MoeHangError, match=r"^MOE_HANG_PYSPY_TIMEOUT='x'"):
        Settings.from_env({"MOE_HANG_PYSPY_TIMEOUT": "x"})  # the alias, by its own name


def test_ras_takes_whole_seconds():
    with pytest.raises(MoeHangError, match=r"MOE_HANG_RAS_TIMEOUT_S='2\.5': not a whole number"):
        Settings.from_env({"MOE_HANG_RAS_TIMEOUT_S": "2.5"})
    with pytest.raises(MoeHangError, match="ras_timeout_s: not a whole number"):
        Settings(ras_timeout_s=2.5)  # type: ignore[arg-type]


def test_one_made_in_code_is_checked_too_and_never_changes():
    with pytest.raises(MoeHangError, match="hold_s: must be a positive number"):
        Settings(hold_s=0.0)
    s = Settings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.hold_s = 1.0  # type: ignore[misc]


def test_a_watch_carries_the_commands_settings(tmp_path):
    assert WatchSettings(probe_dir=tmp_path, world=1, stall_s=1.0).timings == Settings()
    mine = Settings(beat_stale_s=4.0)
    assert WatchSettings(probe_dir=tmp_path, world=1, stall_s=1.0,
                         timings=mine).timings.beat_stale_s == 4.0


# ----------------------------------------------------------------------------- the CLI


def test_the_cli_says_a_bad_value_in_one_line_exit_1(tmp_path):
    proc = run_cli("analyze", str(tmp_path / "missing"), timeout=60,
                   env={"MOE_HANG_FR_LOAD_TIMEOUT_S": "soon"})
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == ("[error] MOE_HANG_FR_LOAD_TIMEOUT_S='soon': not a number "
                                   "of seconds")
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_a_bad_value_stops_watch_before_the_job_starts(tmp_path):
    marker = tmp_path / "started"
    proc = run_cli("watch", "--out", str(tmp_path / "run"), "--", sys.executable, "-c",
                   f"open({str(marker)!r}, 'w').close()", timeout=60,
                   env={"MOE_HANG_PYSPY_TIMEOUT": "-1"})
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("[error] MOE_HANG_PYSPY_TIMEOUT='-1': must be a positive")
    assert not marker.exists() and not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- the rule

PKG = ROOT / "moe_hang"
# not the tool's waits: the probe's own (stdlib, configured through the environment by the
# watcher), the test harness's, and the analysis' thresholds on evidence (rates, lags)
EXEMPT = ("probe", "testing", "analysis")
# named, each with its reason: these are not timings of the tool's own
ALLOWED = {
    "moe_hang.config.DEFAULT_STALL_S",  # the CLI's --stall default, shown in --help
    "moe_hang.config.DEFAULT_PG_TIMEOUT_S",  # the scenario's --pg-timeout default
    "moe_hang.runtime.progress.CPU_MOVING_S",  # CPU seconds that count as moving: a threshold
}


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _module_scope(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements at module level, through ``if``/``try``/``with`` blocks."""
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue  # a function's locals and a class's fields are not module constants
        for block in ("body", "orelse", "finalbody"):
            out.extend(_module_scope(getattr(node, block, None) or []))
        for handler in getattr(node, "handlers", []):
            out.extend(_module_scope(handler.body))
    return out


def _timing_constants(path: Path) -> list[str]:
    """``NAME_S = ...`` (and ``NAME_S_PER_MB``) assigned at module level, whatever the value."""
    found = []
    for node in _module_scope(ast.parse(path.read_text()).body):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        for t in targets:
            name = t.id if isinstance(t, ast.Name) else ""
            if name.isupper() and (name.endswith("_S") or "_S_PER_" in name):
                found.append(name)
    return found


def test_no_module_keeps_a_timing_of_its_own():
    """A wait of the tool is a field of Settings, passed in; a module constant would be one
    no variable overrides and no caller can change."""
    bad = []
    for p in sorted(PKG.rglob("*.py")):
        if p.relative_to(PKG).parts[0] in EXEMPT:
            continue
        bad += [f"{_module(p)}.{n}" for n in _timing_constants(p)
                if f"{_module(p)}.{n}" not in ALLOWED]
    assert not bad, f"move these to moe_hang/settings.py and pass them: {bad}"


def test_the_allowed_ones_still_exist():
    """An entry that names nothing would let a new constant of that name in unseen."""
    for full in ALLOWED:
        mod, name = full.rsplit(".", 1)
        path = ROOT / (mod.replace(".", "/") + ".py")
        assert name in _timing_constants(path), full


def test_the_timing_rule_can_fail(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import os\nWAIT_S = 3.0\nif os.name:\n    LATE_S: float = 1\n"
                 "PER_S_PER_MB = 0.5\nX_S = float(os.environ.get('X', '1'))\n"
                 "def f():\n    LOCAL_S = 1\n    return LOCAL_S\nSAMPLES = 4\n")
    assert _timing_constants(p) == ["WAIT_S", "LATE_S", "PER_S_PER_MB", "X_S"]
