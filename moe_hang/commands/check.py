"""``moe-hang check -- COMMAND``: the user's own MoE job run under adversarial routing plans;
each plan reproduces the hang or runs clean.

First a baseline run under watch, routing untouched: it finds the job's routers (probe/
routing.py), how many experts each has, and how many steps the job takes; a job that already
fails there is reported as it is, with no plan tried. Then one watched run per plan, each
bounded (``--timeout``): on one rank, at the step after the first (so the first runs as the
job would), every expert starved in turn, the first one starved on another rank too (the
mirror: the culprit must move with it), and every token's first choice sent to one expert.
What the router does not decide (a rank with no token at all, ragged batch sizes, a different
number of micro-batches) is the data's, and is said to be untried.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe_hang.analysis.diagnosis import Diagnosis
from moe_hang.analysis.plans import PROBLEMS, CheckResult, Found, Plan, PlanResult, plans_for
from moe_hang.commands.session import Phase
from moe_hang.commands.supervise import WatchOptions
from moe_hang.commands.watch import watch_command
from moe_hang.errors import MoeHangError
from moe_hang.evidence.routing import RouterCall, read_routing
from moe_hang.probe import routing
from moe_hang.probe.layout import RunLayout
from moe_hang.runtime import rundir
from moe_hang.settings import Settings


def found_in(layout: RunLayout) -> Found | None:
    """The routers a watched run's ranks counted (their routing files); None: no router."""
    calls: dict[int, list[RouterCall]] = {}
    for r in sorted(layout.rank_numbers()):
        got = read_routing(layout.rank(r).routing).calls
        if got:
            calls[r] = got
    if not calls:
        return None
    every = [c for cs in calls.values() for c in cs]
    return Found(world=len(layout.rank_numbers()), steps=max(c.step for c in every) + 1,
                 blocks=list(dict.fromkeys(c.block for c in every)),
                 experts=max(len(c.counts) for c in every),
                 fused=list(dict.fromkeys(c.block for c in every if c.fused)))


def compiled_in(layout: RunLayout) -> bool:
    """A rank saw no router and torch.compile compiled its code (probe/routing.py)."""
    return any(read_routing(layout.rank(r).routing).compiled for r in layout.rank_numbers())


def plan_env(plan: Plan) -> tuple[tuple[str, str], ...]:
    return ((routing.ENV_PLAN, json.dumps(plan.to_dict())),)


def _result(plan: Plan | None, res: Any, wall: float) -> PlanResult:
    d: Diagnosis | None = res.diagnosis
    verdict = d.verdict if d is not None else "no-ranks"
    gap = None
    planned = False
    if d is not None and verdict in PROBLEMS:
        gap = d.routing_sentence()
    if plan is not None:  # the plan's calls are kept in its rank's file, applied or not
        planned = any(c.planned for c in read_routing(res.run_dir.rank(plan.rank).routing).calls)
    return PlanResult(plan, str(verdict), res.exit_code, d.summary if d is not None else
                      "the job exited before any rank started", sorted(d.culprit_ranks)
                      if d is not None else [], str(res.run_dir.root), round(wall, 1), gap,
                      planned)


def check_command(cmd: list[str], say: Phase, *, settings: Settings, out: str | None = None,
                  stall_s: float = 5.0, timeout_s: float = 300.0, max_plans: int = 8,
                  command: list[str] | None = None,
                  echo: Callable[[str], None] = lambda _: None) -> CheckResult:
    if max_plans < 1:
        raise MoeHangError(f"--plans {max_plans}: must be at least 1")
    root = rundir.create(out, "check").resolve()
    rundir.write_json(RunLayout(root).meta, rundir.meta(command or ["moe-hang", "check"],
                                                      {"job_command": cmd}))

    def one(plan: Plan | None, index: int) -> tuple[PlanResult, Diagnosis | None]:
        name = "baseline" if plan is None else plan.name
        what = "routing untouched" if plan is None else plan.describe
        say(f"[{index}] {name}: {what}")
        t0 = time.monotonic()
        res = watch_command(cmd, lambda s: say(f"[{index}] {name}: {s}"), echo,
                            out=str(root / f"{index:02d}-{name}"), command=command,
                            options=WatchOptions(stall_s=stall_s, hang_after_s=stall_s * 3,
                                                 env=() if plan is None else plan_env(plan),
                                                 limit_s=timeout_s, timings=settings))
        return _result(plan, res, time.monotonic() - t0), res.diagnosis

    base, diag = one(None, 0)
    found = found_in(RunLayout(Path(base.run_dir)))
    result = CheckResult(root, base, found,
                         compiled=found is None and compiled_in(RunLayout(Path(base.run_dir))))
    if diag is not None:
        result.diagnoses["baseline"] = diag
    if found is not None and not base.reproduced and base.verdict != "no-ranks":
        for i, plan in enumerate(plans_for(found, max_plans), start=1):
            r, d = one(plan, i)
            result.results.append(r)
            if d is not None:
                result.diagnoses[plan.name] = d
    rundir.write_json(root / "check.json", result.to_dict())
    return result
