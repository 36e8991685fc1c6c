"""One torchrun job that times training steps of the MoE+LoRA model for a list of cases.

Run by scripts/bench.py under torchrun (plain, under `moe-hang watch`, or with
TORCH_DISTRIBUTED_DEBUG=DETAIL). Each case: a dispatch (naive | varlen | a2a), experts, top-k
and per-rank token counts. Rank 0 writes one JSON line per case to --out:
step_ms (median over the timed steps), bytes_per_step per layer (the bytes a rank puts on the
wire in one step, from the Flight Recorder's sizes with nccl-tests' bus-bandwidth factors;
input_bytes_per_step is the plain sum of input sizes), and peak_mem_mb (RSS high-water mark
growth during one step, max over ranks).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import statistics
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from moe_hang.config import build_config
from moe_hang.evidence.ops import normalise_op
from moe_hang.scenarios.build import build_ep_model
from moe_hang.scenarios.moe import global_batch, local_loss
from moe_hang.testing.script import run

ELEM_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4,
              "Bool": 1, "Char": 1, "Byte": 1}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PeakRSS:
    """RSS high-water mark above the level at entry, sampled every 2 ms by a thread.

    Tensors above glibc's mmap threshold (128 KiB) are returned to the OS when freed, so RSS
    follows the large activations and communication buffers each fix allocates."""

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = _rss_mb()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss_mb())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss_mb())

    @property
    def mb(self) -> float:
        return self.peak - self.base


def _nbytes(sizes: list, dtypes: list) -> int:
    total = 0
    for size, dtype in zip(sizes, dtypes, strict=False):
        n = 1
        for x in size:
            n *= int(x)
        total += n * ELEM_BYTES.get(dtype, 4)
    return total


# Bytes a rank puts on the wire per collective, from its sizes, with nccl-tests' bus-bandwidth
# factors (ring all-reduce 2(n-1)/n of the buffer; all-gather (n-1)/n of the output;
# reduce-scatter and all-to-all (n-1)/n of the input).
def _wire_bytes(op: str, inp: int, out: int, n: int) -> float:
    if op == "all_reduce":
        return inp * 2 * (n - 1) / n
    if op == "all_gather":
        return out * (n - 1) / n
    return inp * (n - 1) / n


def _fr_bytes(lo: int, hi: int, world: int) -> tuple[int, int] | None:
    """(input bytes, wire bytes) of this rank's collectives with seq in (lo, hi] on the
    default group, from the Flight Recorder's sizes."""
    if not os.environ.get("TORCH_FR_BUFFER_SIZE"):
        return None
    raw = torch._C._distributed_c10d._dump_fr_trace(  # type: ignore[attr-defined]
        includeStackTraces=False)
    inputs, wire = 0, 0.0
    for e in pickle.loads(raw)["entries"]:
        if e.get("process_group", ("",))[0] != "0" or not lo < e["collective_seq_id"] <= hi:
            continue
        op = normalise_op(e["profiling_name"])
        inp = _nbytes(e["input_sizes"], e["input_dtypes"])
        out = _nbytes(e["output_sizes"], e["output_dtypes"])
        inputs += inp
        wire += _wire_bytes(op, inp, out, world)
    return inputs, int(wire)


def run_case(case: dict, mesh, rank: int, world: int, steps: int, warmup: int) -> dict:
    cfg = build_config(variant="fixed" if case["fix"] != "naive" else "broken",
                       fix=case["fix"] if case["fix"] != "naive" else None,
                       tokens=case["tokens"], experts=case["experts"], topk=case["topk"],
                       hidden=case.get("hidden", 256), ffn=case.get("ffn", 512), steps=1)
    mcfg = cfg.model
    built = build_ep_model(cfg, mesh, rank, torch.device("cpu"))
    model = built.model
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3,
                          foreach=False)
    off, n = cfg.offsets()[rank], cfg.tokens[rank]
    group = mesh.get_group()
    times, nbytes = [], None

    def batch(i: int) -> torch.Tensor:
        return global_batch(mcfg, cfg.total_tokens, i)[off:off + n]

    def step(x: torch.Tensor) -> None:
        loss = local_loss(model(x), cfg.total_tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    cpu = 0.0  # the process's CPU seconds over the timed steps (every thread: the probe's too)
    for i in range(warmup + steps):
        x = batch(i)
        c0 = time.process_time()
        dist.barrier()
        seq0 = group._get_sequence_number_for_group()
        t0 = time.perf_counter()
        step(x)
        dt = time.perf_counter() - t0
        seq1 = group._get_sequence_number_for_group()
        if i >= warmup:
            times.append(dt)
            cpu += time.process_time() - c0
            if nbytes is None:
                nbytes = _fr_bytes(seq0, seq1, world)
    dist.barrier()
    with PeakRSS() as mem:  # one more step, untimed, for the memory high-water mark
        step(batch(warmup + steps))
    inp, wire = nbytes if nbytes is not None else (0, 0)
    vals = torch.tensor([statistics.median(times), float(wire), mem.mb, float(inp),
                         cpu / max(1, steps)], dtype=torch.float64)
    gathered = [torch.zeros_like(vals) for _ in range(world)]
    dist.all_gather(gathered, vals)
    rows = torch.stack(gathered)
    return {**case, "world": world, "layers": cfg.model.layers,
            "step_ms": round(float(rows[:, 0].max()) * 1e3, 3),
            "steps_per_s": round(1.0 / float(rows[:, 0].max()), 2),
            "bytes_per_step": (None if nbytes is None
                               else int(rows[:, 1].mean() / cfg.model.layers)),
            "input_bytes_per_step": (None if nbytes is None
                                     else int(rows[:, 3].mean() / cfg.model.layers)),
            "peak_mem_mb": round(float(rows[:, 2].max()), 1),
            # CPU a rank spends per step, all its threads: what the probe adds, whatever
            # else the machine is doing (wall time on 2 shared cores is mostly noise)
            "cpu_ms_per_step": round(float(rows[:, 4].mean()) * 1e3, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", required=True, help="JSON list of cases")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    results = [run_case(c, mesh, rank, world, args.steps, args.warmup)
               for c in json.loads(args.cases)]
    if rank == 0:
        with open(args.out, "a") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run(main)
