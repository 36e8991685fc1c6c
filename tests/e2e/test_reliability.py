"""The hang doctor never hangs, never leaks, never lies, never leaks secrets."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import (
    JOBS,
    ROOT,
    HungJob,
    assert_no_survivors,
    processes_mentioning,
    run_cli,
    start_cli,
    start_watch,
    torchrun_argv,
    wait_blocked,
    wait_marks,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def _wait_for_step(run: Path, step: int, proc: subprocess.Popen[str], timeout: float = 90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        beats = []
        for p in (run / "ranks").glob("rank*.hb.json"):
            try:
                beats.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                continue
        steps = [b.get("progress", {}).get("step") or 0 for b in beats]
        if len(steps) >= 2 and min(steps) >= step:
            return beats
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach step {step}")


def _ended_within(proc: subprocess.Popen[str], needle: str, seconds: float) -> str:
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=seconds + 10)
    deadline = t0 + seconds
    while processes_mentioning(needle) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not processes_mentioning(needle), "processes outlived the interrupt"
    assert time.monotonic() - t0 <= seconds + 1.0
    return err


# ----------------------------------------------------------------------------- interrupts


@pytest.mark.parametrize("sig,code,again_after", [
    (signal.SIGINT, 130, None),
    pytest.param(signal.SIGTERM, 143, None, marks=pytest.mark.matrix),  # make test-matrix
    # an impatient user presses Ctrl-C again while the tool tears the job down: the second
    # one must not cut the teardown short and leave ranks behind (this leaked before)
    (signal.SIGINT, 130, 0.2), (signal.SIGINT, 130, 0.6)])
def test_interrupting_verify_ends_every_process(tmp_path, sig, code, again_after):
    run = tmp_path / "run"
    proc = start_cli("verify", "--fixed", "--steps", "100000", "--out", str(run))
    _wait_for_step(run, 2, proc)
    proc.send_signal(sig)
    if again_after is not None:
        time.sleep(again_after)  # into the teardown: torchrun stopping its workers
        if proc.poll() is not None:
            pytest.skip(f"the teardown was over within {again_after} s: no second Ctrl-C")
        proc.send_signal(signal.SIGINT)
    err = _ended_within(proc, str(run), 5.0)
    assert proc.returncode == code
    assert err.strip().startswith("[error] interrupted")


def test_interrupting_watch_passes_the_signal_and_ends_the_job(tmp_path):
    proc, marks = start_watch(tmp_path, "60", "straggler.py")
    wait_marks(marks, 2, proc, 90)
    proc.send_signal(signal.SIGINT)
    _ended_within(proc, str(JOBS / "straggler.py"), 5.0)
    assert proc.returncode == 130
    log = (tmp_path / "w" / "job.log").read_text()
    assert "Received 2 death signal" in log or "SIGINT" in log or "signal 2" in log


def _fake_pyspy(tmp_path: Path, *, hang_pids: set[int] | None = None,
                sleep_all: bool = False) -> Path:
    """A py-spy stand-in that hangs (for chosen pids, or always) and otherwise runs the real one."""
    real = Path(sys.executable).parent / "py-spy"
    fake = tmp_path / "py-spy"
    fake.write_text(f"""#!{sys.executable}
import os, sys, time
pid = int(sys.argv[sys.argv.index("--pid") + 1])
if {sleep_all!r} or pid in {sorted(hang_pids or [])!r}:
    time.sleep(300)
os.execv({str(real)!r}, [{str(real)!r}] + sys.argv[1:])
""")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    return fake


def test_interrupting_diagnose_kills_its_py_spy(tmp_path):
    with HungJob("skip_collective.py", tmp=tmp_path) as job:
        job.wait_marks()
        fake = _fake_pyspy(tmp_path, sleep_all=True)
        proc = start_cli("diagnose", str(job.popen.pid), MOE_HANG_PYSPY=str(fake),
                         MOE_HANG_PYSPY_TIMEOUT="120")
        deadline = time.monotonic() + 30
        while not processes_mentioning(str(fake)):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _ended_within(proc, str(fake), 5.0)
        assert proc.returncode == 143
        assert job.popen.poll() is None  # the job it was looking at is left alone


# ----------------------------------------------------------------------------- faults


def test_py_spy_hanging_on_one_rank_does_not_stop_the_others(tmp_path):
    with HungJob("skip_collective.py", tmp=tmp_path) as job:
        job.wait_marks()
        ranks = job.rank_pids()
        wait_blocked(list(ranks.values()))
        fake = _fake_pyspy(tmp_path, hang_pids={ranks[1]})
        proc = run_cli("diagnose", str(job.popen.pid), "--json", timeout=60,
                       env={"MOE_HANG_PYSPY": str(fake), "MOE_HANG_PYSPY_TIMEOUT": "2"})
        d = json.loads(proc.stdout)
        r = {x["rank"]: x for x in d["ranks"]}
        assert r[1]["state"] == "unknown" and "did not answer within 2 s" in r[1]["note"]
        assert r[0]["state"] == "in_collective" and r[0]["collective"]["op"] == "all_gather"
        assert r[0]["callsite"]["function"] == "dispatch"
        assert not processes_mentioning(str(fake))


def test_the_reference_stops_when_its_parent_is_gone(tmp_path):
    """The single-process reference of verify --fixed computes while the job runs; if the
    command dies (even by SIGKILL: its end of the pipe closes), the reference stops at once
    instead of computing, and holding memory, for nobody."""
    from moe_hang.config import RunConfig
    from moe_hang.runtime.launcher import job_env
    from moe_hang.runtime.reference import start_reference
    from moe_hang.scenarios.registry import ENV_RUN_CONFIG, REFERENCE_BATCH, REFERENCE_BUILD

    (tmp_path / "config.json").write_text(RunConfig(steps=100000).to_json())
    args = ["--reference", REFERENCE_BUILD, "--batch", REFERENCE_BATCH, "--world", "2",
            "--steps", "100000", "--reduce", "sum",
            "--runs", json.dumps([{"run_dir": str(tmp_path), "plan": None}])]
    ref = start_reference(args, tmp_path / "reference.log",
                          {**job_env(), ENV_RUN_CONFIG: str(tmp_path / "config.json")},
                          when_told=True)
    try:
        assert ref.stdin is not None
        deadline = time.monotonic() + 60
        while "reference: " not in (tmp_path / "reference.log").read_text():
            assert time.monotonic() < deadline and ref.poll() is None
            time.sleep(0.2)  # until it computes (100000 steps: for minutes)
        ref.stdin.close()  # what the kernel does for a parent that died
        assert ref.wait(timeout=10) == 0
        assert not (tmp_path / "reference.json").exists()
    finally:
        if ref.poll() is None:
            ref.kill()
            ref.wait()


def test_rank_killed_during_verify(tmp_path):
    run = tmp_path / "run"
    proc = start_cli("verify", "--fixed", "--steps", "100000", "--out", str(run), "--json")
    beats = _wait_for_step(run, 2, proc)
    victim = next(b for b in beats if b["rank"] == 1)["pid"]
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 4, err[-2000:]
    d = json.loads(out)
    assert d["verdict"] == "rank_died" and d["culprit_ranks"] == [1]
    assert {x["rank"]: x["exit_code"] for x in d["ranks"]}[1] == -signal.SIGKILL
    assert_no_survivors(str(run))


def test_agent_killed_during_verify_leaves_no_orphans(tmp_path):
    run = tmp_path / "run"
    proc = start_cli("verify", "--fixed", "--steps", "100000", "--out", str(run), "--json")
    beats = _wait_for_step(run, 2, proc)
    ranks = [b["pid"] for b in beats]
    agent = psutil.Process(ranks[0]).parent()
    assert "torch.distributed.run" in " ".join(agent.cmdline())
    agent.kill()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 4, err[-2000:]
    d = json.loads(out)
    assert d["verdict"] == "crash" and "torchrun agent" in d["summary"]
    # the orphans kept stepping: measured, so a snapshot of them in flight is not a desync
    assert "still running" in d["summary"]
    procs = json.loads((run / "processes.json").read_text())["ranks"]
    assert [procs[str(r)]["progressed"] for r in range(2)] == [True, True]
    assert_no_survivors(str(run))
    assert not [p for p in ranks if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


# ----------------------------------------------------------------------------- secrets


SECRET = "s3cr3t-token-5f1c9e"


def _files_containing(root: Path, needle: str) -> list[Path]:
    hits = []
    for p in root.rglob("*"):
        if p.is_file() and not stat.S_ISFIFO(p.stat().st_mode) and \
                needle.encode() in p.read_bytes():
            hits.append(p)
    return hits


def test_no_secret_reaches_any_file(tmp_path):
    env = {"HF_TOKEN": SECRET, "WANDB_API_KEY": SECRET}
    repro = tmp_path / "repro"
    assert run_cli("repro", "--out", str(repro), timeout=120, env=env).returncode == 3
    watch = tmp_path / "watch"
    assert run_cli("watch", "--stall", "2", "--out", str(watch), "--",
                   *torchrun_argv("skip_collective.py", 2), timeout=120,
                   env=dict(env, OMP_NUM_THREADS="1")).returncode == 3
    with HungJob("skip_collective.py", tmp=tmp_path, env=env) as job:
        job.wait_marks()
        wait_blocked(list(job.rank_pids().values()))
        diag = tmp_path / "diag"
        assert run_cli("diagnose", str(job.popen.pid), "--out", str(diag),
                       timeout=60).returncode == 3
    for root in (repro, watch, diag):
        assert not _files_containing(root, SECRET), root
        assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_no_shell_anywhere():
    for p in (ROOT / "moe_hang").rglob("*.py"):
        text = p.read_text()
        assert "shell=True" not in text, p
        assert "os.system(" not in text, p


def test_write_atomic_never_leaves_half_a_file(tmp_path):
    from moe_hang.probe.env import write_atomic

    target = tmp_path / "diagnosis.json"
    target.write_text("old")
    with pytest.raises(TypeError):  # fails after the temporary file was opened
        write_atomic(target, object())  # type: ignore[arg-type]
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["diagnosis.json"]
    write_atomic(target, b"new")
    assert target.read_text() == "new" and len(list(tmp_path.iterdir())) == 1


def test_unwritable_out_is_refused(as_nobody):
    locked = as_nobody.sandbox / "locked"  # nobody may enter it, not write in it
    locked.mkdir(mode=0o755)
    proc = as_nobody.run("repro", "--out", str(locked / "run"))
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("[error] --out") and "not writable" in err, err
    assert "\n" not in err
    assert not (locked / "run").exists()
