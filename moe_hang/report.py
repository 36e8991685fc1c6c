"""Render a diagnosis for a person (rich) or a program (JSON). The only module importing rich."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from moe_hang.diagnosis import Diagnosis, fmt_shape, pg_label
from moe_hang.stacks import short_path

VERDICT_STYLE = {
    "desync": "bold red", "hang": "bold red", "crash": "bold red", "rank_died": "bold red",
    "straggler": "bold yellow", "inconclusive": "bold yellow", "healthy": "bold green",
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


@contextlib.contextmanager
def live_status(enabled: bool = True) -> Iterator[Any]:
    """A one-line live phase display on stderr; yields a ``say(text)`` callable.

    Without a terminal nobody watches it live: phases are printed as plain lines only when
    MOE_HANG_PROGRESS=1 (so pipes and CI logs see just the report and one-line errors)."""
    if not enabled or not sys.stderr.isatty():
        quiet = Console(stderr=True, highlight=False)
        show = enabled and os.environ.get("MOE_HANG_PROGRESS") == "1"

        def say_plain(text: str) -> None:
            if show:
                quiet.print(f"[dim]· {text}[/dim]")

        yield say_plain
        return
    console = Console(stderr=True, highlight=False)
    with console.status("starting", spinner="dots") as status:

        def say(text: str) -> None:
            status.update(text)

        yield say


def _sizes(sizes: list[list[int]]) -> str:
    return fmt_shape(sizes) or "-"


def _coll(c: dict[str, Any] | None) -> str:
    if not c:
        return "-"
    if c.get("pg") == "?":  # known from the stack only
        return f"{c['op']} (from stack)"
    pg = pg_label(c.get("pg"), c.get("pg_desc"), word="pg")
    seq = f"#{c['seq']}" if c.get("seq") is not None else ""
    what = f" ({c['tag']})" if c.get("tag") else ""
    return f"{c['op']} {pg}{seq} [{_sizes(c.get('input_sizes') or [])}]{what}"


def _site(cs: dict[str, Any] | None) -> str:
    if not cs:
        return "-"
    return f"{display_path(str(cs['file']))}:{cs['line']} {cs['function']}"


def _tokens(t: dict[str, Any] | None) -> str:
    if not t:
        return "-"
    parts = [f"{t.get('local')} local"]
    if t.get("per_expert") is not None:
        parts.append("experts " + "/".join(map(str, t["per_expert"])))
    if t.get("gathered_lengths") is not None:
        parts.append("gathered " + "/".join(map(str, t["gathered_lengths"])))
    if t.get("assumed_lengths") is not None:
        parts.append("from_local assumes " + "/".join(map(str, t["assumed_lengths"])))
    return "\n".join(parts)


def verdict_panel(d: dict[str, Any], title: str) -> Panel:
    style = VERDICT_STYLE.get(d["verdict"], "bold")
    body = Text()
    body.append(d["summary"] + "\n")
    if d.get("culprit_ranks"):
        body.append("\nculprit rank(s): ", style="bold")
        body.append(", ".join(map(str, d["culprit_ranks"])) + "\n")
    fd = d.get("first_divergence")
    if fd:
        pg = ("an unknown group" if fd["pg"] == "?" and not fd.get("pg_desc")
              else pg_label(fd["pg"], fd.get("pg_desc")))
        body.append("first divergence: ", style="bold")
        seq = f"seq {fd['seq']}" if fd.get("seq") is not None else "(stacks only)"
        body.append(f"{fd['kind']} at {pg} {seq}"
                    + (f" ({fd['phase']})" if fd.get("phase") else "")
                    + (f", ranks {fd['ranks']}" if fd.get("ranks") and fd["pg"] != "0" else "")
                    + "\n")
        for r, c in fd.get("per_rank", {}).items():
            body.append(f"  rank {r}: ", style="bold")
            body.append(_coll(c) if c else "never posted it")
            if c and c.get("callsite"):
                body.append(f"  ← {_site(c['callsite'])}", style="cyan")
            body.append("\n")
    hint = d.get("fix_hint") or d.get("fix")
    if hint:
        label = "fix under test: " if d.get("variant") == "fixed" else "fix: "
        body.append("\n" + label, style="bold green")
        body.append(str(hint))
    label = d["verdict"].upper()
    if d.get("verified") is False:
        style, label = "bold red", f"NOT VERIFIED ({d['verdict']})"
    elif d.get("verified") is True and d.get("variant") == "fixed":
        label = "VERIFIED"
    return Panel(body, title=f"[{style}]{title}: {label}[/]", border_style=style,
                 box=box.ROUNDED, expand=True)


def ranks_table(d: dict[str, Any]) -> Table:
    t = Table(box=box.SIMPLE_HEAVY, expand=True, title="ranks", title_justify="left")
    for col in ("rank", "pid", "state", "collective", "call site", "tokens", "exit"):
        t.add_column(col, overflow="fold")
    culprits = set(d.get("culprit_ranks") or [])
    for r in d.get("ranks", []):
        state = r["state"] + (f" ({r['phase']})" if r.get("phase") else "")
        if r.get("autograd_function"):
            state += f"\n{r['autograd_function']}.backward"
        exit_s = "-" if r.get("exit_code") is None else str(r["exit_code"])
        style = "red" if r["rank"] in culprits else ""
        t.add_row(str(r["rank"]), str(r.get("pid") or "-"), state, _coll(r.get("collective")),
                  _site(r.get("callsite")), _tokens(r.get("tokens")), exit_s, style=style)
    return t


def stacks_panel(d: dict[str, Any], depth: int = 8) -> Panel | None:
    rows = []
    for r in d.get("ranks", []):
        stack = r.get("stack") or []
        if not stack:
            continue
        # the user's frames and the collective they wait in, innermost first
        keep = [s for s in stack if "torch/" not in s and "typing_extensions" not in s][:depth]
        inner = next((s for s in stack if "distributed" in s), None)
        head = Text(f"rank {r['rank']}", style="bold")
        head.append(f"  ({r.get('stack_source') or 'stack'})", style="dim")
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


def reference_table(ref: dict[str, Any]) -> Table:
    t = Table(box=box.SIMPLE, title="single-process reference", title_justify="left")
    t.add_column("compared")
    t.add_column("max abs err")
    t.add_column("max rel err")
    t.add_column("rtol")
    t.add_column("result")
    t.add_row(f"{ref.get('compared')} tensors × {ref.get('steps')} steps",
              f"{ref.get('max_abs_err', 0):.3e}", f"{ref.get('max_rel_err', 0):.3e}",
              f"{ref.get('rtol', 0):.0e}",
              "[green]match[/]" if ref.get("ok") else "[red]MISMATCH[/]")
    return t


_OP_SHORT = {"all_gather": "AG", "all_reduce": "AR", "reduce_scatter": "RS",
             "all_to_all": "A2A", "barrier": "BAR", "broadcast": "BC"}


def timeline_table(d: dict[str, Any]) -> Table | None:
    """Ranks as rows, the group's sequence numbers as columns, the diverging column marked."""
    tl = d.get("timeline")
    if not tl or not tl.get("seqs"):
        return None
    t = Table(box=box.SIMPLE)
    t.add_column("rank", style="bold")
    hi = tl.get("highlight")
    for s in tl["seqs"]:
        t.add_column(f"[bold red]▶{s}[/]" if s == hi else str(s), justify="center")
    for r, cells in tl["ranks"].items():
        row = []
        for s, c in zip(tl["seqs"], cells, strict=False):
            if c is None:
                row.append(Text("—", style="bold red" if s == hi else "red"))
                continue
            label = _OP_SHORT.get(c["op"], c["op"])
            sizes = _sizes(c.get("sizes") or [])
            text = label if sizes == "-" else f"{label} {sizes}"
            style = "yellow" if c["state"] == "pending" else "dim"
            if s == hi:
                style = "bold red" if c["state"] == "pending" else "bold"
            row.append(Text(text, style=style))
        t.add_row(r, *row)
    return t


def render(diag: Diagnosis, console: Console, *, title: str = "moe-hang") -> None:
    d = diag.to_dict()
    console.print(verdict_panel(d, title))
    console.print(ranks_table(d))
    tt = timeline_table(d)
    if tt is not None and d["verdict"] != "healthy":
        tl = d["timeline"]
        pg = pg_label(tl["pg"], tl.get("pg_desc"))
        console.print(Text.from_markup(
            f"[bold]collectives of {pg} by sequence number[/] (done · [yellow]pending[/] · "
            "[red]missing[/])"))
        console.print(tt)
    sp = stacks_panel(d)
    if sp is not None and d["verdict"] != "healthy":
        console.print(sp)
    if d.get("reference"):
        console.print(reference_table(d["reference"]))
        fails = d["reference"].get("failures") or []
        for f in fails[:8]:
            console.print(f"  [red]✗[/] {f}")
        if len(fails) > 8:
            console.print(f"  [red]✗[/] … and {len(fails) - 8} more (reference.json)")
    if d.get("evidence"):
        console.print(Text("evidence", style="bold"))
        for line in d["evidence"][:10]:
            console.print(Text(f"  {clean_evidence(line)}", style="dim"))
    tm = d.get("timings") or {}
    foot = []
    if "wall_s" in tm:
        foot.append(f"wall {tm['wall_s']:.1f} s")
    if "onset_to_verdict_s" in tm:
        foot.append(f"hang onset → verdict {tm['onset_to_verdict_s']:.2f} s")
    if d.get("artifacts"):
        foot.append(f"run directory {d['artifacts']}")
    if foot:
        console.print(Text(" · ".join(foot), style="dim"))


def to_json(diag: Diagnosis) -> str:
    return json.dumps(diag.to_dict(), indent=2, default=str)


def save_console(console: Console, path: Path | None, html: Path | None = None) -> None:
    from moe_hang.probe import write_atomic

    if html is not None:
        write_atomic(html, console.export_html(clear=False).encode())
    if path is not None:
        write_atomic(path, console.export_text(clear=False).encode())
