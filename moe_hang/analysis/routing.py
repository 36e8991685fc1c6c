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


@dataclass(frozen=True)
class TokenGap:
    """At ``step``, the ``call``-th call of ``block``'s router routed different numbers of
    tokens on different ranks (ragged batches: an expert-parallel gather's sizes)."""

    step: int
    block: str
    call: int
    tokens: dict[int, int]  # rank -> tokens routed
    planned: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "block": self.block, "call": self.call,
                "tokens": {str(r): n for r, n in self.tokens.items()},
                "planned": list(self.planned)}

    @classmethod
    def from_dict(cls, d: Any) -> TokenGap:
        return cls(int(d["step"]), str(d["block"]), int(d["call"]),
                   {int(r): int(n) for r, n in d["tokens"].items()},
                   tuple(int(r) for r in d.get("planned") or ()))


@dataclass
class RoutingReport:
    step: int
    gaps: list[ExpertGap] = field(default_factory=list)  # in the order the routers ran
    ragged: list[TokenGap] = field(default_factory=list)
    # rank -> block -> tokens per expert at that step (its calls summed): the heat map
    counts: dict[int, dict[str, list[int]]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "gaps": [g.to_dict() for g in self.gaps],
                "ragged": [g.to_dict() for g in self.ragged],
                "counts": {str(r): c for r, c in self.counts.items()}}

    @classmethod
    def from_dict(cls, d: Any) -> RoutingReport | None:
        if not isinstance(d, dict):
            return None
        try:
            return cls(int(d["step"]), [ExpertGap.from_dict(g) for g in d.get("gaps") or []],
                       [TokenGap.from_dict(g) for g in d.get("ragged") or []],
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
            if len({c.tokens for c in here.values()}) > 1:
                report.ragged.append(TokenGap(
                    step, key[0], key[1], {r: c.tokens for r, c in here.items()},
                    tuple(sorted(r for r, c in here.items() if c.planned))))
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


def block_label(name: str) -> str:
    """A block's name as a sentence can hold it: a container's index alone ("0") is
    "block 0"."""
    return name if any(c.isalpha() for c in name) else f"block {name}"


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
        f"{counts.pop()}" if len(counts) == 1 else " and ".join(of(r) for r in subject[:3]))
    plan = ", by moe-hang check's plan" if set(gap.planned) & set(subject) else ""
    return (f"{head} routed {n} tokens to {block_label(gap.block)} expert {gap.expert} at step "
            f"{gap.step}{plan}" + (f" ({who})" if who else ""))


def ragged_sentence(gap: TokenGap, culprits: list[int]) -> str:
    """"rank 1 sent 5 tokens into model.layers.0.mlp at step 1 (rank 0: 32)"."""
    subject = [r for r in culprits if r in gap.tokens] or [
        min(gap.tokens, key=lambda r: (gap.tokens[r], r))]
    rest = sorted(r for r in gap.tokens if r not in subject)
    head = " and ".join(f"rank {r}" for r in subject[:3])
    n = " and ".join(str(gap.tokens[r]) for r in subject[:3])
    plan = ", by moe-hang check's plan" if set(gap.planned) & set(subject) else ""
    who = "; ".join(f"rank {r}: {gap.tokens[r]}" for r in rest[:3]) + (
        "; ..." if len(rest) > 3 else "")
    return (f"{head} sent {n} tokens into {block_label(gap.block)} at step {gap.step}{plan}"
            + (f" ({who})" if who else ""))


def routing_sentence(report: RoutingReport | None, culprits: list[int], size: bool) -> str | None:
    """The one sentence a first screen shows: ranks' token counts into a block where the
    divergence is one of sizes (``size``) or a rank routed none, else an expert some ranks
    starved; the culprit's first, then any."""
    if report is None:
        return None
    mine_r = [g for g in report.ragged if set(culprits) & set(g.tokens)]
    mine_g = [g for g in report.gaps if set(culprits) & set(g.routed)]
    ragged = ragged_sentence((mine_r or report.ragged)[0], culprits) if report.ragged else None
    expert = gap_sentence((mine_g or report.gaps)[0], culprits) if report.gaps else None
    # a rank that routed no token at all: its experts' gaps follow from that
    empty = any(0 in g.tokens.values() for g in report.ragged)
    return (ragged or expert) if size or empty else (expert or ragged)
