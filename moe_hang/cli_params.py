"""The commands' shared options and help epilogs (markdown: one example each, lines short
enough for an 80-column help)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from moe_hang.config import DEFAULT_STALL_S

# markdown eats anything in angle brackets: defaults are spelled without them
Out = Annotated[Path | None, typer.Option(
    "--out", help="run directory (default: runs/TIMESTAMP-LABEL/)")]
Json = Annotated[bool, typer.Option("--json", help="print only the diagnosis JSON")]
Html = Annotated[Path | None, typer.Option(
    "--html", help="also save the report as a self-contained HTML page")]
SharedDir = Annotated[Path | None, typer.Option(
    "--shared-dir", help="multi-node: a directory every node sees, where the job's store "
                         "cannot be reached from outside the ranks")]
Verbose = Annotated[bool, typer.Option(
    "--verbose", "-v", help="also print ranks, timeline, stacks and evidence (always in "
                            "console.log and the HTML)")]
Ras = Annotated[list[Path] | None, typer.Option(
    "--ras", metavar="FILE", help="an NCCL RAS report (`ncclras -f json > FILE`); give two "
                                  "taken a few seconds apart to tell frozen from moving")]

# The options repro and verify share: (name, annotation, default), added to both signatures.
_SCENARIO_OPTIONS: list[tuple[str, Any, Any]] = [
    ("scenario", Annotated[str, typer.Option("--scenario",
                                             help="ep-ragged | ep-no-anchor | fsdp-skip")],
     "ep-ragged"),
    ("nproc", Annotated[int | None, typer.Option(
        "--nproc", help="ranks (default: 2, or one per --tokens)")], None),
    ("tokens", Annotated[str | None, typer.Option(
        "--tokens", help="per-rank token counts, e.g. 68,401 (default: the scenario's "
                         "ragged counts)")], None),
    ("backend", Annotated[str, typer.Option(
        "--backend", help="auto | gloo | nccl (auto: nccl with a GPU per rank)")], "auto"),
    ("stall", Annotated[float, typer.Option(
        "--stall", help="seconds without progress = stalled")], DEFAULT_STALL_S),
    ("out", Out, None),
    ("as_json", Json, False),
    ("html", Html, None),
    ("verbose", Verbose, False),
    ("steps", Annotated[int | None, typer.Option(
        "--steps", help="training steps (default: 3; fsdp-skip 5)")], None),
    ("hidden", Annotated[int, typer.Option("--hidden", help="model width D")], 64),
    ("ffn", Annotated[int, typer.Option("--ffn", help="expert FFN width F")], 128),
    ("experts", Annotated[int | None, typer.Option(
        "--experts", help="experts per layer (default: 2×ranks)")], None),
    ("topk", Annotated[int, typer.Option("--topk", help="experts per token")], 2),
    ("lora_rank", Annotated[int, typer.Option("--lora-rank", help="LoRA rank r")], 8),
    ("lora_alpha", Annotated[float, typer.Option("--lora-alpha", help="LoRA alpha")], 16.0),
    ("seed", Annotated[int, typer.Option("--seed", help="seed for inputs and weights")], 0),
    ("dead_experts", Annotated[str | None, typer.Option(
        "--dead-experts", help="experts no token is routed to, e.g. 3 or 1,3")], None),
    ("dead_layers", Annotated[str | None, typer.Option(
        "--dead-layers", help="layers where --dead-experts apply (default: all)")], None),
    ("port", Annotated[int | None, typer.Option(
        "--port", help="rendezvous port (default: a free one)")], None),
    ("lora_outside_fsdp", Annotated[bool, typer.Option(
        "--lora-outside-fsdp", help="fsdp-skip: add LoRA after fully_shard (the wrapping "
                                    "mistake)")], False),
]
_SCENARIO_DEFAULTS: dict[str, Any] = {n: d for n, _, d in _SCENARIO_OPTIONS}


def scenario_options(fn: Callable[..., None]) -> Callable[..., None]:
    """Give ``fn`` (which takes ``opts: dict``) the shared scenario options as parameters."""
    own = [p for p in inspect.signature(fn, eval_str=True).parameters.values()
           if p.name != "opts"]
    shared = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=a, default=d)
              for n, a, d in _SCENARIO_OPTIONS]
    names = [n for n, _, _ in _SCENARIO_OPTIONS]

    @functools.wraps(fn)
    def wrapper(**kwargs: Any) -> None:
        fn(**{k: v for k, v in kwargs.items() if k not in names},
           opts={k: kwargs[k] for k in names})

    wrapper.__signature__ = inspect.Signature(own + shared)  # type: ignore[attr-defined]
    return wrapper



_REPRO_EXAMPLE = """**Examples** (the 68/401-token gather of NeMo PR #3631, then FSDP2 on 4 ranks)

```
moe-hang repro
moe-hang repro --scenario fsdp-skip --nproc 4 --html report.html
```
"""

_VERIFY_EXAMPLE = """**Examples** (prove the fix; a rank with no token; the regression check)

```
moe-hang verify --fixed
moe-hang verify --fixed --fix a2a --tokens 0,5
moe-hang verify
```
"""

_DIAGNOSE_EXAMPLE = """**Example** (12345: the torchrun agent's PID, or any rank's)

```
moe-hang diagnose 12345 --out capture/
```
"""

_WATCH_EXAMPLE = """**Example**

```
moe-hang watch --stall 30 -- torchrun --nproc-per-node 8 train.py
```
"""

_ANALYZE_EXAMPLE = """**Examples**

```
moe-hang analyze node0/ node1/        # captures of watch/diagnose
moe-hang analyze /tmp/fr/             # torch's dumps in a directory
moe-hang analyze ~/.cache/torch/comm_lib_trace_rank_   # a prefix
moe-hang analyze /tmp/fr/ --ras a.json --ras b.json    # + two NCCL RAS reports
moe-hang analyze --ras a.json --ras b.json             # RAS reports alone
```
"""


_CHECK_EXAMPLE = """**Examples** (a small config of the job, a few steps)

```
moe-hang check -- torchrun --nproc-per-node 2 train.py --steps 4
moe-hang check --plans 4 --router my_pkg.moe.TopKRouter -- torchrun ... train.py
```
"""
