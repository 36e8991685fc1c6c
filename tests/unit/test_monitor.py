"""The stall detector against real processes whose heartbeat has gone quiet.

A rank's heartbeat comes from a thread inside it. When the rank holds the GIL for seconds (a
full garbage collection, module teardown at exit: 2-3 s for a process that imported torch's
DTensor stack, measured with py-spy in gc_collect_main) that thread is starved and the last
beat may still show a collective pending. Busy is not stuck: the watcher must read the CPU
itself. A quiet rank that burns nothing is still a stall.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from moe_hang.runtime.launcher import LaunchedJob
from moe_hang.runtime.monitor import watch
from moe_hang.runtime.watchevent import WatchSettings

pytestmark = pytest.mark.timeout(60)

BURN = "import time\nend = time.time() + {s}\nwhile time.time() < end:\n    pass\n"
IDLE = "import time\ntime.sleep({s})\n"


def _stale_heartbeat(probe_dir: Path, pid: int) -> None:
    """What a starved probe leaves behind: its last beat, mid all_reduce, never refreshed."""
    probe_dir.mkdir(parents=True, exist_ok=True)
    hb = {"rank": 0, "pid": pid, "world": "1", "local_world": "1", "beat": 7, "cpu_s": 0.1,
          "progress": {"step": 2, "steps": 2, "phase": "backward"},
          "pg_status": {"0": {"enqueued": 28, "completed": 27}},
          "pending": [{"pg_id": 0, "collective_seq_id": 28, "profiling_name": "gloo:all_reduce",
                       "input_sizes": [[2306, 64]], "time_created_ns": 1}],
          "main_frame": [["ep.py", 143, "sum_gathered_grads"]]}
    (probe_dir / "rank0.hb.json").write_text(json.dumps(hb))


def _watch(tmp_path: Path, code: str) -> str:
    log = tmp_path / "job.log"
    popen = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    job = LaunchedJob(popen=popen, log_path=log)
    try:
        _stale_heartbeat(tmp_path / "probe", popen.pid)
        out = watch(job, WatchSettings(probe_dir=tmp_path / "probe", world=1, stall_s=0.6,
                                       poll_s=0.05, refresh_s=0.2, idle_stall_s=20.0))
        return out.kind
    finally:
        job.terminate(grace=1.0)
        assert popen.poll() is not None


def test_a_busy_rank_with_a_stale_heartbeat_is_not_a_stall(tmp_path):
    # 4 stall periods of CPU work behind a heartbeat that says "waiting in all_reduce"
    assert _watch(tmp_path, BURN.format(s=2.5)) == "completed"


def test_a_quiet_rank_with_a_pending_collective_is_a_stall(tmp_path):
    assert _watch(tmp_path, IDLE.format(s=15)) == "stalled"


def test_the_probe_says_exiting_in_its_last_beat(tmp_path):
    """At shutdown the last heartbeat must not leave a collective pending behind."""
    code = ("from moe_hang.probe import probe\n"
            "probe.install()\n"
            "probe.set_progress(step=1, steps=1, phase='backward')\n")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MOE_HANG_PROBE_DIR": str(tmp_path),
           "PYTHONPATH": str(ROOT)}
    env.pop("MOE_HANG_PROBE_OWNER", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, timeout=30,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    hb = json.loads((tmp_path / "rank0.hb.json").read_text())
    assert hb["progress"]["phase"] == "exiting"
    assert hb["pending"] == [] and not hb["pg_status"]


def test_the_last_beat_carries_what_the_rank_posted(tmp_path):
    """The exit beat holds the recorder's final counts, taken before torch is torn down and
    after destroy_process_group: what the rank posted on each group, so that a rank on its
    way out can be told from one that left a peer waiting (analysis.departed)."""
    code = ("import torch, torch.distributed as dist\n"
            "from moe_hang.probe import probe\n"
            "probe.install()\n"
            "dist.init_process_group('gloo', rank=0, world_size=1,\n"
            "                        init_method='tcp://127.0.0.1:0')\n"
            "for _ in range(3):\n"
            "    dist.all_reduce(torch.ones(4))\n"
            "dist.destroy_process_group()\n")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MOE_HANG_PROBE_DIR": str(tmp_path),
           "PYTHONPATH": str(ROOT), "TORCH_FR_BUFFER_SIZE": "2000"}
    env.pop("MOE_HANG_PROBE_OWNER", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, timeout=60,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    hb = json.loads((tmp_path / "rank0.hb.json").read_text())
    assert hb["progress"]["phase"] == "exiting"
    assert hb["pg_status"]["0"]["enqueued"] == 3, hb["pg_status"]


HELPER_BUSY = ("import threading, time\n"
               "def burn():\n"
               "    end = time.time() + {s}\n"
               "    while time.time() < end:\n"
               "        pass\n"
               "threading.Thread(target=burn, daemon=True).start()\n"
               "time.sleep({s})\n")


def test_progress_sample_tells_running_orphans_from_frozen_ones(tmp_path):
    """After the agent died, ranks left behind are sampled: one still stepping (CPU) moved;
    one blocked (same heartbeat) did not, even while another of its threads works (the probe
    answering a dump request); one gone has no answer."""
    from conftest import wait_blocked

    from moe_hang.runtime.progress import ProgressSample

    busy = subprocess.Popen([sys.executable, "-c", BURN.format(s=20)], start_new_session=True)
    idle = subprocess.Popen([sys.executable, "-c", IDLE.format(s=20)], start_new_session=True)
    helper = subprocess.Popen([sys.executable, "-c", HELPER_BUSY.format(s=20)],
                              start_new_session=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    try:
        gone.wait(timeout=10)
        wait_blocked([idle.pid, helper.pid], timeout=15)  # past interpreter start-up
        _stale_heartbeat(tmp_path / "probe", idle.pid)
        sample = ProgressSample(tmp_path / "probe",
                                {0: idle.pid, 1: busy.pid, 2: gone.pid, 3: helper.pid})
        assert sample.finish(min_window_s=1.0) == {0: False, 1: True, 3: False}
    finally:
        for p in (busy, idle, helper):
            p.kill()
            p.wait(timeout=10)


LAUNCHER = ("import subprocess, sys\n"
            "a = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(0.3)'])\n"
            "b = subprocess.Popen([sys.executable, '-c', {burn!r}])\n"
            "print(a.pid, b.pid, flush=True)\n"
            "a.wait(); b.wait()\n")


@pytest.mark.parametrize("clean", [True, False])
def test_a_rank_that_finished_first_does_not_end_the_job(tmp_path, clean):
    """Rank 1 is done while rank 0 still works (a final checkpoint, an evaluation) for longer
    than torchrun's teardown window: that is a job finishing, not one tearing down. A rank that
    dies without its probe's last beat (SIGKILL, an abort) is."""
    probe = tmp_path / "probe"
    probe.mkdir()
    popen = subprocess.Popen([sys.executable, "-c", LAUNCHER.format(burn=BURN.format(s=3))],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    job = LaunchedJob(popen=popen, log_path=tmp_path / "job.log")
    try:
        assert popen.stdout is not None
        a, b = map(int, popen.stdout.readline().split())
        for rank, pid, phase in ((0, b, "forward"), (1, a, "exiting" if clean else "forward")):
            (probe / f"rank{rank}.hb.json").write_text(json.dumps(
                {"rank": rank, "pid": pid, "world": "2", "progress": {"phase": phase},
                 "pg_status": {}, "pending": []}))
        out = watch(job, WatchSettings(probe_dir=probe, world=2, stall_s=1.0, poll_s=0.05,
                                       refresh_s=0.2, teardown_wait_s=1.0, idle_stall_s=20.0))
        assert out.kind == ("completed" if clean else "failed"), out.reason
        assert 1 in out.dead_ranks
    finally:
        job.terminate(grace=1.0)


RAISE = ("from moe_hang.probe import probe\n"
         "probe.install()\n"
         "raise ValueError('corrupt shard 17')\n")


def _raising_rank(probe_dir: Path, hold: dict | None) -> subprocess.Popen[bytes]:
    probe_dir.mkdir(parents=True, exist_ok=True)
    if hold is not None:
        (probe_dir / "hold.json").write_text(json.dumps(hold))
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MOE_HANG_PROBE_DIR": str(probe_dir),
           "PYTHONPATH": str(ROOT)}
    env.pop("MOE_HANG_PROBE_OWNER", None)
    return subprocess.Popen([sys.executable, "-c", RAISE], env=env, cwd=ROOT,
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def test_a_held_rank_is_a_failure_at_once_and_released_on_request(tmp_path):
    """Multi-node watch's hold: the rank that raised stays, the monitor reports it as failed
    with its exception while it still lives, and 'release' on its FIFO lets it end."""
    popen = _raising_rank(tmp_path / "probe", {"watcher": os.getpid(), "limit_s": 30})
    job = LaunchedJob(popen=popen, log_path=tmp_path / "job.log")
    try:
        out = watch(job, WatchSettings(probe_dir=tmp_path / "probe", world=1, stall_s=5.0,
                                       poll_s=0.05, refresh_s=0.2))
        assert out.kind == "failed" and out.held == [0]
        assert out.reason == "rank 0 raised ValueError: corrupt shard 17"
        assert popen.poll() is None  # held
        fd = os.open(tmp_path / "probe" / "rank0.ctl", os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, b"release\n")
        os.close(fd)
        assert popen.wait(timeout=10) == 1
    finally:
        job.terminate(grace=1.0)


@pytest.mark.parametrize("hold", [None, "watcher_gone"])
def test_a_rank_is_held_only_while_its_watcher_asks(tmp_path, hold):
    """No hold.json (one node, --keep-running, torchrun may restart it): it ends at once; a
    watcher that is gone holds nobody."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    popen = _raising_rank(tmp_path / "probe", None if hold is None else
                          {"watcher": int(gone), "limit_s": 60})
    try:
        assert popen.wait(timeout=20) == 1
    finally:
        if popen.poll() is None:
            popen.kill()


FIFO_FIRST = ("import os, stat, sys, threading\n"
              "threading.Thread.start = lambda self: None  # the probe's thread never runs\n"
              "from moe_hang.probe import probe\n"
              "probe.install()\n"
              "ctl = os.path.join(os.environ['MOE_HANG_PROBE_DIR'], 'rank0.ctl')\n"
              "sys.exit(0 if stat.S_ISFIFO(os.stat(ctl).st_mode) else 3)\n")


def test_the_control_fifo_exists_before_install_returns(tmp_path):
    """A rank that raises right after install() is held at once (the monitor reads 'held');
    a 'release' then needs its FIFO, which must not wait on the probe thread's first turn."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1",
           "MOE_HANG_PROBE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("MOE_HANG_PROBE_OWNER", None)
    done = subprocess.run([sys.executable, "-c", FIFO_FIRST], env=env, cwd=ROOT, timeout=60,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
