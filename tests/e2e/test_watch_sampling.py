"""`moe-hang watch -- ./run.sh` where the launch script replaces PYTHONPATH (as many do:
``export PYTHONPATH=$PWD/src``): the probe's sitecustomize is dropped, so watch says so once and
watches by sampling (stacks and counters); through ``torchrun`` its shim puts the probe back.
Real torchrun, real gloo, real py-spy."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from conftest import JOBS, assert_no_survivors, by_rank, free_port, job_env, line_of, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NOTICE = "[moe-hang] the probe is not running in the ranks"


def _script(tmp: Path, job: str, *, launcher: str = "module", nproc: int = 2) -> Path:
    """run.sh: sets PYTHONPATH itself (dropping whatever was there), then starts torchrun."""
    run = [f'"{sys.executable}" -m torch.distributed.run'] if launcher == "module" \
        else ["torchrun"]
    script = tmp / "run.sh"
    script.write_text(
        "#!/bin/sh\n"
        f"export PYTHONPATH={JOBS}\n"
        f"exec {run[0]} --nproc_per_node {nproc} --master_addr 127.0.0.1 "
        f"--master_port {free_port()} {JOBS / job}\n")
    script.chmod(0o755)
    return script


def _watch(tmp: Path, script: Path, stall: str = "5", **env: str) -> tuple[int, dict, str]:
    marks = tmp / "marks"
    marks.mkdir(exist_ok=True)
    proc = run_cli("watch", "--stall", stall, "--out", str(tmp / "w"), "--json", "--",
                   str(script), timeout=240, env=job_env(JOB_MARKS=str(marks), **env))
    assert proc.stdout.strip(), proc.stderr[-3000:]
    assert_no_survivors(str(tmp / "w"))
    return proc.returncode, json.loads(proc.stdout), proc.stderr


def test_a_skip_is_diagnosed_by_sampling_when_the_script_drops_the_probe(tmp_path):
    code, d, err = _watch(tmp_path, _script(tmp_path, "skip_collective.py"))
    notices = [ln for ln in err.splitlines() if ln.startswith(NOTICE)]
    assert len(notices) == 1, err[-3000:]
    assert "replaced PYTHONPATH" in notices[0] and "watching by sampling" in notices[0]
    assert code == 3 and d["verdict"] == "desync" and d["culprit_ranks"] == [1], d["summary"]
    assert d["detected"] == "stalled" and d["certainty"] == "likely"
    r = by_rank(d)
    script = JOBS / "skip_collective.py"
    assert r[0]["callsite"]["line"] == line_of(script, "dist.all_gather_into_tensor(out, x)")
    assert r[0]["callsite"]["function"] == "dispatch"
    assert r[1]["callsite"]["line"] == line_of(script, "dist.barrier()")
    assert not list((tmp_path / "w" / "ranks").glob("*.hb.json"))  # no probe: sampled


# 8 ranks in `make test-matrix` (30 s): `make test` keeps 2, and diagnose keeps 8
@pytest.mark.parametrize("nproc", [2, pytest.param(8, marks=pytest.mark.matrix)])
def test_the_healthy_version_of_the_same_script_exits_0(tmp_path, nproc):
    """A loop of small all-reduces: in an all-reduce in every sample, moving by its counters."""
    code, d, err = _watch(tmp_path, _script(tmp_path, "chatty.py", nproc=nproc), RUN_S="20")
    assert sum(ln.startswith(NOTICE) for ln in err.splitlines()) == 1, err[-3000:]
    assert code == 0 and d["verdict"] == "healthy", d["summary"]
    assert d["job_exit_code"] == 0
    assert not any("wait" in ln and ln.startswith("[moe-hang]") for ln in err.splitlines())


def test_through_torchrun_the_shim_puts_the_probe_back(tmp_path):
    """The same script calling ``torchrun`` by name: watch's torchrun, first on PATH, puts the
    probe back on the PYTHONPATH the script set: no notice, heartbeats, the desync at once."""
    tr = Path(sys.executable).parent / "torchrun"
    if not tr.exists():
        pytest.skip("no torchrun next to this python")
    path = os.environ.get("PATH", "") + os.pathsep + str(tr.parent)  # found after the shim
    code, d, err = _watch(tmp_path, _script(tmp_path, "skip_collective.py", launcher="torchrun"),
                          PATH=path)
    assert NOTICE not in err, err[-3000:]
    assert code == 3 and d["verdict"] == "desync" and d["culprit_ranks"] == [1]
    assert d["detected"] == "desync"  # from heartbeats: the probe ran
    assert list((tmp_path / "w" / "ranks").glob("*.hb.json"))
