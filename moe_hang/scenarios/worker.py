"""What every rank runs under torchrun: ``python -m moe_hang.scenarios.worker RUN_DIR``.

It installs the probe before torch starts any thread, builds the scenario's model on its slice
of the experts, runs ``steps`` training steps on its slice of the global batch, and writes:

``ranks/rank{R}.tokens.jsonl``  one line per EP collective of the model (not the gathers of
                                verify's results), written *before* it is posted:
                                local tokens, tokens per expert, the sizes about to be sent and
                                the sequence number the collective will get.
``ranks/rank{R}.result.pt``     verify --fixed (``keep_results``): every step's output, loss
                                share and whole LoRA gradients, as moe_hang.check's ranks keep
                                them (usercheck/rank.py), for the one reference runner.
``ranks/rank{R}.error.json``    the exception, when the step raised one.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from moe_hang.probe import probe
from moe_hang.probe.env import write_atomic
from moe_hang.probe.layout import RankFiles, RunLayout


class TokenLog:
    """Appends one JSON line per EP collective; flushed before the collective is posted."""

    def __init__(self, path: Path, group: Any):
        self.f = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the rank
        self.group = group
        self.step = 0
        self.layer: int | None = None
        self.tokens: dict[int, dict[str, Any]] = {}

    def next_seq(self) -> int | None:
        try:
            return int(self.group._get_sequence_number_for_group()) + 1
        except Exception:
            return None

    def __call__(self, name: str, op: str, sizes: list[list[int]], dtype: str,
                 info: dict[str, Any]) -> None:
        backward = bool(info.pop("backward", False))
        rec = {"frames": _caller_frames(),
            "time": time.time(), "step": self.step,
            "layer": None if backward else self.layer,
            "phase": "backward" if backward else "forward",
            "name": name, "op": op,
            "pg": getattr(self.group, "group_name", "0"),
            "pg_desc": getattr(self.group, "group_desc", "default_pg"),
            "seq": self.next_seq(), "input_sizes": sizes, "dtype": dtype,
            "tokens": None if backward else self.tokens.get(self.layer or 0), **info,
        }
        self.f.write(json.dumps(rec) + "\n")


def _caller_frames(limit: int = 12) -> list[list[Any]]:
    """Who is posting this collective (innermost first), without the logging itself."""
    frame = sys._getframe(2)  # 0: here, 1: TokenLog.__call__
    out: list[list[Any]] = []
    while frame is not None and len(out) < limit:
        code = frame.f_code
        if code.co_name != "_observe":
            out.append([code.co_filename, frame.f_lineno, code.co_name])
        frame = frame.f_back  # type: ignore[assignment]
    return out


def _choose_backend(requested: str, world: int) -> str:
    import torch
    import torch.distributed as dist

    if requested != "auto":
        return requested
    if torch.cuda.is_available() and torch.cuda.device_count() >= min(
            world, int(os.environ.get("LOCAL_WORLD_SIZE", world))) and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def run(run_dir: Path) -> int:
    rank = int(os.environ["RANK"])
    ranks_dir = run_dir / "ranks"
    probe.install(ranks_dir, rank)
    probe.set_progress(phase="import")

    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from moe_hang.config import RunConfig
    from moe_hang.scenarios import ep
    from moe_hang.scenarios.build import build
    from moe_hang.scenarios.moe import global_batch, local_loss, tokens_per_expert
    from moe_hang.usercheck.rank import stepped_grads

    cfg = RunConfig.from_dict(json.loads(RunLayout(run_dir).config.read_text()))
    backend = _choose_backend(cfg.backend, cfg.nproc)
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    probe.set_progress(phase="rendezvous", backend=backend, device=str(device))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.pg_timeout_s))
    mesh = init_device_mesh(device.type, (cfg.nproc,), mesh_dim_names=("ep",))
    group = mesh.get_group()

    files = RankFiles(ranks_dir, rank)
    log = TokenLog(files.tokens, group)
    ep.set_collective_observer(log)
    mcfg = cfg.model

    def before_unshard(layer_idx: int, expert: int) -> Any:
        def hook(_mod: Any, args: Any) -> None:
            # FSDP all-gathers this expert's shards next: record it as the EP exchange is
            log.layer = layer_idx
            # sizes unknown here (FSDP's flat shard): only the identity of the collective
            log("fsdp_unshard", "all_gather", [], "", {
                "tag": f"layer{layer_idx}.expert{expert}",
                "rows": int(args[0].shape[0]) if args else None})
        return hook

    built = build(cfg, mesh, rank, device, before_unshard)
    model = built.model
    write_atomic(files.coverage,
                       json.dumps({"uncovered_trainable": built.uncovered}).encode())

    def on_route(layer_idx: int) -> Any:
        def hook(_mod: Any, _inp: Any, out: Any) -> None:
            log.layer = layer_idx
            log.tokens[layer_idx] = {
                "local": int(out[1].shape[0]),
                "per_expert": tokens_per_expert(out[1].detach().cpu(), mcfg.experts),
            }
        return hook

    layers: list[Any] = list(model.layers)
    for i, layer in enumerate(layers):
        layer.router.register_forward_hook(on_route(i))

    lora = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(lora, lr=cfg.lr, foreach=False)
    offset, n_tok = cfg.offsets()[rank], cfg.tokens[rank]
    results: list[dict[str, Any]] = []

    def reduce_loss(loss: torch.Tensor) -> float:
        """Sum the per-rank loss shares (reporting only; outside the EP exchange)."""
        total = loss.detach().clone()
        log("reduce_loss", "all_reduce", [list(total.shape)], str(total.dtype), {})
        dist.all_reduce(total)
        return float(total)

    for step in range(1, cfg.steps + 1):
        log.step = step
        probe.set_progress(step=step, steps=cfg.steps, phase="forward")
        x_TD = global_batch(mcfg, cfg.total_tokens, step)[offset:offset + n_tok].to(device)
        out_TD = model(x_TD)
        loss = local_loss(out_TD, cfg.total_tokens)
        probe.set_progress(phase="backward")
        # FSDP averages gradients over ranks; EP sums them through its collectives
        (loss * cfg.nproc if cfg.scenario == "fsdp-skip" else loss).backward()
        probe.set_progress(phase="optimizer")
        total = reduce_loss(loss)
        if cfg.keep_results:  # whole gradients: DTensor shards gathered, alike on every rank
            results.append({"out": out_TD.detach().cpu().clone(), "loss": float(loss.detach()),
                            "total_loss": total, "grads": stepped_grads(model, opt)})
        opt.step()
        opt.zero_grad(set_to_none=True)
        probe.set_progress(step=step, phase="step-done")

    if cfg.keep_results:
        torch.save({"rank": rank, "rows": [offset, n_tok], "backend": backend,
                    "steps": results, "dtypes": ["torch.float32"]}, files.result)
    probe.set_progress(phase="finishing")
    dist.barrier()
    dist.destroy_process_group()
    probe.set_progress(phase="done")
    return 0


def main(argv: list[str] | None = None) -> int:
    # an exception that ends the rank is recorded by the probe's excepthook (error.json + dump)
    args = sys.argv[1:] if argv is None else argv
    return run(Path(args[0]))


if __name__ == "__main__":
    sys.exit(main())
