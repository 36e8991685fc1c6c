"""Render a :class:`~moe_hang.analysis.diagnosis.Diagnosis` for a person on a terminal."""

from __future__ import annotations

import io
import os
import re
import sys

from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from moe_hang.analysis.diagnosis import (
    Diagnosis,
    RankCollective,
    ReferenceReport,
    ScenarioRun,
    Verdict,
    fmt_shape,
    pg_label,
)
from moe_hang.evidence.ops import short_op
from moe_hang.evidence.stacks import Frame, short_path

VERDICT_STYLE = {
    Verdict.DESYNC: "bold red", Verdict.HANG: "bold red", Verdict.CRASH: "bold red",
    Verdict.RANK_DIED: "bold red", Verdict.STRAGGLER: "bold yellow",
    Verdict.INCONCLUSIVE: "bold yellow", Verdict.HEALTHY: "bold green",
}


def make_console(*, quiet: bool = False, stderr: bool = False) -> Console:
    """A recording console; ``quiet`` renders only into the recording (for --json)."""
    if quiet:
        return Console(record=True, file=io.StringIO(), width=120, highlight=False)
    stream = sys.stderr if stderr else sys.stdout
    # a pipe or a file gets a width that fits the per-rank table; a terminal keeps its own
    width = None if stream.isatty() else 120
    return Console(record=True, stderr=stderr, highlight=False, soft_wrap=False, width=width)


def display_path(path: str) -> str:
    """Relative to the working directory when under it, else without the site-packages."""
    try:
        rel = os.path.relpath(path)
        if not rel.startswith(".."):
            return rel
    except ValueError:
        pass
    return short_path(path)


_GLOO_PREFIX = re.compile(r"\[(?:enforce fail at )?/[^\]]*\]\s*")


def clean_evidence(line: str, limit: int = 220) -> str:
    """Drop build-machine source paths from gloo/NCCL messages; keep what they say."""
    line = _GLOO_PREFIX.sub("", line).strip()
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _sizes(sizes: list[list[int]]) -> str:
    return fmt_shape(sizes) or "-"


def _coll(c: RankCollective | None) -> str:
    if c is None:
        return "-"
    if c.from_stack_only:
        return f"{c.op} (from stack)"
    pg = pg_label(c.pg, c.pg_desc, word="pg")
    seq = f"#{c.seq}" if c.seq is not None else ""
    what = f" ({c.tag})" if c.tag else ""
    return f"{c.op} {pg}{seq} [{_sizes(c.input_sizes)}]{what}"


def _site(cs: Frame | None) -> str:
    if cs is None:
        return "-"
    return f"{display_path(cs.file)}:{cs.line} {cs.function}"


def _tokens(t: dict[str, object] | None) -> str:
    if not t:
        return "-"
    parts = [f"{t.get('local')} local"]

    def joined(key: str) -> str:
        v = t.get(key)
        return "/".join(map(str, v)) if isinstance(v, list) else str(v)

    if t.get("per_expert") is not None:
        parts.append("experts " + joined("per_expert"))
    if t.get("gathered_lengths") is not None:
        parts.append("gathered " + joined("gathered_lengths"))
    if t.get("assumed_lengths") is not None:
        parts.append("from_local assumes " + joined("assumed_lengths"))
    return "\n".join(parts)


def verdict_panel(d: Diagnosis, title: str) -> Panel:
    style = VERDICT_STYLE.get(d.verdict, "bold")
    run = d.run if isinstance(d.run, ScenarioRun) else None
    body = Text()
    body.append(d.summary + "\n")
    if d.culprit_ranks:
        body.append("\nculprit rank(s): ", style="bold")
        body.append(", ".join(map(str, sorted(d.culprit_ranks))) + "\n")
    fd = d.first_divergence
    if fd is not None:
        pg = ("an unknown group" if fd.pg == "?" and not fd.pg_desc
              else pg_label(fd.pg, fd.pg_desc))
        body.append("first divergence: ", style="bold")
        seq = f"seq {fd.seq}" if fd.seq is not None else "(stacks only)"
        body.append(f"{fd.kind} at {pg} {seq}"
                    + (f" ({fd.phase})" if fd.phase else "")
                    + (f", ranks {fd.members}" if fd.members and fd.pg != "0" else "")
                    + "\n")
        for r, c in sorted(fd.per_rank.items()):
            body.append(f"  rank {r}: ", style="bold")
            body.append(_coll(c) if c else "never posted it")
            if c is not None and c.callsite is not None:
                body.append(f"  ← {_site(c.callsite)}", style="cyan")
            body.append("\n")
    hint = (run.fix_hint if run is not None else "") or d.fix
    if hint:
        label = "fix under test: " if run is not None and run.variant == "fixed" else "fix: "
        body.append("\n" + label, style="bold green")
        body.append(hint)
    label = d.verdict.upper()
    if run is not None and run.verified is False:
        style, label = "bold red", f"NOT VERIFIED ({d.verdict})"
    elif run is not None and run.verified is True and run.variant == "fixed":
        label = "VERIFIED"
    return Panel(body, title=f"[{style}]{title}: {label}[/]", border_style=style,
                 box=box.ROUNDED, expand=True)


def ranks_table(d: Diagnosis) -> Table:
    t = Table(box=box.SIMPLE_HEAVY, expand=True, title="ranks", title_justify="left")
    for col in ("rank", "pid", "state", "collective", "call site", "tokens", "exit"):
        t.add_column(col, overflow="fold")
    culprits = set(d.culprit_ranks)
    for r in sorted(d.ranks, key=lambda r: r.rank):
        state = r.state + (f" ({r.phase})" if r.phase else "")
        if r.autograd_function:
            state += f"\n{r.autograd_function}.backward"
        exit_s = "-" if r.exit_code is None else str(r.exit_code)
        style = "red" if r.rank in culprits else ""
        t.add_row(str(r.rank), str(r.pid or "-"), state, _coll(r.collective), _site(r.callsite),
                  _tokens(r.tokens), exit_s, style=style)
    return t


def stacks_panel(d: Diagnosis, depth: int = 8) -> Panel | None:
    rows = []
    for r in sorted(d.ranks, key=lambda r: r.rank):
        if not r.stack:
            continue
        # the user's frames and the collective they wait in, innermost first
        keep = [s for s in r.stack if "torch/" not in s and "typing_extensions" not in s][:depth]
        inner = next((s for s in r.stack if "distributed" in s), None)
        head = Text(f"rank {r.rank}", style="bold")
        head.append(f"  ({r.stack_source or 'stack'})", style="dim")
        lines = [head]
        if inner:
            lines.append(Text(f"  ▸ {inner}", style="dim"))
        lines += [Text(f"  {_short_frame(s)}") for s in keep]
        rows.append(Group(*lines))
    if not rows:
        return None
    return Panel(Group(*rows), title="stacks (innermost first, torch frames folded)",
                 box=box.ROUNDED, expand=True)


def _short_frame(s: str) -> str:
    path, _, rest = s.partition(":")
    return f"{display_path(path)}:{rest}" if rest else s


def reference_table(ref: ReferenceReport) -> Table:
    t = Table(box=box.SIMPLE, title="single-process reference", title_justify="left")
    for col in ("compared", "max abs err", "max rel err", "rtol", "result"):
        t.add_column(col)
    t.add_row(f"{ref.compared} tensors × {ref.steps} steps", f"{ref.max_abs_err:.3e}",
              f"{ref.max_rel_err:.3e}", f"{ref.rtol:.0e}",
              "[green]match[/]" if ref.ok else "[red]MISMATCH[/]")
    return t


def timeline_table(d: Diagnosis) -> Table | None:
    """Ranks as rows, the group's sequence numbers as columns, the diverging column marked."""
    tl = d.timeline
    if tl is None or not tl.seqs:
        return None
    t = Table(box=box.SIMPLE)
    t.add_column("rank", style="bold")
    hi = tl.highlight
    for s in tl.seqs:
        t.add_column(f"[bold red]▶{s}[/]" if s == hi else str(s), justify="center")
    for r, cells in tl.ranks.items():
        row = []
        for s, c in zip(tl.seqs, cells, strict=False):
            if c is None:
                row.append(Text("—", style="bold red" if s == hi else "red"))
                continue
            label = short_op(c.op)
            sizes = _sizes(c.sizes)
            text = label if sizes == "-" else f"{label} {sizes}"
            style = "yellow" if c.state == "pending" else "dim"
            if s == hi:
                style = "bold red" if c.state == "pending" else "bold"
            row.append(Text(text, style=style))
        t.add_row(str(r), *row)
    return t


def render(diag: Diagnosis, console: Console, *, title: str = "moe-hang") -> None:
    console.print(verdict_panel(diag, title))
    console.print(ranks_table(diag))
    tt = timeline_table(diag)
    if tt is not None and diag.timeline is not None and diag.verdict != Verdict.HEALTHY:
        pg = pg_label(diag.timeline.pg, diag.timeline.pg_desc)
        console.print(Text.from_markup(
            f"[bold]collectives of {pg} by sequence number[/] (done · [yellow]pending[/] · "
            "[red]missing[/])"))
        console.print(tt)
    sp = stacks_panel(diag)
    if sp is not None and diag.verdict != Verdict.HEALTHY:
        console.print(sp)
    ref = diag.run.reference if isinstance(diag.run, ScenarioRun) else None
    if ref is not None:
        console.print(reference_table(ref))
        for f in ref.failures[:8]:
            console.print(f"  [red]✗[/] {f}")
        if len(ref.failures) > 8:
            console.print(f"  [red]✗[/] … and {len(ref.failures) - 8} more (reference.json)")
    if diag.evidence:
        console.print(Text("evidence", style="bold"))
        for line in diag.evidence[:10]:
            console.print(Text(f"  {clean_evidence(line)}", style="dim"))
    tm = diag.timings
    foot = []
    if tm is not None and tm.wall_s is not None:
        foot.append(f"wall {tm.wall_s:.1f} s")
    if tm is not None and tm.onset_to_verdict_s is not None:
        foot.append(f"hang onset → verdict {tm.onset_to_verdict_s:.2f} s")
    if diag.artifacts:
        foot.append(f"run directory {diag.artifacts}")
    if foot:
        console.print(Text(" · ".join(foot), style="dim"))
