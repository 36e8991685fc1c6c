"""What ``verify --fixed`` concludes from the fixed run's diagnosis, its comparison with the
single-process reference and the LoRA adapters left outside ``fully_shard`` (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from moe_hang.analysis.diagnosis import Verdict
from moe_hang.analysis.runs import ReferenceReport


@dataclass(frozen=True)
class Verification:
    ok: bool
    summary: str | None  # None: the run's own summary says it


def verify_fixed(verdict: Verdict, ref: ReferenceReport | None, uncovered: list[str], *,
                 fix: str, steps: int, nproc: int, tokens: list[int]) -> Verification:
    ok = verdict == Verdict.HEALTHY and ref is not None and ref.ok and not uncovered
    if uncovered:
        names = ", ".join(uncovered[:6]) + (" …" if len(uncovered) > 6 else "")
        return Verification(ok, f"{len(uncovered)} trainable LoRA parameter(s) are outside "
                            f"fully_shard (no gradient reduction, ranks drift apart): {names}. "
                            "Apply LoRA before fully_shard so the adapters shard with the "
                            "weights they adapt.")
    if verdict == Verdict.HEALTHY and not (ref is not None and ref.ok):
        fails = "; ".join(ref.failures[:3]) if ref is not None else ""
        return Verification(ok, "All steps completed, but the results differ from the "
                            f"single-process reference: {fails or 'no comparison'}.")
    if ok and ref is not None:
        return Verification(ok, f"Fixed ({fix}): all {steps} steps completed on {nproc} ranks "
                            f"with tokens {','.join(map(str, tokens))}; outputs, loss and "
                            "every LoRA gradient match the single-process reference (max abs "
                            f"err {ref.max_abs_err:.2e}, max rel err {ref.max_rel_err:.2e} ≤ "
                            f"rtol {ref.rtol:.0e}).")
    return Verification(ok, None)
