"""``moe-hang check --html FILE``: one self-contained page for a check — the answer, a row per
run (plan, verdict, culprit, the data decision), and for each run that reproduced a problem its
own report page beside its run directory (``report.html``), linked from the row."""

from __future__ import annotations

import os
from html import escape
from pathlib import Path

from moe_hang.analysis.diagnosis import Diagnosis
from moe_hang.analysis.plans import UNTRIED, CheckResult, PlanResult
from moe_hang.evidence.vocab import who
from moe_hang.probe.env import write_atomic
from moe_hang.report.check import check_screen
from moe_hang.report.html import CSS, save_html
from moe_hang.report.words import ReportContext

REPORT = "report.html"  # each reproducing run's own page, in its run directory


def _e(text: object) -> str:
    return escape(str(text), quote=True)


def _row(r: PlanResult, page: Path, linked: bool) -> str:
    name = "baseline" if r.plan is None else r.plan.name
    what = "routing untouched" if r.plan is None else r.plan.describe
    if r.plan is not None and not r.planned:
        what += " (never applied: no router call at that step)"
    cls = "bad" if r.reproduced or r.differs else "good" if r.verdict == "healthy" else "warn"
    verdict = "differs from the reference" if r.differs else r.verdict
    target = Path(r.run_dir) / REPORT if linked else Path(r.run_dir)
    href = os.path.relpath(target, page.parent)
    return (f'<tr><td><a href="{_e(href)}">{_e(name)}</a></td><td>{_e(what)}</td>'
            f'<td class="{cls}">{_e(verdict)}</td>'
            f"<td>{_e(who(r.culprits) if r.culprits else '')}</td>"
            f"<td>{_e(r.routing or '')}</td><td>{r.wall_s:.1f}</td></tr>")


def save_check_html(res: CheckResult, diagnoses: dict[str, Diagnosis], page: Path) -> None:
    """The page at ``page``; each reproducing run's report beside its run directory."""
    linked: set[str] = set()
    for r in [res.baseline, *res.results]:
        name = "baseline" if r.plan is None else r.plan.name
        d = diagnoses.get(name)
        if d is not None and r.reproduced:
            save_html(d, ReportContext("check", f"moe-hang check: {name}"),
                      Path(r.run_dir) / REPORT)
            linked.add(name)
    head = check_screen(res, 100)[0].plain
    rows = "".join(_row(r, page, ("baseline" if r.plan is None else r.plan.name) in linked)
                   for r in [res.baseline, *res.results])
    cls = "bad" if res.reproduced else "good"
    body = (f'<h1 id="verdict" class="{cls}">{_e(head)}</h1>'
            "<table class=\"ranks\"><thead><tr><th>run</th><th>plan</th><th>verdict</th>"
            "<th>culprit</th><th>routing</th><th>s</th></tr></thead><tbody>"
            f"{rows}</tbody></table>"
            f'<p class="dim">not tried: {_e("; ".join(UNTRIED))}. Run directory: '
            f"<code>{_e(res.run_dir)}</code> (<code>check.json</code>).</p>")
    html = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(head)}</title><style>{CSS}</style></head><body>\n{body}\n"
            "</body></html>\n")
    write_atomic(page, html.encode())
