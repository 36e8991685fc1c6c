"""What `watch` does with a verdict: a definite one ends the job, an uncertain one is said in
one line and watched on; spinning blocked ranks are still blocked; a diagnosis on request."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    JOBS,
    assert_no_survivors,
    by_rank,
    job_env,
    line_of,
    moe_hang_argv,
    processes_mentioning,
    run_cli,
    torchrun_argv,
    wait_files,
)

from moe_hang.analysis.rules import diagnose
from moe_hang.evidence.load import load_capture
from moe_hang.probe.layout import RunLayout

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def _watch(tmp_path: Path, script: str, *opts: str, **env: str
           ) -> tuple[int, dict, str, float]:
    marks = tmp_path / "marks"
    marks.mkdir()
    t0 = time.monotonic()
    proc = run_cli("watch", *opts, "--out", str(tmp_path / "w"), "--json", "--",
                   *torchrun_argv(script, 2), timeout=200,
                   env=job_env(JOB_MARKS=str(marks), **env))
    took = time.monotonic() - t0
    assert proc.stdout.strip(), proc.stderr[-3000:]
    assert_no_survivors(str(JOBS / script))
    return proc.returncode, json.loads(proc.stdout), proc.stderr, took


# the mirror in `make test-matrix` (17 s; a healthy job: no culprit to swap)
@pytest.mark.parametrize("pause_rank", ["1", pytest.param("0", marks=pytest.mark.matrix)])
def test_a_slow_but_healthy_job_runs_to_completion_under_the_default_watch(tmp_path,
                                                                           pause_rank):
    """One rank pauses 12 s (longer than the default --stall of 10 s) while the other waits
    in the all-reduce: uncertain, so watch says so in one line and lets it finish. (On busy
    cores the capture may run into the rank's resuming: then it says that the ranks move or
    finish — never that the other rank is waited on.) The line's diagnosis and its capture
    are in the run directory."""
    code, d, err, _ = _watch(tmp_path, "pause_once.py", PAUSE_RANK=pause_rank)
    assert code == 0 and d["verdict"] == "healthy", (d["summary"], err[-2000:])
    notices = [ln for ln in err.splitlines() if ln.startswith("[moe-hang]")]
    other = 1 - int(pause_rank)
    said = [ln for ln in notices if "resumed after" not in ln]
    assert said and not any(f"on rank {other} at" in ln for ln in said), notices
    assert any(f"waiting 10 s on rank {pause_rank} at" in ln for ln in said) or all(
        "watched on" in ln for ln in said), notices
    assert any("resumed after" in ln for ln in notices) or any(
        "finished during the capture" in ln for ln in said), notices
    layout = RunLayout(tmp_path / "w")
    lines = [json.loads(ln) for ln in layout.watched.read_text().splitlines()]
    assert lines and all(f"[moe-hang] {x['said']}" in said for x in lines), (lines, said)
    assert diagnose(load_capture(layout.root / lines[0]["capture"])).summary \
        == lines[0]["diagnosis"]["summary"]


@pytest.mark.parametrize("receiver", ["1", "0"])
def test_ranks_that_spin_a_core_while_blocked_get_a_verdict_soon_after_the_stall(tmp_path,
                                                                                 receiver):
    """The receiver waits in recv for a tensor the sender never sends, the sender waits in the
    all-reduce; a background thread in each burns a core (a CUDA spin-wait). The spinning is
    not progress: a verdict a few seconds after --stall, not after --hang-after (300 s). (The
    two spinning threads take both of this machine's cores beside the rest of the suite: the
    bound is about what the verdict waits for, not how fast it comes — speed is the
    benchmark's.)"""
    sender = "0" if receiver == "1" else "1"
    code, d, err, _ = _watch(tmp_path, "spin_recv.py", "--stall", "3", SENDER=sender,
                             RECEIVER=receiver)
    assert code == 3 and d["certainty"] == "definite", (d["summary"], err[-2000:])
    assert d["culprit_ranks"] == [int(sender)], d["summary"]
    assert d["timings"]["onset_to_verdict_s"] <= 3 + 12
    r = by_rank(d)
    assert r[int(receiver)]["callsite"]["line"] == line_of(JOBS / "spin_recv.py",
                                                          "# never sent")


def test_an_uncertain_stall_becomes_a_hang_after_hang_after(tmp_path):
    code, d, err, took = _watch(tmp_path, "stuck_loader.py", "--stall", "2",
                                "--hang-after", "4")
    assert code == 3 and d["verdict"] == "hang" and d["culprit_ranks"] == [1], d["summary"]
    assert "--hang-after" in d["summary"]
    assert any(ln.startswith("[moe-hang] waiting 2 s on rank 1") for ln in err.splitlines())
    assert took < 60


def test_usr1_diagnoses_now_and_the_job_runs_on(tmp_path):
    """kill -USR1 <watch pid> under a straggler: a diagnosis on disk and one line, then the
    job is released and finishes; watch exits with its code."""
    marks = tmp_path / "marks"
    marks.mkdir()
    err_path = tmp_path / "watch.err"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(moe_hang_argv("watch", "--out", str(tmp_path / "w"), "--json",
                                              "--", *torchrun_argv("straggler.py", 2)),
                                stdout=subprocess.PIPE, stderr=err, text=True,
                                env=job_env(JOB_MARKS=str(marks)))
        try:
            wait_files(marks, "hang.rank*", 2, timeout=90, proc=proc)
            time.sleep(1.0)  # the probes' heartbeats have the ranks where they are now
            os.kill(proc.pid, signal.SIGUSR1)
            deadline = time.monotonic() + 60
            while "on request:" not in err_path.read_text() and time.monotonic() < deadline:
                assert proc.poll() is None, err_path.read_text()[-2000:]
                time.sleep(0.2)
            assert "on request:" in err_path.read_text()
            assert (tmp_path / "w" / "diagnosis.json").exists()
            (marks / "release").write_text("go")
            out, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    d = json.loads(out)
    assert proc.returncode == 0 and d["verdict"] == "healthy", d["summary"]
    assert_no_survivors(str(JOBS / "straggler.py"))


def test_keep_running_leaves_a_desynced_job_running_until_told(tmp_path):
    """--keep-running: a definite desync is diagnosed and said, and the job is left as it is
    (its ranks still there seconds later, stuck); Ctrl-C then ends it and everything in it,
    and the diagnosis written while the ranks were frozen stays on disk."""
    marks = tmp_path / "marks"
    marks.mkdir()
    err_path = tmp_path / "watch.err"
    script = str(JOBS / "skip_collective.py")
    with open(err_path, "w") as err:
        proc = subprocess.Popen(moe_hang_argv("watch", "--keep-running", "--stall", "3",
                                              "--out", str(tmp_path / "w"), "--json", "--",
                                              *torchrun_argv("skip_collective.py", 2)),
                                stdout=subprocess.PIPE, stderr=err, text=True,
                                env=job_env(JOB_MARKS=str(marks)))
        try:
            deadline = time.monotonic() + 90
            while ("keeps running" not in err_path.read_text()
                   and time.monotonic() < deadline):
                assert proc.poll() is None, err_path.read_text()[-2000:]
                time.sleep(0.2)
            notice = next(ln for ln in err_path.read_text().splitlines()
                          if "keeps running" in ln)
            assert notice.startswith("[moe-hang] desync:"), notice
            time.sleep(3.0)
            assert proc.poll() is None
            ranks = [p for p in processes_mentioning(script)
                     if "torchrun" not in " ".join(p.info["cmdline"] or [])]
            assert len(ranks) >= 2, "the ranks were ended despite --keep-running"
            d = json.loads((tmp_path / "w" / "diagnosis.json").read_text())
            assert d["verdict"] == "desync" and d["culprit_ranks"] == [1], d["summary"]
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert proc.returncode == 130
    assert_no_survivors(script)
