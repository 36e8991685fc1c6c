"""Render a :class:`~moe_hang.analysis.diagnosis.Diagnosis` for a person on a terminal.

The first screen (:mod:`moe_hang.report.screen`) always; the detail — ranks, the timeline,
stacks, the single-process reference, evidence, timings — with ``--verbose``, and always in
``console.log`` (:data:`LOG_WIDTH` columns). Every line breaks at whitespace only.
"""

from __future__ import annotations

import errno
import io
import os
import sys
from typing import TextIO

from rich import box
from rich.cells import cell_len
from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from moe_hang.analysis.diagnosis import (
    Diagnosis,
    RankReport,
    Timeline,
    Verdict,
    fmt_shape,
    pg_label,
)
from moe_hang.analysis.routing import gap_sentence, ragged_sentence
from moe_hang.analysis.runs import ReferenceReport, ScenarioRun
from moe_hang.evidence.errors import without_build_paths
from moe_hang.evidence.ops import short_op
from moe_hang.evidence.rankid import rank_name
from moe_hang.evidence.vocab import RankState
from moe_hang.report.screen import first_screen
from moe_hang.report.words import (
    ReportContext,
    collective_text,
    exit_words,
    site_text,
    timing_parts,
    tokens_text,
)
from moe_hang.report.wrap import display_path, shorten_paths, wrap

LOG_WIDTH = 120  # console.log: one fixed width, whatever terminal the run had
STACK_DEPTH = 8  # user frames per rank (torch's own are folded)

__all__ = ["LOG_WIDTH", "clean_evidence", "details", "display_path", "make_console",
           "render", "render_text"]


def make_console(*, file: TextIO | None = None, width: int | None = None) -> Console:
    """A console for the report: a terminal keeps its own width; a pipe or a file gets
    ``$COLUMNS`` or 80 (what the first screen is made for)."""
    stream = file if file is not None else sys.stdout
    if width is None and not stream.isatty():
        cols = os.environ.get("COLUMNS", "")
        width = int(cols) if cols.isdigit() and int(cols) > 20 else 80
    return _Console(file=stream, width=width, highlight=False, soft_wrap=True)


class _Console(Console):
    """rich's console, whose reader closing the pipe (``| head``) is the caller's to handle:
    rich's own way exits 1, which would take the verdict's exit code with it."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError(errno.EPIPE, "the reader closed the pipe")


def clean_evidence(line: str, limit: int = 220) -> str:
    """Drop build-machine source paths from gloo/NCCL messages; keep what they say."""
    line = without_build_paths(line)
    return line if len(line) <= limit else line[: limit - 1] + "…"


# ----------------------------------------------------------------------------- detail


def _heading(text: str) -> Text:
    return Text(text, style="bold")


def _rank_block(r: RankReport, culprit: bool, width: int) -> list[Text]:
    head = Text(rank_name(r.rank), style="bold red" if culprit else "bold")
    phase = f" ({r.phase})" if r.phase else ""
    if r.state == RankState.EXITED:
        state = exit_words(r.exit_code) + phase
    else:
        state = f"{r.state}{phase}" + (f", {exit_words(r.exit_code)}"
                                       if r.exit_code is not None else "")
    head.append(f"  pid {r.pid or '-'}" + (f" on {r.host}" if r.host else "") + f"  {state}")
    lines = wrap(head, width, indent=2, hang=6)
    facts: list[str] = []
    if r.collective is not None:
        facts.append(f"collective {collective_text(r.collective)}"
                     + (f" ({r.collective.tag})" if r.collective.tag else ""))
    if r.callsite is not None:
        facts.append(f"at {site_text(r.callsite)}")
    if r.autograd_function:
        facts.append(f"inside {r.autograd_function}.backward")
    if r.tokens:
        facts.append(f"tokens {tokens_text(r.tokens)}")
    if r.note:
        facts.append(f"note: {shorten_paths(clean_evidence(r.note))}")
    for f in facts:
        lines += wrap(f, width, indent=4, hang=6)
    return lines


def divergence_lines(d: Diagnosis, width: int) -> list[Text]:
    """Where the ranks first disagree: kind, group, sequence number, phase."""
    fd = d.first_divergence
    if fd is None:
        return []
    pg = ("an unknown group" if fd.pg == "?" and not fd.pg_desc
          else pg_label(fd.pg, fd.pg_desc))
    line = _heading("first divergence: ")
    line.append(f"{fd.kind} at {pg} " + (f"seq {fd.seq}" if fd.seq is not None
                                          else "(stacks only)")
                + (f" ({fd.phase})" if fd.phase else "")
                + (f", members {', '.join(map(str, fd.members))}"
                   if fd.members and fd.pg != "0" else ""))
    return wrap(line, width, hang=2)


def ranks_lines(d: Diagnosis, width: int) -> list[Text]:
    if not d.ranks:
        return []
    culprits = set(d.culprit_ranks)
    out = [_heading("ranks")]
    for r in sorted(d.ranks, key=lambda r: r.rank):
        out += _rank_block(r, r.rank in culprits, width)
    return out


def timeline_window(tl: Timeline, width: int) -> list[int]:
    """The indices of the sequence numbers that fit ``width``: the diverging one, then as
    many of its neighbours as fit (earlier ones first: they show how the ranks got there)."""
    def col_width(i: int) -> int:
        cells = [c for cs in tl.ranks.values() for c in cs[i:i + 1] if c is not None]
        texts = [timeline_label(c.op, c.sizes) for c in cells] + [f"▶{tl.seqs[i]}"]
        return max(cell_len(t) for t in texts) + 2

    n = len(tl.seqs)
    hi = tl.seqs.index(tl.highlight) if tl.highlight in tl.seqs else n - 1
    budget = width - 8  # the rank column
    left = right = hi
    used = col_width(hi)
    grown = True
    while grown:  # one column to each side per round, while it fits: a contiguous window
        grown = False
        for i in (left - 1, right + 1):
            if 0 <= i < n and used + col_width(i) <= budget:
                used += col_width(i)
                left, right = min(left, i), max(right, i)
                grown = True
    return list(range(left, right + 1))


def timeline_label(op: str, sizes: list[list[int]]) -> str:
    s = fmt_shape(sizes)
    return short_op(op) if not s else f"{short_op(op)} {s}"


def timeline_table(d: Diagnosis, width: int) -> list[RenderableType]:
    """Ranks as rows, the group's sequence numbers as columns, the diverging one marked."""
    tl = d.timeline
    if tl is None or not tl.seqs or d.verdict == Verdict.HEALTHY:
        return []
    idx = timeline_window(tl, width)
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    t.add_column("rank", style="bold", no_wrap=True)
    for i in idx:
        s = tl.seqs[i]
        t.add_column(f"[bold red]▶{s}[/]" if s == tl.highlight else str(s), justify="center",
                     no_wrap=True)
    for r, cells in sorted(tl.ranks.items()):
        row: list[RenderableType] = [str(r)]
        for i in idx:
            c = cells[i] if i < len(cells) else None
            hi = tl.seqs[i] == tl.highlight
            if c is None:
                row.append(Text("—", style="bold red" if hi else "red"))
                continue
            if c.state == "unknown":  # posted, not in its evidence
                row.append(Text("?", style="dim italic"))
                continue
            style = "yellow" if c.state == "pending" else "dim"
            if hi:
                style = "bold red" if c.state == "pending" else "bold"
            row.append(Text(timeline_label(c.op, c.sizes), style=style))
        t.add_row(*row)
    title = Text.from_markup(f"[bold]collectives of {pg_label(tl.pg, tl.pg_desc)} by sequence "
                             "number[/] (done · [yellow]pending[/] · [red]missing[/] · ? posted, "
                             "not in its evidence)")
    out: list[RenderableType] = [*wrap(title, width), t]
    hidden = len(tl.seqs) - len(idx)
    if hidden:
        out.append(Text(f"  ({hidden} more sequence numbers in console.log and the HTML)",
                        style="dim"))
    return out


def _frame(s: str) -> str:
    path, _, rest = s.partition(":")
    return f"{display_path(path)}:{rest}" if rest else s


def stack_lines(d: Diagnosis, width: int) -> list[Text]:
    if d.verdict == Verdict.HEALTHY:
        return []
    out: list[Text] = []
    for r in sorted(d.ranks, key=lambda r: r.rank):
        if not r.stack:
            continue
        keep = [s for s in r.stack if "torch/" not in s and "typing_extensions" not in s]
        inner = next((s for s in r.stack if "distributed" in s), None)
        head = Text(f"  {rank_name(r.rank)}", style="bold")
        head.append(f"  ({r.stack_source or 'stack'})", style="dim")
        out.append(head)
        if inner:
            out += wrap(Text(f"▸ {_frame(inner)}", style="dim"), width, indent=4, hang=8)
        for s in keep[:STACK_DEPTH]:
            out += wrap(_frame(s), width, indent=4, hang=8)
        if len(keep) > STACK_DEPTH:
            out.append(Text(f"    … {len(keep) - STACK_DEPTH} more frames (HTML)", style="dim"))
    return [_heading("stacks (innermost first, torch frames folded)"), *out] if out else []


def reference_lines(ref: ReferenceReport, width: int) -> list[RenderableType]:
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for col in ("compared", "max abs err", "max rel err", "rtol", "result"):
        t.add_column(col, no_wrap=True)
    t.add_row(f"{ref.compared} tensors × {ref.steps} steps", f"{ref.max_abs_err:.3e}",
              f"{ref.max_rel_err:.3e}", f"{ref.rtol:.0e}",
              "[green]match[/]" if ref.ok else "[red]MISMATCH[/]")
    out: list[RenderableType] = [_heading("single-process reference"), t]
    for f in ref.failures[:8]:
        out += wrap(Text(f"✗ {f}", style="red"), width, indent=2, hang=4)
    if len(ref.failures) > 8:
        out.append(Text(f"  ✗ … and {len(ref.failures) - 8} more (reference.json)",
                        style="red"))
    return out


def evidence_lines(d: Diagnosis, width: int) -> list[Text]:
    if not d.evidence:
        return []
    out = [_heading("evidence")]
    for line in d.evidence[:10]:
        out += wrap(Text(shorten_paths(clean_evidence(line)), style="dim"), width, indent=2,
                    hang=4)
    return out


def ras_lines(d: Diagnosis, width: int) -> list[Text]:
    """What NCCL RAS said, each finding's sentence in full (``nccl_ras`` of the JSON)."""
    findings = (d.nccl_ras or {}).get("findings") or []
    if not findings:
        return []
    out = [_heading("NCCL RAS")]
    for f in findings:
        out += wrap(Text(str(f.get("sentence", "")), style="dim"), width, indent=2, hang=4)
    return out


def routing_lines(d: Diagnosis, width: int) -> list[Text]:
    """The routers' tokens per expert at the step the job stopped in, a line per block and
    rank (an expert one rank starved and another fed, in red), then each such expert."""
    r = d.routing
    if r is None or not r.counts:
        return []
    starved = {(g.block, g.expert, rank) for g in r.gaps for rank in g.starved}
    out = [_heading(f"routing at step {r.step} (tokens per expert, each rank)")]
    blocks = list(dict.fromkeys(b for c in r.counts.values() for b in c))
    width_e = max((len(v) for c in r.counts.values() for v in c.values()), default=0)
    label = max((len(f"rank {rank}:") for rank in r.counts), default=7)
    out += wrap(Text(f"{'expert':<{label}}" + "".join(f" {e:>4}" for e in range(width_e)),
                     style="dim"), width, indent=4, hang=label + 4)
    for block in blocks:
        out.append(Text(f"  {block}", style="bold"))
        for rank in sorted(r.counts):
            counts = r.counts[rank].get(block)
            if counts is None:
                continue
            line = Text(f"{f'rank {rank}:':<{label}}")
            for e, n in enumerate(counts):
                line.append(f" {n:>4}", style="bold red" if (block, e, rank) in starved
                            else "")
            out += wrap(line, width, indent=4, hang=label + 4)
    for text in [ragged_sentence(g, d.culprit_ranks) for g in r.ragged[:5]] + [
            gap_sentence(g, d.culprit_ranks) for g in r.gaps[:10]]:
        out += wrap(Text(text, style="dim"), width, indent=2, hang=4)
    return out


def footer(d: Diagnosis, width: int) -> list[Text]:
    parts = timing_parts(d)
    if d.artifacts:
        parts.append(f"run directory {d.artifacts}")
    return wrap(Text(" · ".join(parts), style="dim"), width, hang=2) if parts else []


def _in_full(d: Diagnosis, width: int) -> list[Text]:
    """What the first screen had to shorten, whole."""
    run = d.run if isinstance(d.run, ScenarioRun) else None
    out = [_heading("in full"), *wrap(shorten_paths(d.summary), width, indent=2)]
    hint = (run.fix_hint if run is not None else "") or d.fix
    if hint:
        out += wrap(Text("fix: ", style="bold green") + Text(shorten_paths(hint)), width,
                    indent=2, hang=4)
    if d.fix_code:
        out += [Text("    " + c, style="cyan") for c in d.fix_code.rstrip("\n").split("\n")]
    return out


def details(d: Diagnosis, width: int, *, clipped: bool = False) -> list[RenderableType]:
    """Everything after the first screen, in order, each block separated by a blank line."""
    ref = d.run.reference if isinstance(d.run, ScenarioRun) else None
    blocks: list[list[RenderableType]] = [
        list(_in_full(d, width)) if clipped else [],
        list(divergence_lines(d, width)), list(ranks_lines(d, width)),
        timeline_table(d, width), list(routing_lines(d, width)), list(stack_lines(d, width)),
        reference_lines(ref, width) if ref is not None else [],
        list(evidence_lines(d, width)), list(ras_lines(d, width)), list(footer(d, width))]
    out: list[RenderableType] = []
    for b in blocks:
        if b:
            out += [Text(""), *b]
    return out


def render(d: Diagnosis, console: Console, ctx: ReportContext, *, verbose: bool = False
           ) -> None:
    """The first screen; with ``verbose`` the detail after it."""
    screen = first_screen(d, ctx, console.width, verbose=verbose)
    for line in screen.lines:
        console.print(line, soft_wrap=True)
    if verbose:
        for item in details(d, console.width, clipped=screen.clipped):
            console.print(item, soft_wrap=isinstance(item, Text))


def render_text(d: Diagnosis, ctx: ReportContext, *, width: int = LOG_WIDTH,
                verbose: bool = True) -> str:
    """The report as plain text (``console.log``): at a fixed width, detail included."""
    buf = io.StringIO()
    console = Console(file=buf, width=width, highlight=False, color_system=None,
                      soft_wrap=True)
    render(d, console, ctx, verbose=verbose)
    return buf.getvalue()
