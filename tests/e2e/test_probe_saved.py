"""The probe saves the recorder every few seconds while collectives complete (what a rank gloo
aborts from a C++ thread leaves behind): a real process with the probe injected the way watch
injects it, a real gloo group, the saved file read back by the tool's own reader."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import free_port

from moe_hang.commands.watch import probe_env
from moe_hang.evidence import flight_recorder as fr
from moe_hang.probe.layout import RunLayout

JOB = textwrap.dedent("""\
    import os, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", rank=0, world_size=1)
    x = torch.ones(8)
    t0 = time.time()
    while time.time() - t0 < 7.0:
        dist.all_reduce(x)
        time.sleep(0.005)
    dist.destroy_process_group()
""")


def _run_probed(tmp_path: Path, source: str, *, torchrun_env: bool = True
                ) -> tuple[RunLayout, subprocess.CompletedProcess[str]]:
    """``source`` as one rank of a world of one, with the probe injected as watch injects it;
    ``torchrun_env``: RANK and the rest set as torchrun sets them (else none: mp.spawn)."""
    layout = RunLayout(tmp_path / "run")
    layout.ranks_dir.mkdir(parents=True)
    job = tmp_path / "job.py"
    job.write_text(source)
    env = probe_env(layout, dict(os.environ))
    env.pop("RANK", None)
    if torchrun_env:
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    run = subprocess.run([sys.executable, str(job)], env=env, timeout=90,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return layout, run


@pytest.mark.timeout(120)
def test_the_probe_saves_the_recorder_while_collectives_complete(tmp_path: Path):
    layout, _ = _run_probed(tmp_path, JOB)
    saved = layout.rank(0).fr_saved
    assert saved.exists(), sorted(p.name for p in layout.ranks_dir.iterdir())
    dump = fr.load(saved)
    assert dump.entries and all(c.op == "all_reduce" for c in dump.entries)
    assert dump.entries[-1].seq > 100  # saved after the loop had run a while


ONE_PROBE = textwrap.dedent("""\
    import sys, threading
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=0, world_size=1)
    from moe_hang.probe import probe  # the job's own install, beside watch's copy
    mine = probe.install()
    injected = sys.modules["moe_hang_probe"]._PROBE
    assert injected is not None and mine is injected, (mine, injected)
    probe.set_progress(step=7)
    print(sum(t.name == "moe-hang-probe" for t in threading.enumerate()))
    dist.destroy_process_group()
""")


@pytest.mark.timeout(120)
def test_a_job_that_installs_the_probe_under_watch_gets_the_injected_one(tmp_path: Path):
    """repro's worker installs the probe itself and runs under watch's machinery, which has
    injected it already (as another module): one probe, not two heartbeat threads and every
    router's tokens counted twice."""
    _, run = _run_probed(tmp_path, ONE_PROBE)
    assert run.stdout.split()[-1] == "1"  # one probe thread


JOB_FIRST = textwrap.dedent("""\
    import os, sys, threading
    from moe_hang.probe import probe
    mine = probe.install(os.environ["MOE_HANG_PROBE_DIR"], 0)  # before any group
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=0, world_size=1)  # watch's hook wraps this
    assert mine is not None and mine.routing is not None, "routing not started at the join"
    print(sum(t.name == "moe-hang-probe" for t in threading.enumerate()))
    dist.destroy_process_group()
""")


@pytest.mark.timeout(120)
def test_a_job_that_installs_the_probe_before_joining_gets_routing_at_the_join(
        tmp_path: Path):
    """The other order (no RANK in the environment: mp.spawn, srun): the job's own install
    comes first; watch's hook around ``init_process_group`` then starts the routers'
    counting on that probe (a review: it looked at its own copy's, None, and did nothing)."""
    _, run = _run_probed(tmp_path, JOB_FIRST, torchrun_env=False)
    assert run.stdout.split()[-1] == "1"
