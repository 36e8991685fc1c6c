"""What the probe's per-tick copy of the Flight Recorder costs, by ring size (the numbers behind
``probe.env.FR_BUFFER``; docs/DESIGN.md §9).

    python scripts/fr_copy_cost.py [--sizes 64,128,256,512,1000,2000] [--repeat 30]

For each size, one process (the ring is sized when the group is made) joins a gloo group of
one, fills the ring with all-reduces, and times, median of ``--repeat``: the counts the probe
reads every tick (``_dump_fr_trace_json(includeCollectives=False)``); a whole-ring pickle
without and with stack frames (symbolization warm: torch._dynamo imported); and the probe's
whole copy (dump, unpickle, the new entries into the posted log) after 16 new collectives,
without and with frames. ``cpu % at 4 Hz`` is that last copy four times a second, the probe's
tick, over one core.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NEW_PER_TICK = 16


def _measure(size: int, repeat: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from moe_hang.probe import appendlog, history

    c10d: Any = torch._C._distributed_c10d
    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"file://{tempfile.mkdtemp()}/init")
    x = torch.ones(4)
    for _ in range(size + 10):
        dist.all_reduce(x)

    def med(fn: object) -> float:
        ts = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()  # type: ignore[operator]
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    out = {"status_ms": med(lambda: c10d._dump_fr_trace_json(includeCollectives=False)),
           "dump_ms": med(lambda: c10d._dump_fr_trace(includeStackTraces=False))}
    import torch._dynamo  # what DDP, FSDP2 and compiled jobs have imported

    c10d._dump_fr_trace(includeStackTraces=True)  # the symbolizer's first use
    out["dump_frames_ms"] = med(lambda: c10d._dump_fr_trace(includeStackTraces=True))

    import contextlib
    import threading

    lock = threading.Lock()

    @contextlib.contextmanager
    def within(timeout: float | None = None) -> Iterator[Any]:
        with lock:
            yield torch

    for frames in (False, True):
        with tempfile.TemporaryDirectory() as d:
            h = history.History(appendlog.PostedLog(Path(d) / "log.jsonl"), within,
                                {"kind": "start"})
            h.tick(None, frames, force=True)
            ts = []
            for _ in range(repeat):
                for _ in range(NEW_PER_TICK):
                    dist.all_reduce(x)
                t0 = time.perf_counter()
                h.tick(None, frames, force=True)
                ts.append(time.perf_counter() - t0)
            out["copy_frames_ms" if frames else "copy_ms"] = statistics.median(ts) * 1e3
    dist.destroy_process_group()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,128,256,512,1000,2000")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the per-size child
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(_measure(args.one, args.repeat)))
        return 0
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        env = dict(os.environ, TORCH_FR_BUFFER_SIZE=str(size), OMP_NUM_THREADS="1",
                   PYTHONPATH=str(ROOT))
        proc = subprocess.run([sys.executable, __file__, "--one", str(size), "--repeat",
                               str(args.repeat)], env=env, capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            print(f"size {size}: failed\n{proc.stderr[-800:]}")
            return 1
        rows.append((size, json.loads(proc.stdout.strip().splitlines()[-1])))
    cols = ["status_ms", "dump_ms", "dump_frames_ms", "copy_ms", "copy_frames_ms"]
    print("ring    " + "  ".join(f"{c:>14}" for c in cols) + "  cpu % at 4 Hz (frames)")
    for size, r in rows:
        print(f"{size:<6}  " + "  ".join(f"{r[c]:>14.3f}" for c in cols)
              + f"  {0.4 * r['copy_ms']:.2f} ({0.4 * r['copy_frames_ms']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
