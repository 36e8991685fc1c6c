"""`moe-hang diagnose PID` on small hung jobs it did not start (real torchrun, real py-spy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import (
    JOBS,
    ROOT,
    HungJob,
    by_rank,
    line_of,
    run_cli,
    wait_blocked,
    wait_files,
    wait_gone,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def _diagnose(pid: int, *extra: str) -> tuple[int, dict]:
    proc = run_cli("diagnose", str(pid), "--json", *extra, timeout=60)
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_skipped_collective_through_the_agent_and_through_a_rank(tmp_path):
    with HungJob("skip_collective.py", tmp=tmp_path) as job:
        job.wait_marks()
        ranks = job.rank_pids()
        wait_blocked(list(ranks.values()))
        for target in (job.popen.pid, ranks[1]):
            code, d = _diagnose(target)
            assert code == 3
            assert d["verdict"] == "desync" and d["culprit_ranks"] == [1]
            assert d["first_divergence"]["kind"] == "op_mismatch"
            r = by_rank(d)
            assert r[0]["state"] == r[1]["state"] == "in_collective"
            assert r[0]["collective"]["op"] == "all_gather"
            assert r[1]["collective"]["op"] == "barrier"
            script = JOBS / "skip_collective.py"
            assert (r[0]["callsite"]["line"], r[0]["callsite"]["function"]) == (
                line_of(script, "dist.all_gather_into_tensor(out, x)"), "dispatch")
            assert r[1]["callsite"]["line"] == line_of(script, "dist.barrier()")
            assert r[0]["callsite"]["file"].endswith("tests/e2e/jobs/skip_collective.py")
            assert {x["pid"] for x in d["ranks"]} == set(ranks.values())


def test_straggler_is_not_a_deadlock(tmp_path):
    with HungJob("straggler.py", tmp=tmp_path) as job:
        job.wait_marks()
        ranks = job.rank_pids()
        wait_blocked([ranks[0]])
        code, d = _diagnose(job.popen.pid)
        assert d["verdict"] == "straggler" and d["culprit_ranks"] == [1], d["summary"]
        assert code == 0
        r = by_rank(d)
        assert r[0]["state"] == "in_collective" and r[0]["collective"]["op"] == "all_reduce"
        assert r[1]["state"] == "computing"
        assert r[1]["callsite"]["function"] == "long_compute"
        (job.marks / "release").write_text("go")
        assert job.popen.wait(60) == 0  # it was only slow


def test_collective_missing_from_one_ranks_backward(tmp_path):
    with HungJob("backward_missing.py", tmp=tmp_path) as job:
        job.wait_marks()
        wait_blocked(list(job.rank_pids().values()))
        code, d = _diagnose(job.popen.pid)
        assert code == 3 and d["verdict"] == "desync" and d["culprit_ranks"] == [1]
        r = by_rank(d)
        assert r[0]["phase"] == "backward"
        assert r[0]["autograd_function"] == "GatherTokens"
        assert r[0]["callsite"]["function"] == "GatherTokens.backward"
        assert r[0]["collective"]["op"] == "all_reduce"
        assert "backward" in d["summary"] and "anchor" in d["fix"]


def test_desync_inside_a_subgroup_of_four_ranks(tmp_path):
    with HungJob("subgroup_desync.py", nproc=4, tmp=tmp_path) as job:
        job.wait_marks()
        wait_blocked(list(job.rank_pids().values()))
        code, d = _diagnose(job.popen.pid)
        assert code == 3 and d["verdict"] == "desync"
        r = by_rank(d)
        assert r[2]["callsite"]["function"] == "reduce_expert_grads"
        assert r[2]["collective"]["op"] == "all_reduce"
        assert all(r[k]["collective"]["op"] == "barrier" for k in (0, 1, 3))
        # from stacks alone the group is unknown: the ranks that went past rank 2's all-reduce
        assert 3 in d["culprit_ranks"] and 2 not in d["culprit_ranks"]


def test_rank_killed_mid_step_while_the_other_waits(tmp_path):
    with HungJob("killed_rank_forked.py", launcher="spawn", tmp=tmp_path) as job:
        job.wait_marks()
        # rank 1 kills itself right after its mark; rank 0 then blocks
        pids = job.rank_pids()
        wait_blocked([pids[0]])
        if 1 in pids:  # not listed once it is a zombie
            wait_gone(pids[1])
        code, d = _diagnose(pids[0])
        assert code == 3 and d["verdict"] == "rank_died" and d["culprit_ranks"] == [1]
        r = by_rank(d)
        assert r[0]["collective"]["op"] == "all_reduce" and r[1]["state"] == "exited"
        assert any("still holds its connections" in e for e in d["evidence"])


def test_users_own_recorder_dumps_name_the_sequence_number(tmp_path):
    dumps = tmp_path / "fr"
    dumps.mkdir()
    env = {"JOB_FR_DUMP_DIR": str(dumps), "TORCH_FR_BUFFER_SIZE": "1000"}
    with HungJob("skip_collective.py", tmp=tmp_path, env=env) as job:
        job.wait_marks()
        wait_files(dumps, "nccl_trace_rank_*", 2, 60, job.popen, what="the job's own dumps")
        code, d = _diagnose(job.popen.pid, "--fr-dir", str(dumps))
        assert code == 3 and d["verdict"] == "desync" and d["culprit_ranks"] == [1]
        fd = d["first_divergence"]
        # _common.warmup(): 3 steps of all_reduce + all_gather, then the one that diverges
        assert fd["pg"] == "0" and fd["seq"] == 3 * 2 + 1 and fd["kind"] == "op_mismatch"
        assert fd["per_rank"]["0"]["source"] == "flight_recorder"
        assert d["timeline"]["highlight"] == fd["seq"]


def test_out_keeps_the_captures(tmp_path):
    with HungJob("skip_collective.py", tmp=tmp_path) as job:
        job.wait_marks()
        wait_blocked(list(job.rank_pids().values()))
        out = tmp_path / "cap"
        code, _d = _diagnose(job.popen.pid, "--out", str(out))
        assert code == 3
        assert (out / "stacks" / "rank0.pyspy.json").exists()
        assert json.loads((out / "diagnosis.json").read_text())["verdict"] == "desync"
        procs = json.loads((out / "processes.json").read_text())
        for info in procs["ranks"].values():
            assert set(info.get("env", {})) <= {"RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                 "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                                 "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                                                 "GROUP_RANK"} | {
                k for k in info.get("env", {}) if k.startswith(("TORCH_", "NCCL_"))}


# ----------------------------------------------------------------------------- bad PIDs


def _error(proc: subprocess.CompletedProcess[str], needle: str) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert err.startswith("[error]") and "\n" not in err and "Traceback" not in err, err
    assert needle in err, err


def test_missing_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    _error(run_cli("diagnose", str(p.pid), timeout=30), f"no process with PID {p.pid}")


def test_pid_1():
    _error(run_cli("diagnose", "1", timeout=30), "PID 1 is the init process")


def test_its_own_pid():
    code = ("import os,sys; os.execv(sys.executable, [sys.executable, '-m', 'moe_hang.cli', "
            "'diagnose', str(os.getpid())])")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=30, env=env)
    _error(proc, "is moe-hang itself")


@pytest.mark.parametrize("argv,env,needle", [
    (["sleep", "30"], None, "is not a Python process"),
    ([sys.executable, "-c", "import time; time.sleep(30)"],
     {k: v for k, v in os.environ.items() if k != "RANK"}, "not a torch.distributed job"),
], ids=["not_python", "python_but_not_distributed"])
def test_not_a_torch_distributed_process(argv, env, needle):
    p = subprocess.Popen(argv, env=env)
    try:
        _error(run_cli("diagnose", str(p.pid), timeout=30), needle)
    finally:
        p.kill()
        p.wait()


def test_zombie():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_gone(p.pid, 10)  # exited, not reaped: a zombie
    try:
        _error(run_cli("diagnose", str(p.pid), timeout=30), "is a zombie")
    finally:
        p.wait()


def test_another_users_process_is_refused_without_root(as_nobody):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        _error(as_nobody.run("diagnose", str(p.pid)), "belongs to user root")
    finally:
        p.kill()
        p.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="drops CAP_SYS_PTRACE from root")
def test_without_ptrace_diagnose_says_so_in_one_line(tmp_path):
    with HungJob("skip_collective.py", tmp=tmp_path, env={"JOB_NONDUMPABLE": "1"}) as job:
        job.wait_marks()
        proc = subprocess.run(["setpriv", "--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace",
                               sys.executable, "-m", "moe_hang.cli", "diagnose",
                               str(job.popen.pid)], capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
        _error(proc, "no ptrace permission")
        assert "CAP_SYS_PTRACE" in proc.stderr


def test_pyspy_missing_is_one_line(tmp_path):
    with HungJob("skip_collective.py", tmp=tmp_path) as job:
        job.wait_marks()
        proc = run_cli("diagnose", str(job.popen.pid), timeout=60,
                       env={"MOE_HANG_PYSPY": str(tmp_path / "no-py-spy")})
        _error(proc, "py-spy is not installed")
        assert "pip install py-spy" in proc.stderr
