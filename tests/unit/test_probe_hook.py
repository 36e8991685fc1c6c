"""watch's sitecustomize in processes with no RANK: the hook on init_process_group (real
interpreters with the injected PYTHONPATH, torch's fake process group for one-process groups)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moe_hang.commands.watch import PROBE_SITE
from moe_hang.probe.env import FR_BUFFER

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def _run(tmp_path: Path, code: str, **env: str) -> dict:
    """``code`` in a fresh interpreter under watch's environment (no RANK); it prints one JSON
    line, returned here."""
    full = {k: v for k, v in os.environ.items() if k not in ("RANK", "MOE_HANG_PROBE_OWNER")}
    full.update(PYTHONPATH=str(PROBE_SITE), MOE_HANG_PROBE_DIR=str(tmp_path / "probe"),
                OMP_NUM_THREADS="1", **env)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=90, env=full, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[moe-hang]" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_process_that_never_joins_a_group_gets_nothing_from_us(tmp_path):
    got = _run(tmp_path, """
        import json, os, sys, threading
        import torch, torch.distributed as dist
        from torch.distributed import device_mesh
        x = torch.ones(4) * 2
        print(json.dumps({
            "threads": sorted(t.name for t in threading.enumerate()),
            "probe_loaded": "moe_hang_probe" in sys.modules,
            "hooked": hasattr(dist.init_process_group, "__wrapped__"),
            "same_everywhere": dist.init_process_group is
                dist.distributed_c10d.init_process_group is device_mesh.init_process_group,
            "owner": os.environ.get("MOE_HANG_PROBE_OWNER")}))
    """)
    assert got == {"threads": ["MainThread"], "probe_loaded": False, "hooked": True,
                   "same_everywhere": True, "owner": None}
    assert not (tmp_path / "probe").exists()  # no file, no directory


def test_the_probe_starts_once_the_group_exists_with_the_groups_rank(tmp_path):
    got = _run(tmp_path, """
        import inspect, json, os, threading
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        params = list(inspect.signature(dist.init_process_group).parameters)[:3]
        before = sorted(t.name for t in threading.enumerate())
        out = dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
        after = sorted(t.name for t in threading.enumerate())
        hb = json.load(open(os.path.join(os.environ["MOE_HANG_PROBE_DIR"], "rank3.hb.json")))
        again = dist.init_process_group  # a second call raises as torch's own does
        try:
            again("fake", store=FakeStore(), rank=3, world_size=4)
            second = "no error"
        except Exception as exc:
            second = type(exc).__name__
        print(json.dumps({"params": params, "returned": repr(out), "before": before,
                          "after": after, "hb": [hb["rank"], hb["world"], hb["pid"]],
                          "pid": os.getpid(), "second": second,
                          "fr": os.environ.get("TORCH_FR_BUFFER_SIZE")}))
    """, SLURM_LOCALID="3")
    assert got["params"] == ["backend", "init_method", "timeout"]  # the signature is torch's
    assert got["returned"] == "None"
    assert got["before"] == ["MainThread"]
    assert {"moe-hang-probe", "moe-hang-sigterm"} <= set(got["after"])
    assert got["hb"] == [3, 4, got["pid"]]
    assert got["second"] != "no error"
    assert got["fr"] == FR_BUFFER  # the recorder was on before the group was made


def test_a_failed_call_raises_the_users_error_and_starts_nothing(tmp_path):
    got = _run(tmp_path, """
        import json, sys, threading
        import torch.distributed as dist
        try:
            dist.init_process_group("gloo", init_method="env://")  # no MASTER_ADDR, no RANK
            err = None
        except Exception as exc:
            err = [type(exc).__name__, str(exc)]
        print(json.dumps({"err": err, "probe": sys.modules["moe_hang_probe"]._PROBE is None}))
    """)
    assert got["err"] is not None and got["err"][0] == "ValueError"
    assert got["probe"] is True
    assert not list((tmp_path / "probe").glob("*.hb.json"))


def test_a_ranks_own_children_never_start_a_probe(tmp_path):
    got = _run(tmp_path, """
        import json, os, sys
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # a DataLoader worker, forked from the rank
            probe = sys.modules["moe_hang_probe"]
            probe._PROBE = None  # as if it had none: it must still refuse
            os.write(w, b"1" if probe.before_join() else b"0")
            os._exit(0)
        os.waitpid(pid, 0)
        print(json.dumps({"child_joined": os.read(r, 1).decode()}))
    """)
    assert got == {"child_joined": "0"}
