"""What a rule concludes: the verdict, its culprits and their basis, the certainty, the sentence and
the advice (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_hang.analysis.advice import Advice
from moe_hang.analysis.diagnosis import Certainty, CulpritBasis, Divergence, Verdict


@dataclass
class Conclusion:
    verdict: Verdict
    culprits: list[int]
    basis: CulpritBasis
    certainty: Certainty
    summary: str
    advice: Advice = field(default_factory=lambda: Advice(""))
    div: Divergence | None = None  # the divergence to show as the first one
    more: list[Divergence] = field(default_factory=list)  # other groups that diverged
