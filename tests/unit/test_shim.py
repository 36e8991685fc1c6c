"""watch's torchrun shim (runtime/shim.py): it puts the probe back in front of a PYTHONPATH a
launch script replaced, once, and runs the next torchrun on PATH with the same arguments."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from moe_hang.runtime import shim

pytestmark = pytest.mark.timeout(30)


def _fake_torchrun(d: Path) -> Path:
    d.mkdir()
    t = d / "torchrun"
    t.write_text('#!/bin/sh\necho "PYTHONPATH=$PYTHONPATH"\necho "ARGS=$*"\n')
    t.chmod(0o755)
    return d


def _run(tmp: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["torchrun", *args], capture_output=True, text=True, env=env,
                          timeout=20, cwd=tmp)


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    real = _fake_torchrun(tmp / "real")
    base = {"PATH": f"{real}{os.pathsep}/usr/bin{os.pathsep}/bin",
            "MOE_HANG_PROBE_DIR": str(tmp / "ranks"), **extra}
    return shim.env_for(shim.install(tmp / "bin"), tmp / "site", base)


def test_a_replaced_pythonpath_gets_the_probe_back_in_front(tmp_path):
    env = _env(tmp_path)
    env["PYTHONPATH"] = "/job/src"  # what the launch script did
    out = _run(tmp_path, env, "--nproc_per_node", "2", "train.py", "a b")
    assert out.returncode == 0, out.stderr
    assert f"PYTHONPATH={tmp_path / 'site'}:/job/src" in out.stdout
    assert "ARGS=--nproc_per_node 2 train.py a b" in out.stdout


def test_once_only_and_not_without_watch(tmp_path):
    env = _env(tmp_path)
    env["PYTHONPATH"] = f"/x:{tmp_path / 'site'}"
    assert f"PYTHONPATH=/x:{tmp_path / 'site'}\n" in _run(tmp_path, env).stdout
    del env["MOE_HANG_PROBE_DIR"]  # env -i and the like: nothing of watch's is left to restore
    env["PYTHONPATH"] = "/job/src"
    assert "PYTHONPATH=/job/src\n" in _run(tmp_path, env).stdout


def test_no_other_torchrun_is_an_error_not_a_loop(tmp_path):
    env = _env(tmp_path)
    env["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}{tmp_path / 'bin'}/{os.pathsep}/bin"
    out = _run(tmp_path, env)
    assert out.returncode == 127 and "no torchrun on PATH" in out.stderr
    assert (tmp_path / "bin" / "torchrun").stat().st_mode & 0o777 == 0o700
