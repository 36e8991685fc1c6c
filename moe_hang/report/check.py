"""``moe-hang check``'s first screen: did any plan reproduce a hang, which, on which rank and
expert; then one line per plan, what was not tried, and the next command (at most 15 rows at
80 columns: the plans' lines are folded first)."""

from __future__ import annotations

from pathlib import Path

from rich.text import Text

from moe_hang.analysis.plans import UNTRIED, CheckResult, PlanResult
from moe_hang.evidence.vocab import who
from moe_hang.probe.layout import RunLayout
from moe_hang.report.screen import MAX_LINES
from moe_hang.report.wrap import clip, screen_lines, shorten_paths, wrap


def _plan_line(r: PlanResult) -> Text:
    ok = not r.reproduced and r.verdict == "healthy" and not r.differs
    line = Text("  ")
    word = "ok" if ok else "DIFFERS" if r.differs else r.verdict.upper()
    line.append(f"{word:<9}", style="bold green" if ok else "bold red"
                if r.reproduced or r.differs else "bold yellow")
    culprit = who(r.culprits) if r.culprits else ""
    line.append(f" {culprit:<8} ")
    what = r.plan.describe if r.plan is not None else "routing untouched"
    if r.plan is not None and not r.planned:
        what += " (never applied: no router call at that step)"
    if r.uncompared:
        what += " (not compared)"
    line.append(what)
    return line


def check_screen(res: CheckResult, width: int) -> list[Text]:
    n = len(res.results)
    base = res.baseline
    if base.reproduced:
        head = Text(f"moe-hang check: {base.verdict.upper()} with routing untouched "
                    "(no plan tried)", style="bold red")
    elif res.found is None and res.compiled:
        head = Text("moe-hang check: no MoE router seen outside torch.compile's graphs "
                    "(nothing to plan)", style="bold yellow")
    elif res.found is None:
        head = Text("moe-hang check: no MoE router found (nothing to plan)", style="bold yellow")
    elif res.reproduced:
        kinds = ", ".join(dict.fromkeys(r.verdict for r in res.reproduced))
        head = Text(f"moe-hang check: REPRODUCED by {len(res.reproduced)} of {n} plans "
                    f"({kinds})", style="bold red")
    elif res.differs:
        head = Text(f"moe-hang check: DIFFERS from the single-process reference in "
                    f"{len(res.differs)} of {n + 1} runs", style="bold red")
    elif res.compared:
        worst = max((r.reference.max_rel_err for r in res.runs if r.reference), default=0.0)
        left = len(res.uncompared)
        matched = (f"and matches the single-process reference (max rel err {worst:.1e})"
                   if not left else f"; {n + 1 - left} of {n + 1} runs match the single-process "
                   f"reference (max rel err {worst:.1e}), {left} could not be compared")
        head = Text(f"moe-hang check: every plan ran clean ({n} of {n})"
                    f"{' ' if not left else ''}{matched}",
                    style="bold green" if not left else "bold yellow")
    else:
        head = Text(f"moe-hang check: every plan ran clean ({n} of {n})", style="bold green")
    lines = wrap(head, width, hang=2)
    if res.found is None and res.compiled and not base.reproduced:
        lines += wrap(Text(
            "torch.compile ran in the job and no router ran outside its graphs, where "
            "nothing can count or re-route one: they may be inside them (without compile the "
            "routing and its collectives are the model's own), or have another shape (name "
            "yours: --router pkg.mod.Class)", style="dim"), width, hang=2)
    elif res.found is None and not base.reproduced:
        lines += wrap(Text(
            "no module with `experts` and a `gate`/`router` child ran (name one: --router "
            "pkg.mod.Class)", style="dim"), width, hang=2)
    elif res.found is not None:
        f = res.found
        fused = ("" if not f.fused else ", every expert of a block in one module (fused)"
                 if len(f.fused) == len(f.blocks) else f", {len(f.fused)} with fused experts")
        lines += wrap(Text(f"found {len(f.blocks)} MoE block(s) x {f.experts} experts{fused}; "
                           f"{f.world} ranks, {f.steps} steps a run", style="dim"),
                      width, hang=2)
    first = res.reproduced[0] if res.reproduced else None
    detail: list[Text] = []
    wrong = res.differs[0] if res.differs and first is None else None
    odd = res.uncompared[0] if res.uncompared and first is None and wrong is None else None
    if odd is not None and odd.reference is not None:
        name = "baseline" if odd.plan is None else odd.plan.name
        detail += clip(wrap(Text(f"{name}: not compared, the single-process reference "
                                 f"itself failed {odd.reference.error}"), width, hang=2), 3,
                       width)
    if wrong is not None and wrong.reference is not None:
        name = "baseline" if wrong.plan is None else wrong.plan.name
        why = "; ".join(wrong.reference.failures[:2]) or "nothing compared"
        detail += clip(wrap(Text(f"{name}: every step finished, not as the single-process "
                                 f"reference did: {why}"), width, hang=2), 3, width)
    if first is not None:
        name = "baseline" if first.plan is None else first.plan.name
        detail += clip(wrap(Text(f"{name}: {shorten_paths(first.summary)}"), width, hang=2),
                       3, width)
        if first.routing:
            t = Text("routing: ", style="bold")
            t.append(first.routing)
            detail += wrap(t, width, hang=2)
    tail: list[Text] = []
    if res.found is not None and not base.reproduced:
        untried = list(UNTRIED) + ([] if res.compared or res.reproduced else [
            "outputs and gradients against a single-process reference (moe_hang.check(..., "
            "reference=build_reference))"])
        tail += wrap(Text("not tried: " + "; ".join(untried), style="dim"), width, hang=2)
    nxt = Text("next: ", style="bold")
    nxt.append(f"moe-hang analyze {first.run_dir}" if first is not None
               else "the check again with TORCH_COMPILE_DISABLE=1 in its environment"
               if res.found is None and res.compiled and not base.reproduced
               else f"details in {RunLayout(Path(wrong.run_dir)).reference}"
               if wrong is not None
               else f"details in {RunLayout(res.run_dir).reference_log}" if odd is not None
               else f"details in {res.run_dir}/check.json", style="cyan")
    tail += wrap(nxt, width, hang=6)
    plans = [_plan_line(r) for r in [base, *res.results]]
    room = MAX_LINES - screen_lines(lines + detail + tail, width)
    if screen_lines(plans, width) > room:  # the clean runs folded into one line, then more
        runs = [base, *res.results]
        bad = [p for p, r in zip(plans, runs, strict=True) if r.verdict != "healthy"
               or r.differs or r.uncompared]
        clean = [r for r in runs if r.verdict == "healthy" and not r.differs
                 and not r.uncompared]
        words = ["the baseline"] if base in clean else []
        rest = len(clean) - len(words)
        words += [f"{rest} other plan(s)"] if rest else []
        fits = len(bad) + bool(clean) <= room
        shown = bad if fits else bad[:max(1, room - 1 - bool(clean))]
        plans = [*shown] + ([Text(f"  … and {len(bad) - len(shown)} more (check.json)",
                                  style="dim")] if len(bad) > len(shown) else [])
        if clean:
            plans.append(Text(f"  {'ok':<9} {'':<8} " + " and ".join(words), style="dim"))
    return lines + plans + detail + tail
