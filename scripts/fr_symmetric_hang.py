"""A Flight Recorder dump set of a symmetric hardware hang, in torch's exact NCCL layout with
``TORCH_NCCL_ENABLE_TIMING=1``: every rank posted the same collective, every rank's kernel
*started* it, none completed it (a transport or GPU fault, not a desync).

    python scripts/fr_symmetric_hang.py OUT_DIR [--ranks 4] [--mesh 2x2] [--entries 16]
        [--format json|pickle] [--version 2.13] [--seed 0]

scripts/fr_synth.py writes the layout (its ``build_dump``, unchanged) but has no fault kind for
this: its faults are all asymmetric, and ``--fault none`` completes everything. So every rank is
given the same head here — the grad-norm all-reduce of the default group (the last step's
next-to-last op) — which fr_synth's NCCL model then records as ``started`` (its start event
fired: the kernel runs, waiting for data that never comes), everything before it
``completed`` with ``duration_ms``, and the loss all-reduce after it ``scheduled``.
``truth.json`` says where it hangs.
"""

from __future__ import annotations

import argparse
import json
import pickle
from pathlib import Path
from typing import Any

from moe_hang.testing.script import run

ROOT = Path(__file__).resolve().parent.parent


def _load_synth() -> Any:
    from moe_hang.testing import fr_synth

    return fr_synth


def generate(out: Path, *, ranks: int, mesh: str | None, entries: int, fmt: str,
             version: str, seed: int) -> dict[str, Any]:
    fs = _load_synth()
    schema = fs.schema_for(version)
    dp, tp = fs.parse_mesh(mesh, ranks)
    job = fs.Job(ranks=ranks, dp=dp, tp=tp, backend="nccl", schema=schema, fmt=fmt,
                 entries=entries, seed=seed, frames=False, timing=True, p2p=False,
                 prefix=schema.prefix, fault="none")
    fs.plan(job)
    out.mkdir(parents=True, exist_ok=True)
    stuck: set[tuple[str, int]] = set()
    for r in range(ranks):
        ops = fs.template(job, r)
        head = len(ops) - 2  # clip_grad_norm_'s all-reduce on the default group
        dump = fs.build_dump(job, r, head, ops)
        stuck |= {(e["process_group"][0], e["collective_seq_id"]) for e in dump["entries"]
                  if e["state"] == "started"}
        if fmt == "json":
            (out / f"{job.prefix}{r}.json").write_text(fs.to_json(dump))
        else:
            with (out / f"{job.prefix}{r}").open("wb") as f:
                pickle.dump(dump, f, protocol=2)
    if len(stuck) != 1:
        raise SystemExit(f"expected one started collective on every rank, got {sorted(stuck)}")
    (pg, seq), = stuck
    truth = {"generator": "scripts/fr_symmetric_hang.py (scripts/fr_synth.py build_dump)",
             "fault": "symmetric_hang", "ranks": ranks, "mesh": [dp, tp], "entries": entries,
             "backend": "nccl", "torch_release": version, "format": fmt, "seed": seed,
             "timing": True, "prefix": job.prefix, "culprits": [], "hung": True,
             "stuck_ranks": ranks, "group": {"name": pg, "desc": "default_pg"}, "seq": seq,
             "state": "started",
             "note": "every rank started this collective, none completed it: no rank is "
                     "behind, so no culprit (a transport or hardware hang)"}
    (out / "truth.json").write_text(json.dumps(truth, indent=1) + "\n")
    return truth


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mesh", default="2x2")
    ap.add_argument("--entries", type=int, default=16)
    ap.add_argument("--format", dest="fmt", choices=("json", "pickle"), default="json")
    ap.add_argument("--version", default="2.13")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    truth = generate(a.out, ranks=a.ranks, mesh=a.mesh, entries=a.entries, fmt=a.fmt,
                     version=a.version, seed=a.seed)
    print(f"wrote {a.ranks} dumps to {a.out}: every rank started "
          f"{truth['group']['name']}#{truth['seq']}, none completed it")
    return 0


if __name__ == "__main__":
    run(main)
