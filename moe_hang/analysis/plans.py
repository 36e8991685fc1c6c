"""moe-hang check's records (pure): the plans tried on a user's job, what each run gave, and
the plans made from what the baseline run showed of the job's routers (commands/check.py runs
them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_hang.analysis.diagnosis import Diagnosis, Verdict
from moe_hang.analysis.runs import ReferenceReport
from moe_hang.errors import EXIT_OK, EXIT_PROBLEM, EXIT_VERIFY_FAILED

SCHEMA = "moe-hang/check/v1"
# what no plan varies: the job's own loop decides it
UNTRIED = ("a different number of micro-batches per rank (the job's loop decides it)",)
# a verdict that ends a plan as reproduced: the job would not have finished
PROBLEMS = (Verdict.DESYNC, Verdict.HANG, Verdict.CRASH, Verdict.RANK_DIED,
            Verdict.TRANSPORT_HANG)


@dataclass(frozen=True)
class Plan:
    name: str  # "starve-e2-r1"
    describe: str  # "no token to expert 2 on rank 1 at step 1"
    rank: int
    step: int
    starve: int | None = None
    all_to: int | None = None
    keep: float | None = None  # the fraction of its tokens the rank sends into each block

    def to_dict(self) -> dict[str, Any]:
        d = {"rank": self.rank, "step": self.step, "starve": self.starve,
             "all_to": self.all_to, "keep": self.keep}
        return {k: v for k, v in d.items() if v is not None}


@dataclass
class PlanResult:
    plan: Plan | None  # None: the baseline
    verdict: str
    exit_code: int
    summary: str
    culprits: list[int]
    run_dir: str
    wall_s: float
    routing: str | None = None  # the data decision the diagnosis names, if any
    planned: bool = False  # the plan's rank routed as planned (its counts say so)
    reference: ReferenceReport | None = None  # compared with the single-process reference

    @property
    def reproduced(self) -> bool:
        return self.verdict in PROBLEMS

    @property
    def differs(self) -> bool:
        """Ran clean, but not as the single-process reference did."""
        return self.reference is not None and not self.reference.ok \
            and self.reference.error is None

    @property
    def uncompared(self) -> bool:
        """Ran clean; the reference itself could not run this plan (it says why)."""
        return self.reference is not None and self.reference.error is not None

    def to_dict(self) -> dict[str, Any]:
        return {"plan": None if self.plan is None else {
                    "name": self.plan.name, "describe": self.plan.describe,
                    "rank": self.plan.rank, "step": self.plan.step,
                    "starve": self.plan.starve, "all_to": self.plan.all_to,
                    "keep": self.plan.keep},
                "verdict": self.verdict, "exit_code": self.exit_code,
                "summary": self.summary, "culprit_ranks": self.culprits,
                "run_dir": self.run_dir, "wall_s": self.wall_s, "routing": self.routing,
                "planned": self.planned, "reproduced": self.reproduced,
                "reference": None if self.reference is None else self.reference.to_dict()}


@dataclass
class Found:
    """What the baseline run showed of the job's routers."""

    world: int
    steps: int  # the last step any rank counted + 1
    blocks: list[str] = field(default_factory=list)
    experts: int = 0
    fused: list[str] = field(default_factory=list)  # blocks whose experts are one module


@dataclass
class CheckResult:
    run_dir: Path
    baseline: PlanResult
    found: Found | None
    results: list[PlanResult] = field(default_factory=list)
    diagnoses: dict[str, Diagnosis] = field(default_factory=dict)  # plan name -> its own
    compared: bool = False  # a reference was given: the clean runs were compared with it
    # no router seen, and torch.compile ran: the routers are inside compiled graphs
    compiled: bool = False

    @property
    def runs(self) -> list[PlanResult]:
        return [self.baseline, *self.results]

    @property
    def reproduced(self) -> list[PlanResult]:
        return [r for r in self.runs if r.reproduced]

    @property
    def differs(self) -> list[PlanResult]:
        return [r for r in self.runs if r.differs]

    @property
    def uncompared(self) -> list[PlanResult]:
        return [r for r in self.runs if r.uncompared]

    @property
    def exit_code(self) -> int:
        return EXIT_PROBLEM if self.reproduced else EXIT_VERIFY_FAILED if self.differs \
            else EXIT_OK

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "run_dir": str(self.run_dir),
                "baseline": self.baseline.to_dict(),
                "routers": None if self.found is None else {
                    "blocks": self.found.blocks, "experts": self.found.experts,
                    "fused": self.found.fused,
                    "steps": self.found.steps, "world": self.found.world},
                "compiled": self.compiled,
                "plans": [r.to_dict() for r in self.results],
                "untried": list(UNTRIED), "reproduced": len(self.reproduced),
                "compared": self.compared, "differs": len(self.differs),
                "uncompared": len(self.uncompared),
                "exit_code": self.exit_code}


# ragged counts: the share of its tokens the NeMo Automodel report's rank 0 had (68 of 401)
RAGGED = 68 / 401


def plans_for(found: Found, max_plans: int) -> list[Plan]:
    """On the last rank, at the step after the first: the first expert starved, then on rank
    0 too (the mirror: the culprit must move with it), ragged counts, no token at all, the
    other experts starved, every token's first choice one expert; the first ``max_plans``
    (past them, the experts spread, first and last kept)."""
    step = 1 if found.steps > 1 else 0
    last = found.world - 1
    at = f"on rank {last} at step {step}"

    def starve(e: int, rank: int = last) -> Plan:
        return Plan(f"starve-e{e}-r{rank}", f"no token to expert {e} on rank {rank} at step "
                    f"{step}", rank, step, starve=e)

    head = [starve(0), *([starve(0, 0)] if last > 0 else []),
            Plan(f"ragged-r{last}", f"{RAGGED:.0%} of its tokens into each block {at}", last,
                 step, keep=RAGGED),
            Plan(f"no-token-r{last}", f"no token into any block {at}", last, step, keep=0.0)]
    crowd = Plan(f"all-to-e0-r{last}", f"every token's first choice expert 0 {at}", last, step,
                 all_to=0)
    others = list(range(1, found.experts))
    room = max(0, max_plans - len(head) - 1)
    if len(others) > room:  # spread over the experts, the last included
        others = sorted({others[round(i * (len(others) - 1) / max(1, room - 1))]
                         for i in range(room)}) if room else []
    return [*head, *(starve(e) for e in others), crowd][:max_plans]
