"""A rank's work includes its helpers (issue 28): a rank whose main thread waits outside any
collective while its own child processes (a DataLoader worker decoding a batch, inductor's
compile workers) keep cores busy is working, not stuck."""

from __future__ import annotations

import pytest

from moe_hang.runtime.procs import helpers_cores


def test_helpers_cores_counts_each_helper_from_its_own_start():
    before = {10: (100.0, 5.0), 11: (100.0, 2.0), 12: (100.0, 9.0)}
    # 10 used 1 s; 11 ended (not counted); 12's pid now names a newer process (0.5 s since
    # it started); 13 started in the window (0.5 s)
    after = {10: (100.0, 6.0), 12: (150.0, 0.5), 13: (160.0, 0.5)}
    assert helpers_cores(before, after, 2.0) == pytest.approx(1.0)
    assert helpers_cores({}, {}, 2.0) == 0.0


def _worker(pid: int, job: str, line: int, busy: bool) -> dict:
    """py-spy's JSON of a DataLoader worker at the job's ``__getitem__``."""
    worker = "/x/site-packages/torch/utils/data/_utils/worker.py"
    return {"pid": pid, "name": "python3", "stack": [{
        "thread_name": "MainThread", "thread_id": 1, "pid": pid, "os_thread_id": pid,
        "active": busy, "frames": [
            {"filename": "/usr/lib/python3.11/threading.py", "name": "acquire", "line": 1},
            {"filename": job, "name": "Shards.__getitem__", "line": line},
            {"filename": worker, "name": "_worker_loop", "line": 300}]}]}


@pytest.mark.parametrize("stuck", [0, 1])
def test_a_rank_waiting_on_its_stuck_worker_is_named_with_the_workers_line(tmp_path, stuck):
    """The capture's helpers.json is read back, and the hang names the worker's line."""
    import json

    from conftest import captured

    from moe_hang.analysis.rules import diagnose
    from moe_hang.evidence.model import Evidence, RankEvidence
    from moe_hang.evidence.stacks import Frame, ThreadStack
    from moe_hang.evidence.vocab import JobState
    from moe_hang.probe.layout import RunLayout

    job = str(tmp_path / "train.py")
    (tmp_path / "train.py").write_text("\n" * 50)
    torch_c10d = "/x/site-packages/torch/distributed/distributed_c10d.py"
    queue = "/usr/lib/python3.11/multiprocessing/connection.py"
    out = RunLayout(tmp_path / "run")
    out.stacks_dir.mkdir(parents=True)
    out.rank(stuck).helpers.write_text(json.dumps([_worker(4321, job, 34, busy=False)]))
    from moe_hang.evidence.load import _load_helpers

    # its main thread waits on the loader's queue (multiprocessing's poll), off CPU
    waiting = RankEvidence(rank=stuck, alive=True, progressed=False, threads=[ThreadStack(
        "MainThread", [Frame(queue, 10, "poll"), Frame(job, 42, "<module>")], active=False,
        is_main=True)])
    _load_helpers(waiting, out.rank(stuck))
    assert [(h.pid, h.kind) for h in waiting.helpers] == [(4321, "DataLoader worker")]
    other = RankEvidence(rank=1 - stuck, alive=True, progressed=False, threads=[ThreadStack(
        "MainThread", [Frame(torch_c10d, 9, "all_reduce"), Frame(job, 45, "<module>")],
        is_main=True)])
    ev = Evidence(ranks={stuck: waiting, 1 - stuck: other}, world_size=2,
                  job=JobState.STALLED)
    d = diagnose(captured(ev))
    assert (d.verdict, d.culprit_ranks) == ("hang", [stuck]), d.summary
    assert "DataLoader worker (pid 4321), itself stuck at" in d.summary
    assert "train.py:34" in d.summary and "train.py:34" in d.fix
