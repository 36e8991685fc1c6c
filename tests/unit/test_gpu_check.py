"""scripts/gpu_check.sh in its dry mode (no GPU here: it must say so in its one JSON file and
exit 0), and the combining of its steps' results into that file and the table."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.sh"
HELPER = ROOT / "scripts" / "gpu_check.py"


def run(args: list[str], tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, TMPDIR=str(tmp / "t"), **env)
    (tmp / "t").mkdir(exist_ok=True)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60, env=full, cwd=tmp)


@pytest.mark.timeout(90)
def test_no_gpu_is_a_dry_run_that_says_so(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"  # a machine whose nvidia-smi finds no GPU
    smi.write_text("#!/bin/sh\necho 'No devices were found' >&2\nexit 6\n")
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "res" / "check.json"
    t0 = time.monotonic()
    r = run([str(out)], tmp_path, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 < 30
    d = json.loads(out.read_text())
    assert (d["schema"], d["gpu"], d["dry"], d["reason"], d["steps"]) == \
        ("moe-hang/gpu-check/v1", False, True, "nvidia-smi lists no GPU", {})
    assert "DRY" in r.stdout and str(out) in r.stdout
    assert list((tmp_path / "t").iterdir()) == []  # its work directory is gone


@pytest.mark.timeout(90)
def test_dry_flag_and_the_default_path_under_out(tmp_path):
    r = run(["--dry"], tmp_path, OUT=str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    d = json.loads((tmp_path / "o" / "gpu_check.json").read_text())
    assert d["dry"] is True and d["reason"] == "--dry given" and d["gpu"] is False


def _combine(work: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(HELPER), "combine", str(work), str(out)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(60)
def test_combine_keeps_what_each_step_measured_and_why_one_stopped(tmp_path):
    work = tmp_path / "w"
    work.mkdir()
    results = {
        "env": (0, {"torch": "2.13.0+cu128", "gpus": 1, "names": ["NVIDIA H200"],
                    "nccl": "2.27.5", "ncclras": None}),
        "single": (0, {"steps_per_s": {"off": 50000.0, "on": 48000.0}, "timing_cost_pct": 4.0,
                       "recorder": {"on": {"states": ["completed"]}},
                       "ras": {"ok": True, "fmt": "text"}}),
        "samegpu": (1, None),
        "hang": (124, {"stopped": "its timeout", "seconds": 119.9, "ranks_up": [0, 1]}),
    }
    for step, (rc, res) in results.items():
        (work / f"{step}.rc").write_text(f"{rc}\n")
        if res is not None:
            (work / f"{step}.json").write_text(json.dumps(res))
    (work / "samegpu.err").write_text("Traceback ...\nRuntimeError: Duplicate GPU detected\n")
    out = tmp_path / "gpu_check.json"
    r = _combine(work, out)
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert d["gpu"] is True and d["dry"] is False
    s = d["steps"]
    assert s["env"]["status"] == "ok" and s["env"]["names"] == ["NVIDIA H200"]
    assert s["single"]["timing_cost_pct"] == 4.0
    assert s["samegpu"]["status"] == "exit 1" and "Duplicate GPU" in s["samegpu"]["stderr_tail"]
    assert s["hang"]["status"] == "timed out" and s["hang"]["ranks_up"] == [0, 1]
    lines = r.stdout.splitlines()
    assert len(lines) == 5
    assert "NVIDIA H200" in lines[1] and "+4.0 % cost" in lines[2] and "RAS ok text" in lines[2]
    assert "exit 1" in lines[3] and "stopped by its timeout after 119.9 s" in lines[4]


@pytest.mark.timeout(90)
def test_the_env_step_runs_here_and_writes_its_file(tmp_path):
    r = subprocess.run([sys.executable, str(HELPER), "env", str(tmp_path)], capture_output=True,
                       text=True, timeout=80)
    assert r.returncode == 0, r.stderr
    d = json.loads((tmp_path / "env.json").read_text())
    assert d["torch"].startswith("2.") and d["gpus"] == len(d["names"])
    assert d["seconds"] >= 0
