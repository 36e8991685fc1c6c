"""Synthesize Flight Recorder dump sets in torch's own format, with one planted fault.

    python scripts/fr_synth.py OUT_DIR --ranks N --entries E [--mesh DPxTP] --fault KIND
        [--format pickle|json] [--backend nccl|gloo] [--version V] [--seed S] [--frames]
        [--timing] [--p2p] [--prefix P] [--workers W]
    python scripts/fr_synth.py --check-against REAL_DIR SYNTH_DIR   # compare schemas

Writes one dump per rank, named prefix + global rank (``.json`` appended for JSON), exactly as
torch's recorder of that release and backend lays it out (see docs/flight_recorder_formats.md), and
``OUT_DIR/truth.json`` with the planted fault (a name no reader that globs prefix + rank picks up:
it holds neither the prefix nor a trailing rank number).

The job modelled: a 2-D DeviceMesh ``(dp, tp)`` = ``--mesh`` (rank = dp_index * tp + tp_index),
made with ``init_device_mesh(..., mesh_dim_names=("dp", "tp"))`` on the ``new_group`` path: the
default group "0" (desc ``default_pg``), then one ``mesh_dp`` group per mesh column (names "1" ..
str(tp)), then one ``mesh_tp`` group per mesh row (names str(tp + 1) ...). Every rank runs the same
training step (FSDP-style all-gather / reduce-scatter on dp, tensor-parallel all-reduce on tp, a
grad-norm and a loss all-reduce on the default group; with ``--p2p`` or ``--fault p2p`` also an
activation send/recv between dp neighbours), for thousands of steps, so the ring buffer has wrapped
and ``record_id``/sequence numbers continue from large counts. The last step carries the fault.

Backends differ the way torch does: NCCL enqueues asynchronously (every rank posts the whole last
step up to its CPU sync, the loss ``.item()``; entries then complete in stream order), gloo blocks
in each collective (a rank's dump ends at the collective it waits in; no send/recv entries, only
``op_id`` gaps; entries stay ``scheduled`` and only ``retired`` tells completion; pg_status counts
ops and may lag; ``pg_config`` is the single ``''`` entry).

Fault kinds: missing_rank, size, dtype, op, order, p2p, none; and the symmetric ``stall``:
every rank posted the same collective (the grad-norm all-reduce of the default group) and none
completed it — with ``--timing`` (NCCL) every rank's kernel ``started`` it — a transport or
hardware hang with no culprit.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from moe_hang.testing.fr_synth.check import check_against
from moe_hang.testing.fr_synth.dump import build_dump, generate, to_json, write_truth
from moe_hang.testing.fr_synth.job import (
    FAULTS,
    RELEASES,
    SYMMETRIC_FAULTS,
    TRUTH_NAME,
    Job,
    OpT,
    Schema,
    plan,
    schema_for,
    simulate,
    template,
)

__all__ = [
    "FAULTS",
    "RELEASES",
    "SYMMETRIC_FAULTS",
    "TRUTH_NAME",
    "Job",
    "OpT",
    "Schema",
    "build_dump",
    "check_against",
    "generate",
    "main",
    "parse_mesh",
    "plan",
    "schema_for",
    "simulate",
    "template",
    "to_json",
    "write_truth",
]


def parse_mesh(mesh: str | None, ranks: int) -> tuple[int, int]:
    if mesh:
        a, b = (int(x) for x in mesh.lower().split("x"))
    else:
        b = 8 if ranks % 8 == 0 and ranks >= 16 else 2
        a = ranks // b
    if a * b != ranks or a < 2 or b < 2:
        raise SystemExit(f"--mesh {mesh}: need DPxTP with DP*TP == --ranks {ranks}, both >= 2")
    return a, b


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--entries", type=int, default=200)
    ap.add_argument("--mesh", default=None, help="DPxTP, e.g. 64x128 (default: N/8 x 8)")
    ap.add_argument("--fault", choices=FAULTS + SYMMETRIC_FAULTS, default="missing_rank")
    ap.add_argument("--format", dest="fmt", choices=("pickle", "json"), default="pickle")
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--version", default="2.13", choices=RELEASES,
                    help="torch release whose dump format to write (default 2.13)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--frames", action="store_true", help="include Python stack frames (pickle)")
    ap.add_argument("--timing", action="store_true",
                    help="as with TORCH_NCCL_ENABLE_TIMING: started states, duration_ms (NCCL)")
    ap.add_argument("--p2p", action="store_true", help="send/recv in every step (auto for p2p)")
    ap.add_argument("--prefix", default=None, help="file prefix (default: the release's)")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--check-against", type=Path, default=None, metavar="REAL_DIR",
                    help="compare the schema of REAL_DIR's first dump with OUT's and exit")
    a = ap.parse_args(argv)
    if a.out is None:
        ap.error("OUT_DIR is required")
    if a.check_against:
        return check_against(a.check_against, a.out)
    schema = schema_for(a.version)
    minor = int(a.version.split(".")[1])
    if a.backend == "gloo" and minor < 8:
        ap.error(f"gloo has no Flight Recorder before torch 2.8 (asked for {a.version})")
    if a.fmt == "json" and not schema.has_json:
        ap.error(f"torch {a.version} has no JSON dump (dump_json arrived in 2.5)")
    if a.entries < 1 or a.ranks < 4:
        ap.error("need --entries >= 1 and --ranks >= 4")
    dp, tp = parse_mesh(a.mesh, a.ranks)
    p2p = a.p2p or a.fault == "p2p"
    if p2p and dp % 2:
        ap.error("p2p needs an even DP dimension (dp neighbours pair up)")
    job = Job(ranks=a.ranks, dp=dp, tp=tp, backend=a.backend, schema=schema, fmt=a.fmt,
              entries=a.entries, seed=a.seed, frames=a.frames, timing=a.timing, p2p=p2p,
              prefix=a.prefix or schema.prefix, fault=a.fault)
    t0 = time.monotonic()
    truth = generate(job, a.out, a.workers)
    dt = time.monotonic() - t0
    size = sum(p.stat().st_size for p in a.out.glob(f"{job.prefix}*"))
    print(f"wrote {a.ranks} dumps ({size / 1e6:.1f} MB) to {a.out} in {dt:.1f} s; fault "
          f"{a.fault}: culprits {truth['culprits']} group {truth.get('group', {}).get('name')} "
          f"seq {truth.get('seq')}")
    return 0


