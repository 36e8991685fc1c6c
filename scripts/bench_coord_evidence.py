"""What ``bench_coord.py``'s simulated nodes publish: each rank's heartbeat as the probe
writes it, and its recent collectives as a node's capture summary carries them (a hang at
seq SEQ where one rank posts a barrier and the others an all-gather)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from moe_hang.runtime import coord  # noqa: E402

SEQ = 42


def heartbeats(node: int, rpn: int, world: int, culprit: int) -> dict[int, dict[str, Any]]:
    """What the probe would have written for this node's ranks (moe_hang/probe.py format)."""
    out = {}
    for r in range(node * rpn, (node + 1) * rpn):
        odd = r == culprit
        frames = [["/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py",
                   4394, "barrier" if odd else "all_gather_into_tensor"],
                  ["/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", 81,
                   "wrapper"],
                  ["/job/model/moe.py", 212 if odd else 95, "skip" if odd else "dispatch"],
                  ["/job/model/moe.py", 183, "forward"],
                  ["/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", 1775,
                   "_call_impl"],
                  ["/job/model/block.py", 40, "forward"], ["/job/train.py", 159, "step"],
                  ["/job/train.py", 185, "main"], ["/job/train.py", 189, "<module>"]]
        entry = {"pg_id": "0", "process_group": ["0", "default_pg"], "collective_seq_id": SEQ,
                 "profiling_name": "nccl:barrier" if odd else "nccl:all_gather",
                 "input_sizes": [] if odd else [[401, 2048]],
                 "output_sizes": [] if odd else [[401 * world, 2048]],
                 "input_dtypes": [] if odd else ["BFloat16"],
                 "time_created_ns": time.time_ns()}
        out[r] = {"rank": r, "pid": 10000 + r, "host": f"sim{node:04d}", "world": str(world),
                  "local_rank": str(r % rpn), "local_world": str(rpn), "time": time.time(),
                  "beat": 100, "cpu_s": 50.0, "progress": {"step": 1234, "phase": "forward"},
                  "pg_status": {"0": {"enqueued": SEQ, "completed": SEQ - 1},
                                "1": {"enqueued": 20, "completed": 20}},
                  "pending": [entry], "main_frame": frames}
    return out


def history(rank: int, culprit: int, world: int) -> tuple[list[coord.PendingCollective],
                                                         dict[str, list[int]]]:
    """A rank's recent collectives as its capture summary carries them (the recorder's last 8
    per group): healthy all-gathers up to the hang, then the one that never completes."""
    out = []
    for seq in range(SEQ - 7, SEQ + 1):
        odd = rank == culprit and seq == SEQ
        out.append(coord.PendingCollective(
            op="nccl:barrier" if odd else "nccl:all_gather", seq=seq, pg_id="0", pg="0",
            pg_desc="default_pg", input_sizes=[] if odd else [[401, 2048]],
            output_sizes=[] if odd else [[401 * world, 2048]],
            dtypes=[] if odd else ["BFloat16"], t_ns=time.time_ns() - (SEQ - seq) * 10**6,
            completed=seq < SEQ, frames=["/job/model/moe.py:212:skip" if odd
                                         else "/job/model/moe.py:95:dispatch",
                                         "/job/model/moe.py:183:forward",
                                         "/job/train.py:159:step"]))
    for seq in range(13, 21):
        out.append(coord.PendingCollective(
            op="nccl:all_reduce", seq=seq, pg_id="1", pg="1", pg_desc="expert_group",
            input_sizes=[[4096]], dtypes=["Float"], completed=True,
            frames=["/job/model/moe.py:140:reduce_grads", "/job/train.py:170:step"]))
    return out, {"0": [SEQ, SEQ - 1], "1": [20, 20]}
