"""After the fact: a hung gloo job under plain torchrun (no moe-hang in it) writes torch's own
Flight Recorder dumps; `moe-hang analyze` of those dumps alone gives the verdict `moe-hang
watch` gives live on the same job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import JOBS, HungJob, assert_no_survivors, job_env, run_cli, torchrun_argv, wait_files

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _torch_dumps(tmp_path: Path, script: str, nproc: int) -> Path:
    """Run ``script`` under torchrun until every rank wrote its dump (tests/e2e/jobs/_common:
    JOB_FR_DUMP_DIR, torch's own ``_dump_fr_trace()`` with stacks, named nccl_trace_rank_<r>
    as torch names them), then end the job; HungJob proves no process of it survives."""
    dumps = tmp_path / "dumps"
    dumps.mkdir(parents=True)
    env = {"JOB_FR_DUMP_DIR": str(dumps), "TORCH_FR_BUFFER_SIZE": "1000"}
    with HungJob(script, nproc, tmp=tmp_path, env=env) as job:
        job.wait_marks()
        wait_files(dumps, "nccl_trace_rank_*", nproc, 90, job.popen,
                   what="the job's own Flight Recorder dumps")
    return dumps


def _watched(tmp_path: Path, script: str, nproc: int) -> dict:
    marks = tmp_path / "marks"
    marks.mkdir(parents=True)
    proc = run_cli("watch", "--stall", "2", "--out", str(tmp_path / "w"), "--json", "--",
                   *torchrun_argv(script, nproc), timeout=180,
                   env=job_env(JOB_MARKS=str(marks)))
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert_no_survivors(str(JOBS / script))
    return json.loads(proc.stdout)


def _key(d: dict) -> tuple:
    fd = d["first_divergence"] or {}
    return d["verdict"], d["culprit_ranks"], fd.get("pg"), fd.get("seq")


@pytest.mark.parametrize("script,nproc", [("skip_collective.py", 2), ("backward_missing.py", 2)])
def test_dumps_of_a_hung_job_give_the_verdict_watch_gave_live(tmp_path, script, nproc):
    dumps = _torch_dumps(tmp_path / "plain", script, nproc)
    assert not list(dumps.glob("rank*")) and not (dumps / "processes.json").exists()
    after = run_cli("analyze", str(dumps), "--json", timeout=120)
    assert after.returncode == 3, after.stderr[-2000:]
    post = json.loads(after.stdout)
    live = _watched(tmp_path / "live", script, nproc)
    assert _key(post) == _key(live), (post["summary"], live["summary"])
    assert post["verdict"] == "desync" and post["culprit_ranks"] == [1]
    fd, live_fd = post["first_divergence"], live["first_divergence"]
    assert fd["kind"] == live_fd["kind"] == "op_mismatch"
    # the recorder's own stacks name the lines the live stacks named
    for r in ("0", "1"):
        site, live_site = fd["per_rank"][r]["callsite"], live_fd["per_rank"][r]["callsite"]
        assert site["file"] == str(JOBS / script)
        assert site["line"] == live_site["line"]
        # the recorder keeps a code object's name, py-spy its qualified name
        assert live_site["function"].split(".")[-1] == site["function"]
    # and the prefix form names the same set
    again = run_cli("analyze", str(dumps / "nccl_trace_rank_"), "--json", timeout=120)
    assert again.returncode == 3 and _key(json.loads(again.stdout)) == _key(post)
