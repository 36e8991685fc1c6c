"""The first screen of every command's result: the answer at once, at most 15 rows at 80
columns.

verdict (and certainty when not definite) · one sentence · the culprit(s) and why · each
rank's call site, grouped · the fix (and a snippet to paste) · the next command · the run
directory. Everything else (ranks table, timeline, stacks, evidence, the reference) is the
detail (:mod:`moe_hang.report.console`): ``--verbose``, ``console.log`` and the HTML page.

Sections are wrapped at word boundaries to the console's width; when they do not fit, the
longest ones lose lines (ending in "…") until they do. Nothing here knows how a verdict is
reached: it reads the :class:`Diagnosis` and falls back quietly where a field is not filled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rich.text import Text

from moe_hang.analysis.diagnosis import (
    Certainty,
    Diagnosis,
    Verdict,
)
from moe_hang.analysis.runs import ScenarioRun
from moe_hang.evidence.vocab import who
from moe_hang.report.words import (
    MAX_SITE_GROUPS,
    ReportContext,
    culprit_words,
    fix_words,
    next_words,
    run_words,
    site_groups,
)
from moe_hang.report.wrap import clip, screen_lines, shorten_paths, wrap

MAX_LINES = 15

VERDICT_STYLE = {
    Verdict.DESYNC: "bold red", Verdict.HANG: "bold red", Verdict.CRASH: "bold red",
    Verdict.RANK_DIED: "bold red", Verdict.STRAGGLER: "bold yellow",
    Verdict.INCONCLUSIVE: "bold yellow", Verdict.HEALTHY: "bold green",
    Verdict.TRANSPORT_HANG: "bold red",
}


@dataclass
class Screen:
    lines: list[Text] = field(default_factory=list)
    clipped: bool = False  # a section lost lines to fit: the detail repeats it in full


@dataclass
class _Section:
    """Lines of the first screen and how to make them shorter (``None``: as short as it
    gets)."""

    lines: list[Text]
    shorter: Callable[[], list[Text] | None] | None = None
    first: bool = False  # shortened before any other (what is not the answer)
    # shorter still, once nothing else can be (what the answer keeps whole while it can)
    last: Callable[[], list[Text] | None] | None = None


def _clippable(lines: list[Text], width: int, keep: int) -> _Section:
    """A paragraph that may lose lines from its end, down to ``keep``."""
    section = _Section(lines)

    def shorter() -> list[Text] | None:
        n = len(section.lines)
        return clip(section.lines, n - 1, width) if n > keep else None

    section.shorter = shorter
    return section


# ----------------------------------------------------------------------------- words


# ----------------------------------------------------------------------------- sections


def headline(d: Diagnosis, ctx: ReportContext) -> Text:
    style = VERDICT_STYLE.get(d.verdict, "bold")
    label = d.verdict.upper()
    run = d.run if isinstance(d.run, ScenarioRun) else None
    if run is not None and run.variant == "fixed" and run.verified is not None:
        label, style = (("VERIFIED", "bold green") if run.verified
                        else (f"NOT VERIFIED ({d.verdict})", "bold red"))
    elif run is not None and run.verified is not None:  # verify without --fixed
        label, style = (
            ("regression check passed: the broken variant still reproduces",
             "bold green") if run.verified else
            (f"NOT VERIFIED: the broken variant no longer reproduces ({d.verdict})",
             "bold red"))
    elif run is not None and run.reproduced is False:
        label += " (not reproduced)"
    elif d.rule and d.certainty != Certainty.DEFINITE:
        # the verdict engine names its rule when it sets certainty; without one the
        # certainty is the schema's default, not a judgement
        label += f" ({d.certainty})"
    return Text(f"{ctx.title}: {label}", style=style)


def _culprit_line(d: Diagnosis) -> Text | None:
    words = culprit_words(d)
    if words is None:
        return None
    label, names, why = words
    line = Text(f"{label}: ", style="bold")
    line.append(names, style="bold red")
    if why:
        line.append(f" ({why})")
    return line


def _site_lines(groups: list[tuple[list[int], str, bool]], shown: int,
                width: int, fold: bool = True) -> list[Text]:
    out: list[Text] = []
    for members, phrase, culprit in groups[:shown]:
        line = Text(who(members), style="bold red" if culprit else "bold")
        line.append(f" {phrase}")
        out += wrap(line, width, indent=2, hang=4)
    rest = groups[shown:]
    if rest and fold:
        n = sum(len(m) for m, _, _ in rest)
        out += wrap(Text(f"… and {n} more rank(s) in {len(rest)} other place(s) (--verbose)",
                         style="dim"), width, indent=2, hang=4)
    return out


def _sites_section(d: Diagnosis, width: int) -> _Section | None:
    """One line (or two) per group. Shorter: ranks differing only in sizes merged, then the
    last groups folded into "… and N more", at last that line too (the detail has them)
    — never a group's line cut."""
    full = site_groups(d)
    if not full:
        return None
    merged = site_groups(d, merge_sizes=True)
    base = merged if len(merged) < len(full) else full
    stages = [_site_lines(full, min(len(full), MAX_SITE_GROUPS), width)]
    if base is merged:
        stages.append(_site_lines(merged, min(len(merged), MAX_SITE_GROUPS), width))
    stages += [_site_lines(base, n, width)
               for n in range(min(len(base), MAX_SITE_GROUPS) - 1, 0, -1)]
    if len(base) > 1:  # last: the first group alone, the count of the rest in the detail
        stages.append(_site_lines(base, 1, width, fold=False))
    section = _Section(stages[0])
    rest = iter(stages[1:])
    section.shorter = lambda: next(rest, None)
    return section


def _routing_section(d: Diagnosis, width: int) -> _Section | None:
    """The data decision at the step the job stopped in: ranks that sent different numbers
    of tokens into a block (beside a size mismatch), or an expert some ranks starved; only
    beside a problem."""
    r, sentence = d.routing, d.routing_sentence()
    if r is None or sentence is None:
        return None
    line = Text("routing: ", style="bold")
    line.append(sentence)
    more = len(r.gaps) + len(r.ragged) - 1
    if more > 0:
        line.append(f"; {more} more at that step (--verbose)", style="dim")
    # the data decision is the answer an MoE user asks first: whole (two rows at 80 columns)
    # before the sites or the fix lose a line for it
    lines = wrap(line, width, hang=2)
    section = _clippable(lines, width, keep=min(len(lines), 2))
    section.last = lambda: clip(section.lines, 1, width) if len(section.lines) > 1 else None
    return section


def _fix_sections(d: Diagnosis, width: int) -> list[_Section]:
    words = fix_words(d)
    if words is None:
        return []
    label, hint, code = words
    line = Text(f"{label}: ", style="bold green")
    line.append(hint)
    out = [_clippable(wrap(line, width, hang=2), width, keep=2)]
    if code:
        # pasted as is: never re-wrapped (a long line wraps on the terminal, whole)
        lines = [Text("    " + c, style="cyan") for c in code.rstrip("\n").split("\n")]
        out.append(_clippable(lines, width, keep=min(len(lines), 4)))
    return out


def _next_line(d: Diagnosis, ctx: ReportContext, width: int, why: bool = True) -> list[Text]:
    words = next_words(d, ctx)
    if words is None:
        return []
    what, because = words
    line = Text("next: ", style="bold")
    line.append(what, style="cyan")
    if because and why:
        line.append(f" ({because})")
    return wrap(line, width, hang=6)


def _run_line(d: Diagnosis, ctx: ReportContext, width: int, verbose: bool) -> list[Text]:
    text = run_words(d, ctx)
    if not text:
        return []
    if not verbose:
        text += " · details: --verbose" + (", console.log" if d.artifacts and
                                           ctx.command != "analyze" else "")
    return wrap(Text(text, style="dim"), width, hang=2)


def first_screen(d: Diagnosis, ctx: ReportContext, width: int, *,
                 verbose: bool = False) -> Screen:
    """The answer, at most :data:`MAX_LINES` terminal rows at ``width`` columns."""
    sections = [_Section(wrap(headline(d, ctx), width, hang=2)),
                _clippable(wrap(shorten_paths(d.summary), width), width, keep=2)]
    culprit = _culprit_line(d)
    if culprit is not None:
        sections.append(_clippable(wrap(culprit, width, hang=2), width, keep=1))
    sites = _sites_section(d, width)
    if sites is not None:
        sections.append(sites)
    routing = _routing_section(d, width)
    if routing is not None:
        sections.append(routing)
    sections += _fix_sections(d, width)
    nxt = _next_line(d, ctx, width)
    if nxt:
        # shorter: the command or line alone (the function and rank it names are above)
        bare_next = iter([_next_line(d, ctx, width, why=False)])
        sections.append(_Section(nxt, lambda: next(bare_next, None)))
    run = _run_line(d, ctx, width, verbose)
    if run:
        # a long run directory: the details hint goes before any line of the answer
        bare = iter([_run_line(d, ctx, width, verbose=True)])  # once: then as short as it gets
        sections.append(_Section(run, lambda: next(bare, None), first=True))
    clipped = _fit(sections, width)
    return Screen([line for s in sections for line in s.lines], clipped)


def _fit(sections: list[_Section], width: int) -> bool:
    """Shorten the longest sections that can be, one line at a time, until all fit."""
    clipped = False
    while screen_lines([x for s in sections for x in s.lines], width) > MAX_LINES:
        # what is not the answer first, then the longest; of two as long, the later one (the
        # summary outranks the fix's prose: its "in full" is in the detail)
        order = sorted(enumerate(sections), key=lambda x: (not x[1].first, -len(x[1].lines),
                                                            -x[0]))
        for _, s in order:
            shorter = s.shorter() if s.shorter is not None else None
            if shorter is not None:
                s.lines = shorter
                clipped = True
                break
        else:
            for _, s in order:  # then what the answer keeps whole while it can, once each
                got = s.last() if s.last is not None else None
                s.last = None
                if got is not None:
                    s.lines, clipped = got, True
                    break
            else:
                return clipped  # only what is never shortened is left (a very narrow console)
    return clipped


def next_verify_command(opts: dict[str, object], defaults: dict[str, object],
                        run: ScenarioRun | None) -> list[str]:
    """``moe-hang verify --fixed`` with the scenario options the user changed (not the
    per-run ones: --out, --html, --json, --port), and ``--fix`` when another fix is
    recommended than the scenario's default."""
    argv = ["moe-hang", "verify", "--fixed"]
    for name, value in opts.items():
        if name in ("out", "html", "as_json", "port", "verbose") or value == defaults.get(name):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                argv.append(flag)
        elif value is not None:
            argv += [flag, str(value)]
    if run is not None and run.recommended_fix and run.recommended_fix != run.fix:
        argv += ["--fix", run.recommended_fix]
    return argv
