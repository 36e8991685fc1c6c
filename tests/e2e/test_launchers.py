"""Jobs launched without torchrun — torch.multiprocessing.spawn (PyTorch's DDP tutorial), N
direct ``python train.py`` processes with srun's or mpirun's variables (tests/e2e/jobs/
launch_like.py), ``accelerate launch`` where it is installed — under ``watch`` and under
``diagnose``: the same verdicts as under torchrun, the right rank in each, mirrored (the
culprit swaps with the roles), and no process left behind. Real gloo groups, real py-spy."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import (
    JOBS,
    ROOT,
    by_rank,
    free_port,
    job_env,
    line_of,
    processes_with_env,
    run_cli,
    start_cli,
    wait_blocked,
    wait_files,
    wait_marks,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

SCRIPT = JOBS / "any_launcher.py"
try:
    import accelerate  # noqa: F401
    HAS_ACCELERATE = True
except ImportError:  # an optional extra: pip install -e '.[launchers]'
    HAS_ACCELERATE = False
LAUNCHES = ("spawn", "slurm", "ompi", pytest.param("accelerate", marks=pytest.mark.skipif(
    not HAS_ACCELERATE, reason="accelerate launch: pip install -e '.[launchers]'")))


def _argv(launch: str, nproc: int = 2) -> list[str]:
    if launch in ("spawn", "spawn-anonymous"):
        return [sys.executable, str(SCRIPT), launch, str(nproc)]
    if launch == "accelerate":  # its multi-process launcher (torchrun inside it), on CPU
        return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                "--num_processes", str(nproc), "--num_machines", "1", "--mixed_precision",
                "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
                str(SCRIPT), "accelerate"]
    return [sys.executable, str(JOBS / "launch_like.py"), launch, str(nproc), str(free_port()),
            str(SCRIPT), "env"]


def _env(marks: Path, **extra: str) -> dict[str, str]:
    env = job_env(JOB_MARKS=str(marks), MASTER_PORT=str(free_port()), **extra)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        env.pop(k, None)
    return env


def _pids(marks: Path) -> dict[int, int]:
    """rank -> pid, as each rank wrote it once in its group (it knows its own rank)."""
    return {int(p.name.rsplit("rank", 1)[1]): int(p.read_text()) for p in marks.glob("pid.*")}


def _no_survivors(marks: Path, wait: float = 10.0) -> None:
    """No process of the job (they all carry JOB_MARKS) is left, zombies aside."""
    import time

    deadline = time.monotonic() + wait
    while processes_with_env("JOB_MARKS", str(marks)) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = processes_with_env("JOB_MARKS", str(marks))
    assert not left, f"left behind: {[(p.pid, p.cmdline()) for p in left]}"


def _culprit_site(d: dict, early: int) -> None:
    """The culprit returned early and waits in the end-of-epoch barrier; the other rank in the
    step's all_reduce. The ranks' pids are the ones the ranks themselves wrote."""
    assert d["verdict"] == "desync" and d["culprit_ranks"] == [early], d["summary"]
    r = by_rank(d)
    other = 1 - early
    assert r[early]["collective"]["op"] == "barrier"
    assert r[early]["callsite"]["line"] == line_of(SCRIPT, "dist.barrier()")
    assert r[other]["collective"]["op"] == "all_reduce"
    assert r[other]["callsite"]["function"] == "train_epoch"


# ----------------------------------------------------------------------------- watch


def _watch(tmp_path: Path, launch: str, **env: str) -> tuple[int, dict, Path]:
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = run_cli("watch", "--stall", "3", "--out", str(tmp_path / "w"), "--json", "--",
                   *_argv(launch), timeout=180, cwd=JOBS, env=_env(marks, **env))
    assert proc.stdout.strip(), proc.stderr[-3000:]
    _no_survivors(marks)
    return proc.returncode, json.loads(proc.stdout), marks


@pytest.mark.parametrize("early", [1, 0], ids=["rank1_early", "mirrored"])
@pytest.mark.parametrize("launch", LAUNCHES)
def test_watch_names_the_rank_that_left_the_epoch_early(tmp_path, launch, early):
    code, d, marks = _watch(tmp_path, launch, JOB_EARLY_RANK=str(early))
    assert code == 3
    _culprit_site(d, early)
    assert d["detected"] == "desync"  # from the heartbeats, as under torchrun
    assert {r["rank"]: r["pid"] for r in d["ranks"]} == _pids(marks)
    assert d["first_divergence"]["pg"] == "0" and d["first_divergence"]["seq"] is not None


@pytest.mark.parametrize("launch", LAUNCHES)
def test_watch_lets_a_healthy_job_finish(tmp_path, launch):
    code, d, marks = _watch(tmp_path, launch)
    assert code == 0 and d["verdict"] == "healthy", d["summary"]
    assert sorted(r["rank"] for r in d["ranks"]) == [0, 1]
    assert {r["rank"]: r["pid"] for r in d["ranks"]} == _pids(marks)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
@pytest.mark.parametrize("launch", ["spawn", "slurm"])
def test_interrupting_watch_leaves_nothing_behind(tmp_path, launch, sig):
    """Ranks stuck in a collective (kept running after the verdict): a SIGINT cannot reach
    them there and mp.spawn's parent then waits for them for ever; launch_like's tasks are
    in process groups of their own. watch still ends every one, with 128 + the signal."""
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_hang.cli", "watch", "--keep-running", "--out",
         str(tmp_path / "w"), "--", *_argv(launch)], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, cwd=JOBS,
        env=_env(marks, JOB_EARLY_RANK="1", PYTHONPATH=str(ROOT)))
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "the job keeps running" in line:
                break
        assert any("keeps running" in x for x in seen), "".join(seen)[-2000:]
        pids = _pids(marks)
        assert all(psutil.pid_exists(p) for p in pids.values())
        proc.send_signal(sig)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig
    _no_survivors(marks, wait=2.0)


# ----------------------------------------------------------------------------- diagnose


class _Job:
    """A job started in its own session, as a user would in another terminal; every process
    of it is killed on exit (they all carry JOB_MARKS)."""

    def __init__(self, tmp_path: Path, launch: str, **env: str):
        self.marks = tmp_path / "marks"
        self.marks.mkdir()
        self.log = open(tmp_path / "job.log", "wb")  # noqa: SIM115 - closed in __exit__
        self.popen = subprocess.Popen(_argv(launch), cwd=JOBS, env=_env(self.marks, **env),
                                      stdout=self.log, stderr=subprocess.STDOUT,
                                      start_new_session=True)

    def ranks(self, mark: str = "hang") -> dict[int, int]:
        try:
            wait_marks(self.marks, 2, self.popen, 90, name=mark)
            wait_files(self.marks, "pid.rank*", 2, 30, self.popen)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {Path(self.log.name).read_text()[-2000:]}") from None
        return _pids(self.marks)

    def __enter__(self) -> _Job:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in processes_with_env("JOB_MARKS", str(self.marks)):
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(OSError):
            self.popen.kill()
        self.popen.wait(10)
        self.log.close()
        _no_survivors(self.marks)


def _diagnose(pid: int | None) -> tuple[int, dict]:
    proc = run_cli("diagnose", *([str(pid)] if pid else []), "--json", timeout=60)
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.parametrize("early", [1, 0], ids=["rank1_early", "mirrored"])
@pytest.mark.parametrize("launch", LAUNCHES)
def test_diagnose_from_the_launcher_or_a_rank(tmp_path, launch, early):
    with _Job(tmp_path, launch, JOB_EARLY_RANK=str(early)) as job:
        pids = job.ranks()
        wait_blocked(list(pids.values()))
        for target in (job.popen.pid, pids[1 - early]):
            code, d = _diagnose(target)
            assert code == 3, d["summary"]
            _culprit_site(d, early)
            assert {r["rank"]: r["pid"] for r in d["ranks"]} == pids
            assert d["agent_pid"] == job.popen.pid  # the launcher it found


@pytest.mark.parametrize("launch", LAUNCHES)
def test_diagnose_a_healthy_job_says_so_and_finds_it_without_a_pid(tmp_path, launch,
                                                                   monkeypatch):
    from moe_hang.runtime.discover import find_jobs

    with _Job(tmp_path, launch, JOB_STEADY="1") as job:
        pids = job.ranks("steady")
        code, d = _diagnose(job.popen.pid)
        assert code == 0 and d["verdict"] == "healthy", d["summary"]
        assert {r["rank"]: r["pid"] for r in d["ranks"]} == pids
        # no PID: the job is found by its ranks' process-group threads (other engineers'
        # jobs on this host are left out of the comparison)
        mine = [j for j in find_jobs() if j.pid == job.popen.pid]
        assert len(mine) == 1 and mine[0].launcher == job.popen.pid, mine
        if launch == "spawn":  # listing the host reads no frames: two ranks, numbers unknown
            assert sorted(mine[0].ranks) == sorted(-p for p in pids.values())
            assert "2 unidentified ranks" in mine[0].describe()
        else:  # the launcher's variables name them
            assert mine[0].ranks == [0, 1] and mine[0].world_size == 2
        (job.marks / "release").write_text("go")
        assert job.popen.wait(60) == 0


def test_a_rank_nothing_names_is_named_by_its_pid(tmp_path):
    """mp.spawn whose target keeps no local called rank, no probe, no launcher variable: the
    tool cannot learn which rank each process is, and says so instead of guessing."""
    with _Job(tmp_path, "spawn-anonymous", JOB_EARLY_RANK="1") as job:
        pids = job.ranks()
        wait_blocked(list(pids.values()))
        proc = run_cli("diagnose", str(job.popen.pid), timeout=60)
        code, d = _diagnose(job.popen.pid)
    assert code == 3 and d["verdict"] == "desync"
    assert d["culprit_ranks"] == [] and d["culprit_pids"] == [pids[1]]
    assert all(r["rank"] is None and r["unidentified"] for r in d["ranks"])
    assert {r["pid"] for r in d["ranks"]} == set(pids.values())
    assert f"PID {pids[1]} (unidentified rank)" in d["summary"]
    screen = proc.stdout
    assert f"culprit: PID {pids[1]} (unidentified rank)" in screen, screen
    assert "rank 0" not in screen and "rank 1" not in screen and "-" + str(pids[1]) not in screen


def test_diagnose_says_not_distributed_only_of_a_process_outside_every_group(tmp_path):
    """A rank of a spawn job, given directly: never "not a torch.distributed job"; a plain
    Python process beside it still is one."""
    with _Job(tmp_path, "spawn", JOB_STEADY="1") as job:
        pids = job.ranks("steady")
        code, d = _diagnose(pids[0])
        assert code == 0 and d["verdict"] == "healthy"
        plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                                 env={k: v for k, v in os.environ.items() if k != "RANK"})
        try:
            err = run_cli("diagnose", str(plain.pid), timeout=30)
        finally:
            plain.kill()
            plain.wait()
        assert err.returncode == 1 and "not a torch.distributed job" in err.stderr
        (job.marks / "release").write_text("go")


# ----------------------------------------------------------------------------- under watch


def test_watch_and_diagnose_agree_on_a_spawn_job_under_watch(tmp_path):
    """diagnose on a job that runs under watch names each rank as its probe does."""
    marks = tmp_path / "marks"
    marks.mkdir()
    watch = start_cli("watch", "--keep-running", "--out", str(tmp_path / "w"), "--",
                      *_argv("spawn-anonymous"), JOB_MARKS=str(marks),
                      MASTER_PORT=str(free_port()), JOB_EARLY_RANK="0")
    try:
        wait_files(marks, "pid.rank*", 2, 90, watch)
        wait_files(tmp_path / "w" / "ranks", "rank*.hb.json", 2, 30, watch)
        pids = _pids(marks)
        wait_blocked(list(pids.values()))
        code, d = _diagnose(pids[1])
        assert code == 3
        _culprit_site(d, 0)
        assert {r["rank"]: r["pid"] for r in d["ranks"]} == pids  # from the probe: exact
    finally:
        watch.send_signal(signal.SIGTERM)
        watch.communicate(timeout=60)
    _no_survivors(marks)
