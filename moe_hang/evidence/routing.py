"""What a rank's MoE routers decided (``ranks/rank{R}.routing.jsonl``, written by the probe:
probe/routing.py): one record per router call, for the last complete step and the current
one."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RouterCall:
    step: int  # the rank's optimizer steps before the call
    block: str  # the MoE block's name in the model (model.layers.1.block_sparse_moe)
    call: int  # its calls before this one in the same step (micro-batches, recomputation)
    tokens: int  # rows routed
    counts: tuple[int, ...]  # tokens per expert (a token counts once per expert it chose)
    top_k: int | None = None
    planned: bool = False  # routed by moe-hang check's plan, not the model
    fused: bool = False  # the block's experts are one module (3-D weights), not one each

    @classmethod
    def parse(cls, d: Any) -> RouterCall | None:
        try:
            return cls(int(d["step"]), str(d["block"]), int(d["call"]), int(d["tokens"]),
                       tuple(int(c) for c in d["counts"]),
                       None if d.get("top_k") is None else int(d["top_k"]),
                       bool(d.get("plan", False)), bool(d.get("fused", False)))
        except (KeyError, TypeError, ValueError):
            return None

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "block": self.block, "call": self.call,
                "tokens": self.tokens, "counts": list(self.counts), "top_k": self.top_k,
                "plan": self.planned, **({"fused": True} if self.fused else {})}


@dataclass
class RoutingFile:
    calls: list[RouterCall] = field(default_factory=list)
    bad: int = 0  # unreadable lines (the last line of a rank killed mid-write)
    # torch.compile compiled code in the rank and no router was seen by its first step: the
    # routers ran inside compiled graphs, where the probe neither counts nor re-routes
    compiled: bool = False


def read_routing(path: Path) -> RoutingFile:
    """The calls in the file, the lines that were unreadable, and the compiled mark."""
    out = RoutingFile()
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        try:
            d = json.loads(line)
            call = RouterCall.parse(d)
        except (ValueError, RecursionError):
            d, call = None, None
        if call is not None:
            out.calls.append(call)
        elif isinstance(d, dict) and d.get("compiled") is True:
            out.compiled = True
        else:
            out.bad += 1
    return out
