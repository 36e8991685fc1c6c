"""``moe-hang check``'s first screen: did any plan reproduce a hang, which, on which rank and
expert; then one line per plan, what was not tried, and the next command (at most 15 rows at
80 columns: the plans' lines are folded first)."""

from __future__ import annotations

from rich.text import Text

from moe_hang.analysis.plans import UNTRIED, CheckResult, PlanResult
from moe_hang.evidence.vocab import who
from moe_hang.report.screen import MAX_LINES
from moe_hang.report.wrap import clip, screen_lines, shorten_paths, wrap


def _plan_line(r: PlanResult) -> Text:
    ok = not r.reproduced and r.verdict == "healthy"
    line = Text("  ")
    line.append(f"{'ok' if ok else r.verdict.upper():<9}",
                style="bold green" if ok else "bold red" if r.reproduced else "bold yellow")
    culprit = who(r.culprits) if r.culprits else ""
    line.append(f" {culprit:<8} ")
    what = r.plan.describe if r.plan is not None else "routing untouched"
    if r.plan is not None and not r.planned:
        what += " (never applied: no router call at that step)"
    line.append(what)
    return line


def check_screen(res: CheckResult, width: int) -> list[Text]:
    n = len(res.results)
    base = res.baseline
    if base.reproduced:
        head = Text(f"moe-hang check: {base.verdict.upper()} with routing untouched "
                    "(no plan tried)", style="bold red")
    elif res.found is None:
        head = Text("moe-hang check: no MoE router found (nothing to plan)", style="bold yellow")
    elif res.reproduced:
        kinds = ", ".join(dict.fromkeys(r.verdict for r in res.reproduced))
        head = Text(f"moe-hang check: REPRODUCED by {len(res.reproduced)} of {n} plans "
                    f"({kinds})", style="bold red")
    else:
        head = Text(f"moe-hang check: every plan ran clean ({n} of {n})", style="bold green")
    lines = wrap(head, width, hang=2)
    if res.found is None and not base.reproduced:
        lines += wrap(Text(
            "no module with `experts` and a `gate`/`router` child ran (name one: --router "
            "pkg.mod.Class)", style="dim"), width, hang=2)
    elif res.found is not None:
        f = res.found
        lines += wrap(Text(f"found {len(f.blocks)} MoE block(s) x {f.experts} experts; "
                           f"{f.world} ranks, {f.steps} steps a run", style="dim"),
                      width, hang=2)
    first = res.reproduced[0] if res.reproduced else None
    detail: list[Text] = []
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
        tail += wrap(Text("not tried: " + ", ".join(UNTRIED), style="dim"), width, hang=2)
    nxt = Text("next: ", style="bold")
    nxt.append(f"moe-hang analyze {first.run_dir}" if first is not None
               else f"details in {res.run_dir}/check.json", style="cyan")
    tail += wrap(nxt, width, hang=6)
    plans = [_plan_line(r) for r in [base, *res.results]]
    room = MAX_LINES - screen_lines(lines + detail + tail, width)
    if screen_lines(plans, width) > room:  # the clean runs folded into one line, then more
        runs = [base, *res.results]
        bad = [p for p, r in zip(plans, runs, strict=True) if r.verdict != "healthy"]
        clean = [r for r in runs if r.verdict == "healthy"]
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
