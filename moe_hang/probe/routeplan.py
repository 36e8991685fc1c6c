"""A routing plan of ``moe-hang check`` and what it does to a router's output or an MoE
block's input and output (stdlib at import, like routing.py that applies it; torch handed in).
docs/DESIGN.md §15."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ENV_PLAN = "MOE_HANG_ROUTING_PLAN"  # JSON: {"rank", "step", "starve" | "all_to" | "keep"}


@dataclass(frozen=True)
class Plan:
    """Route differently on ``rank`` at ``step``: no token to expert ``starve``, every token's
    first choice to ``all_to``, or only the first ``keep`` (a fraction) of the tokens into
    each MoE block (ragged counts; 0: a rank with no token); on every block, or those whose
    name contains ``block``."""

    rank: int
    step: int
    starve: int | None = None
    all_to: int | None = None
    block: str | None = None
    keep: float | None = None

    @classmethod
    def from_env(cls, env: dict[str, str]) -> Plan | None:
        d = json.loads(env.get(ENV_PLAN) or "null")
        return None if d is None else cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        def opt(kind: Any, v: Any) -> Any:
            return None if v is None else kind(v)

        return cls(int(d["rank"]), int(d["step"]), opt(int, d.get("starve")),
                   opt(int, d.get("all_to")), d.get("block"), opt(float, d.get("keep")))

    def applies(self, rank: int, step: int, block: str) -> bool:
        return rank == self.rank and step == self.step and (
            self.block is None or self.block in block)


def rebias(plan: Plan, out: Any) -> Any:
    """Logits as the plan wants them: the starved expert one below each token's lowest logit,
    the crowded one one above its highest. A margin of 1, not a huge constant: the softmax
    that follows keeps distinct values, so the model's top-k breaks no ties of our making."""
    new = out
    if plan.starve is not None:
        low = new.detach().amin(dim=-1, keepdim=True) - 1.0
        new = new.clone()
        new[..., plan.starve:plan.starve + 1] = low
    if plan.all_to is not None:
        high = new.detach().amax(dim=-1, keepdim=True) + 1.0
        new = new.clone() if new is out else new
        new[..., plan.all_to:plan.all_to + 1] = high
    return new


def reroute(torch: Any, plan: Plan, idx: Any, n: int) -> Any:
    """A router's top-k indices ``[tokens, k]`` as the plan wants them (rows keep k distinct
    experts)."""
    if plan.starve is not None:
        # each row's copy of the starved expert goes to the lowest expert not in the row
        taken = torch.zeros(idx.shape[0], n, dtype=torch.bool, device=idx.device)
        taken.scatter_(1, idx.long(), True)
        taken[:, plan.starve] = True
        free = (~taken).to(torch.int8).argmax(dim=1, keepdim=True).to(idx.dtype)
        idx = torch.where(idx == plan.starve, free.expand_as(idx), idx)
    if plan.all_to is not None:
        has = (idx == plan.all_to).any(dim=1, keepdim=True)
        first = torch.where(has, idx[:, :1], torch.full_like(idx[:, :1], plan.all_to))
        idx = torch.cat([first, idx[:, 1:]], dim=1)
    return idx


def shrink(x: Any, keep: float) -> tuple[Any, Any, int]:
    """A ``keep`` plan's cut of a block's input along its token dim (the second-to-last: [T, D]
    or [B, S, D]): (the rows it gets, the rows it does not, the dim)."""
    dim = x.dim() - 2
    n = int(x.shape[dim] * keep)
    return x.narrow(dim, 0, n), x.narrow(dim, n, x.shape[dim] - n), dim


def regrow(torch: Any, out: Any, rest: Any, dim: int) -> Any:
    """The block's output made whole again with the rows it did not get, passed through as
    they came in (zeros where the widths differ): the rest of the model sees the shape it
    expects, and its gradient still reaches every token (zero rows would cut it where the
    block holds its own residual, and the job would fail for our plan's sake)."""
    items = list(out) if isinstance(out, (tuple, list)) else [out]
    pos = next(i for i, t in enumerate(items) if torch.is_tensor(t))
    y = items[pos]
    if rest.shape[dim + 1:] != y.shape[dim + 1:] or rest.dtype != y.dtype:
        shape = list(y.shape)
        shape[dim] = rest.shape[dim]
        rest = y.new_zeros(shape)
    items[pos] = torch.cat([y, rest], dim=dim)
    return items if type(out) is list else tuple(items) if isinstance(out, tuple) else items[0]
