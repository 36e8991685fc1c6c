"""What ``bench_coord.py``'s simulated nodes publish: each rank's heartbeat as the probe
writes it, and its recent collectives as a node's capture carries them (a hang at seq SEQ
where one rank posts a barrier and the others an all-gather)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


SEQ = 4000  # the world group's hung collective (entries before it go back from here)
EXPERT_SEQ = 2000  # the expert group's last, completed


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
                                "1": {"enqueued": EXPERT_SEQ, "completed": EXPERT_SEQ}},
                  "pending": [entry], "main_frame": frames}
    return out


def capture(node: int, rpn: int, world: int, culprit: int, n_entries: int = 16
            ) -> dict[str, Any]:
    """This node's capture as it travels (moe_hang/capture/bundle.py): each rank's heartbeat
    and its recorder dump in torch's JSON layout (its last ``entries`` collectives, half on
    each group): healthy all-gathers up to the hang, then the one that never completes on the
    world group."""
    half = max(1, n_entries // 2)
    hbs = heartbeats(node, rpn, world, culprit)
    ranks: dict[str, dict[str, str]] = {}
    for r, hb in hbs.items():
        entries: list[dict[str, Any]] = []
        for seq in range(SEQ - half + 1, SEQ + 1):
            odd = r == culprit and seq == SEQ
            site = ("/job/model/moe.py", 212, "skip") if odd else \
                ("/job/model/moe.py", 95, "dispatch")
            entries.append(_entry(len(entries), "0", "default_pg", seq,
                                  "nccl:barrier" if odd else "nccl:all_gather",
                                  [] if odd else [[401, 2048]],
                                  [] if odd else [[401 * world, 2048]],
                                  [] if odd else ["BFloat16"], seq < SEQ,
                                  [site, ("/job/model/moe.py", 183, "forward"),
                                   ("/job/train.py", 159, "step")],
                                  time.time_ns() - (SEQ - seq) * 10**6))
        for seq in range(EXPERT_SEQ - half + 1, EXPERT_SEQ + 1):
            entries.append(_entry(len(entries), "1", "expert_group", seq, "nccl:all_reduce",
                                  [[4096]], [[4096]], ["Float"], True,
                                  [("/job/model/moe.py", 140, "reduce_grads"),
                                   ("/job/train.py", 170, "step")], time.time_ns()))
        dump = {"version": "2.10", "entries": entries,
                "pg_config": {"0": {"name": "0", "desc": "default_pg",
                                    "ranks": str(list(range(world)))},
                              "1": {"name": "1", "desc": "expert_group",
                                    "ranks": str(list(range(node * rpn, (node + 1) * rpn)))}},
                "pg_status": {"0": {"last_enqueued_collective": SEQ,
                                    "last_completed_collective": SEQ - 1,
                                    "last_started_collective": SEQ},
                              "1": {"last_enqueued_collective": EXPERT_SEQ,
                                    "last_completed_collective": EXPERT_SEQ,
                                    "last_started_collective": EXPERT_SEQ}}}
        ranks[str(r)] = {"hb.json": json.dumps(hb), "fr.pkl": json.dumps(dump)}
    return {"version": 1, "ranks": ranks, "files": {}}


def _entry(rid: int, pg: str, desc: str, seq: int, op: str, ins: list[list[int]],
           outs: list[list[int]], dtypes: list[str], done: bool,
           frames: list[tuple[str, int, str]], t_ns: int) -> dict[str, Any]:
    return {"record_id": rid, "pg_id": int(pg), "process_group": [pg, desc],
            "collective_seq_id": seq, "p2p_seq_id": -1, "op_id": seq, "profiling_name": op,
            "time_created_ns": t_ns, "input_sizes": ins, "input_dtypes": dtypes,
            "output_sizes": outs, "output_dtypes": dtypes,
            "state": "completed" if done else "scheduled", "retired": done, "is_p2p": False,
            "frames": [{"filename": f, "line": ln, "name": fn} for f, ln, fn in frames]}
