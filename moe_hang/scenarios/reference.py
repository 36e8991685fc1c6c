"""The single-process reference that ``verify`` compares the expert-parallel run against.

``python -m moe_hang.scenarios.reference RUN_DIR`` builds the same model with *all* experts
local and no process group, runs the same steps on the whole global batch (same seed, same
SGD), then waits for the parent to write ``compare`` on stdin (it starts while torchrun is
still launching) and compares every rank's outputs, loss and LoRA gradients, step by step,
writing ``reference.json``. A closed stdin without ``compare`` means the job failed: it exits
quietly.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from moe_hang.config import RunConfig
from moe_hang.probe.env import write_atomic
from moe_hang.probe.layout import RankFiles, RunLayout
from moe_hang.scenarios.moe import LORA_NAMES, build_reference_model, global_batch, local_loss
from moe_hang.usercheck.compare import RTOL, Comparison


def reference_steps(cfg: RunConfig) -> list[dict[str, Any]]:
    mcfg = cfg.model
    model = build_reference_model(mcfg)
    lora = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(lora, lr=cfg.lr, foreach=False)
    steps = []
    for step in range(1, cfg.steps + 1):
        x_TD = global_batch(mcfg, cfg.total_tokens, step)
        out_TD = model(x_TD)
        loss = local_loss(out_TD, cfg.total_tokens)
        loss.backward()
        grads = {}
        for li, layer in enumerate(model.layers):
            for name in LORA_NAMES:
                g = getattr(layer.experts, name).grad
                grads[f"{li}.{name}"] = None if g is None else g.detach().clone()
        steps.append({"out": out_TD.detach().clone(), "loss": loss.item(), "grads": grads})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps


def compare(cfg: RunConfig, ref: list[dict[str, Any]], results: dict[int, dict[str, Any]],
            rtol: float = RTOL) -> dict[str, Any]:
    c = Comparison(rtol)
    for rank, res in sorted(results.items()):
        offset, n = res["rows"]
        first, num_local = res["first_expert"], res["num_local"]
        if len(res["steps"]) != len(ref):
            c.fail(f"rank {rank}: {len(res['steps'])} of {len(ref)} steps completed")
            continue
        for i, (got, want) in enumerate(zip(res["steps"], ref, strict=True), start=1):
            c.check(f"step {i} rank {rank} output", got["out"], want["out"][offset:offset + n])
            c.check(f"step {i} rank {rank} loss", torch.tensor([got["loss"]]),
                    torch.tensor([want["loss"]]))
            for key, g in got["grads"].items():
                w = want["grads"].get(key)
                c.check(f"step {i} rank {rank} grad {key}", g,
                        None if w is None else w[first:first + num_local])
    for r in sorted(set(range(cfg.nproc)) - set(results)):
        c.fail(f"rank {r}: no results (did not finish)")
    return c.report(len(ref), "per-rank outputs, global loss and every LoRA gradient, "
                    "every step")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    run_dir = Path(args[0])
    cfg = RunConfig.from_dict(json.loads(RunLayout(run_dir).config.read_text()))
    # the parent's word arrives on stdin, maybe while we still compute: "compare", or EOF
    # (the run failed, or the parent died, even by SIGKILL): then stop at once, so that no
    # reference outlives the command that started it
    word: list[str] = []
    done = threading.Event()

    def listen() -> None:
        word.append(sys.stdin.readline().strip())
        done.set()
        if word[0] != "compare":
            os._exit(0)

    threading.Thread(target=listen, daemon=True).start()
    torch.manual_seed(cfg.model.seed)
    ref = reference_steps(cfg)
    done.wait()  # bounded: the parent always writes or closes, or dies (EOF)
    if word[0] != "compare":
        return 0
    results = {}
    for p in RunLayout(run_dir).files_of(RankFiles.RESULT):
        data = torch.load(p, weights_only=True)
        results[int(data["rank"])] = data
    report = compare(cfg, ref, results)
    write_atomic(RunLayout(run_dir).reference, (json.dumps(report, indent=2) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
