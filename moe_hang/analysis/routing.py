"""What the ranks' MoE routers decided at the step the job stopped in (pure): the experts one
rank routed no token to while another routed some — the data decision behind a collective one
rank posts and another does not (an expert's FSDP all-gather, its LoRA's gradient reduce).

The step is the one every rank with counts was in last: ranks count their own optimizer steps,
so they agree on it however far apart their clocks are. Nothing here says the difference
caused the divergence; the report puts it beside the divergence, as evidence of what the
ranks' data did there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moe_hang.evidence.model import Evidence
from moe_hang.evidence.routing import RouterCall


@dataclass(frozen=True)
class ExpertGap:
    """At ``step``, in the ``call``-th call of ``block``'s router: ``expert`` got tokens on
    some ranks and none on others."""

    step: int
    block: str
    call: int
    expert: int
    routed: dict[int, int]  # rank -> tokens it routed to the expert
    tokens: dict[int, int]  # rank -> tokens that call routed in all
    planned: tuple[int, ...] = ()  # ranks whose routing there was moe-hang check's plan

    @property
    def starved(self) -> list[int]:
        return sorted(r for r, n in self.routed.items() if n == 0)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "block": self.block, "call": self.call,
                "expert": self.expert, "routed": {str(r): n for r, n in self.routed.items()},
                "tokens": {str(r): n for r, n in self.tokens.items()},
                "planned": list(self.planned)}

    @classmethod
    def from_dict(cls, d: Any) -> ExpertGap:
        return cls(int(d["step"]), str(d["block"]), int(d["call"]), int(d["expert"]),
                   {int(r): int(n) for r, n in d["routed"].items()},
                   {int(r): int(n) for r, n in d["tokens"].items()},
                   tuple(int(r) for r in d.get("planned") or ()))


@dataclass
class RoutingReport:
    step: int
    gaps: list[ExpertGap] = field(default_factory=list)  # in the order the routers ran
    # rank -> block -> tokens per expert at that step (its calls summed): the heat map
    counts: dict[int, dict[str, list[int]]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "gaps": [g.to_dict() for g in self.gaps],
                "counts": {str(r): c for r, c in self.counts.items()}}

    @classmethod
    def from_dict(cls, d: Any) -> RoutingReport | None:
        if not isinstance(d, dict):
            return None
        try:
            return cls(int(d["step"]), [ExpertGap.from_dict(g) for g in d.get("gaps") or []],
                       {int(r): {str(b): [int(x) for x in v] for b, v in c.items()}
                        for r, c in (d.get("counts") or {}).items()})
        except (KeyError, TypeError, ValueError, AttributeError):
            return None


def routing_report(ev: Evidence) -> RoutingReport | None:
    """The ranks' routing at the last step they all counted; None without counts."""
    by_rank = {r: x.routing for r, x in ev.ranks.items() if x.routing}
    if not by_rank:
        return None
    step = min(max(c.step for c in calls) for calls in by_rank.values())
    at = {r: [c for c in calls if c.step == step] for r, calls in by_rank.items()}
    at = {r: calls for r, calls in at.items() if calls}
    report = RoutingReport(step, counts={r: _summed(calls) for r, calls in at.items()})
    keyed = {r: {(c.block, c.call): c for c in calls} for r, calls in at.items()}
    order: list[tuple[str, int]] = []
    for calls in at.values():  # the routers' order: the same model on every rank
        order += [(c.block, c.call) for c in calls if (c.block, c.call) not in order]
    for key in order:
        here = {r: k[key] for r, k in keyed.items() if key in k}
        if len(here) > 1:
            report.gaps += _gaps(step, key, here)
    return report


def _summed(calls: list[RouterCall]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for c in calls:
        acc = out.setdefault(c.block, [0] * len(c.counts))
        if len(acc) < len(c.counts):
            acc.extend([0] * (len(c.counts) - len(acc)))
        for i, n in enumerate(c.counts):
            acc[i] += n
    return out


def _gaps(step: int, key: tuple[str, int], here: dict[int, RouterCall]) -> list[ExpertGap]:
    width = max(len(c.counts) for c in here.values())
    out = []
    for e in range(width):
        routed = {r: (c.counts[e] if e < len(c.counts) else 0) for r, c in here.items()}
        if 0 in routed.values() and any(routed.values()):
            out.append(ExpertGap(step, key[0], key[1], e, routed,
                                 {r: c.tokens for r, c in here.items()},
                                 tuple(sorted(r for r, c in here.items() if c.planned))))
    return out


def gap_sentence(gap: ExpertGap, culprits: list[int]) -> str:
    """One line: the starved ranks first ("rank 1 routed 0 of 16 tokens to
    model.layers.1.block_sparse_moe expert 2 at step 2 (rank 0: 9 of 16)"); a culprit that
    routed some while the others routed none is the subject instead."""
    subject = [r for r in culprits if r in gap.routed] or gap.starved
    rest = sorted(r for r in gap.routed if r not in subject)

    def of(r: int) -> str:
        return f"{gap.routed[r]} of {gap.tokens[r]}"

    who = "; ".join(f"rank {r}: {of(r)}" for r in rest[:3]) + ("; ..." if len(rest) > 3 else "")
    head = " and ".join(f"rank {r}" for r in subject[:3])
    counts = {gap.routed[r] for r in subject}
    n = f"{gap.routed[subject[0]]} of {gap.tokens[subject[0]]}" if len(subject) == 1 else (
        f"{counts.pop()}" if len(counts) == 1 else "different numbers of")
    plan = ", by moe-hang check's plan" if set(gap.planned) & set(subject) else ""
    return (f"{head} routed {n} tokens to {gap.block} expert {gap.expert} at step "
            f"{gap.step}{plan} ({who})")
