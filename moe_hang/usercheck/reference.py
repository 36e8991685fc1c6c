"""The single-process reference of ``moe_hang.check(..., reference=...)``: the user's
``reference()`` model (the same model with every expert local) run on every rank's batch in
turn, under the plan each run had, and compared with what the ranks kept (``result.pt``).

``python -m moe_hang.usercheck.reference --reference M:F --batch M:F --world W --steps S
--runs JSON`` (JSON: ``[{"run_dir": ..., "plan": {...} | null}, ...]``, the clean runs) writes
each run directory's ``reference.json``; with ``--when-told`` it computes while the runs still
run and compares once the parent says so (``verify --fixed``, whose reference is the built-in
model's: scenarios/reference.py). A world of one gloo rank exists in this process (an
in-memory store), so that a ``reference`` that builds a device mesh or calls ``fully_shard``
(``build`` itself, often) runs as on one rank.

At each step rank ``r``'s batch goes through the model as rank ``r`` (a plan applies to the
rank and step it names: the counting sets its rank before each batch), the loss of each is
backpropagated scaled by ``1/world`` (``--reduce mean``: DDP's and FSDP's gradient averaging)
or not (``sum``), then the optimizer steps once. Compared: each rank's output and loss with
the reference's on that rank's batch, and each rank's whole gradient of every parameter its
optimizer steps with the reference's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moe_hang.probe.env import write_atomic
from moe_hang.probe.layout import RankFiles, RunLayout
from moe_hang.probe.routeplan import Plan
from moe_hang.probe.routing import Routing
from moe_hang.usercheck.compare import Comparison, rtol_for
from moe_hang.usercheck.rank import (
    SEED,
    dtypes,
    forward,
    load,
    loss_of,
    model_and_optimizer,
    output,
    stepped_grads,
)

WHAT = "every rank's output and loss, and every stepped parameter's whole gradient, every step"


class ReferenceFailed(Exception):
    """The reference itself raised: where, and what (nothing is compared for that run)."""


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]


def reference_steps(reference: Any, batch: Any, *, world: int, steps: int, reduce: str,
                    plan: Plan | None, routing_path: Path, router: str | None
                    ) -> list[dict[str, Any]]:
    torch.manual_seed(SEED)
    try:
        model, opt = model_and_optimizer(reference())
    except Exception as exc:
        raise ReferenceFailed(f"building it: {_short(exc)}") from exc
    routing = Routing(torch, 0, routing_path, plan, router)
    routing.install()
    kept: list[dict[str, Any]] = []
    seen: set[str] = set()
    try:
        for step in range(steps):
            outs, losses = [], []
            for rank in range(world):
                routing.rank = rank  # the plan's rank is this batch's
                try:
                    out = forward(model, batch(rank, step))
                    loss = loss_of(out)
                    # a loss no trainable weight reached (a batch the plan left no token in a
                    # model that then passes it through) has a zero gradient: nothing to add
                    if loss.requires_grad:
                        (loss / world if reduce == "mean" else loss).backward()
                except Exception as exc:  # e.g. a model that cannot take a batch of 0 tokens
                    raise ReferenceFailed(f"on rank {rank}'s batch at step {step}: "
                                          f"{_short(exc)}") from exc
                outs.append(output(out).detach().float().cpu().clone())
                seen.update(dtypes(model, out))
                losses.append(float(loss.item()))
            kept.append({"outs": outs, "losses": losses, "grads": stepped_grads(model, opt),
                         "dtypes": sorted(seen)})
            opt.step()
            opt.zero_grad()
    finally:
        routing.remove()
    return kept


def compare_run(ref: list[dict[str, Any]], results: dict[int, dict[str, Any]], world: int,
                rtol: float | None) -> dict[str, Any]:
    """Step by step (the first failure is the earliest), each rank's output and loss, then
    its gradients; within ``rtol``, else the tolerance of the least precise dtype the ranks
    or the reference computed in."""
    if rtol is None:
        seen = {d for step in ref for d in step.get("dtypes", ())}
        seen |= {d for res in results.values() for d in res.get("dtypes", ())}
        rtol = rtol_for(seen)
    c = Comparison(rtol)
    ranks = []
    for rank in range(world):
        res = results.get(rank)
        if res is None:
            c.fail(f"rank {rank}: no results (did not finish)")
        elif len(res["steps"]) != len(ref):
            c.fail(f"rank {rank}: {len(res['steps'])} of {len(ref)} steps kept")
        else:
            ranks.append(rank)
    for i, want in enumerate(ref):
        for rank in ranks:
            got = results[rank]["steps"][i]
            c.check(f"step {i} rank {rank} output", got["out"], want["outs"][rank])
            c.check(f"step {i} rank {rank} loss", torch.tensor([got["loss"]]),
                    torch.tensor([want["losses"][rank]]))
        for rank in ranks:
            got = results[rank]["steps"][i]
            for name in sorted(set(got["grads"]) | set(want["grads"])):
                if name not in want["grads"] or name not in got["grads"]:
                    c.fail(f"step {i} rank {rank} grad {name}: stepped in "
                           f"{'the ranks' if name in got['grads'] else 'the reference'} only")
                    continue
                c.check(f"step {i} rank {rank} grad {name}", got["grads"][name],
                        want["grads"][name])
    return c.report(len(ref), WHAT)


def _listen() -> threading.Event:
    """``--when-told``: the parent's word arrives on stdin, maybe while the reference still
    computes — "compare", or EOF (the run failed, or the parent died, even by SIGKILL): then
    this process ends at once, so that no reference outlives the command that started it."""
    told = threading.Event()

    def listen() -> None:
        if sys.stdin.readline().strip() != "compare":
            os._exit(0)
        told.set()

    threading.Thread(target=listen, daemon=True).start()
    return told


def _report(layout: RunLayout, ref: list[dict[str, Any]] | None, error: str | None,
            args: argparse.Namespace) -> None:
    if ref is None:
        report: dict[str, Any] = {"ok": False, "error": error, "rtol": args.rtol or 0.0,
                                  "steps": args.steps, "what": WHAT}
    else:
        results = {}
        for p in layout.files_of(RankFiles.RESULT):
            data = torch.load(p, weights_only=True)
            results[int(data["rank"])] = data
        report = compare_run(ref, results, args.world, args.rtol)
    write_atomic(layout.reference, (json.dumps(report, indent=2) + "\n").encode())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="moe_hang.usercheck.reference")
    ap.add_argument("--reference", required=True)
    ap.add_argument("--batch", required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--rtol", type=float, help="default: by the least precise dtype")
    ap.add_argument("--reduce", choices=("mean", "sum"), default="mean")
    ap.add_argument("--router")
    ap.add_argument("--runs", required=True)
    ap.add_argument("--when-told", action="store_true",
                    help="compute while the runs run; compare once stdin says 'compare'")
    args = ap.parse_args(argv)
    told = _listen() if args.when_told else None
    reference, batch = load(args.reference), load(args.batch)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    waiting: list[tuple[RunLayout, list[dict[str, Any]] | None, str | None]] = []
    for run in json.loads(args.runs):
        layout = RunLayout(Path(run["run_dir"]))
        plan = None if run.get("plan") is None else Plan.from_dict(run["plan"])
        print(f"reference: {layout.root.name}", flush=True)
        ref, error = None, None
        try:
            ref = reference_steps(reference, batch, world=args.world, steps=args.steps,
                                  reduce=args.reduce, plan=plan,
                                  routing_path=layout.reference_routing, router=args.router)
        except ReferenceFailed as exc:
            traceback.print_exc()  # into reference.log: the whole story, for the curious
            error = str(exc)
        if told is None:
            _report(layout, ref, error, args)  # one run's reference in memory at a time
        else:
            waiting.append((layout, ref, error))
    if told is not None:
        told.wait()  # bounded: the parent always writes or closes, or dies (EOF)
        for layout, ref, error in waiting:
            _report(layout, ref, error, args)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
