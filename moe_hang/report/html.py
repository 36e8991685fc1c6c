"""The report as files: ``console.log`` (the text, at a fixed width) and a self-contained HTML
page (``--html``): no network, inline CSS, no script; stacks fold with ``<details>``.

Every string from a diagnosis is escaped (``html.escape``): call sites, evidence lines and
job output are the job's text, not ours.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Iterator
from html import escape
from pathlib import Path

from moe_hang.analysis.diagnosis import (
    Diagnosis,
    RankReport,
    Timeline,
    Verdict,
    pg_label,
)
from moe_hang.analysis.routing import gap_sentence, ragged_sentence
from moe_hang.analysis.runs import ReferenceReport, ScenarioRun
from moe_hang.evidence.rankid import rank_name
from moe_hang.evidence.vocab import who
from moe_hang.probe.env import write_atomic
from moe_hang.report.console import (
    LOG_WIDTH,
    clean_evidence,
    render_text,
    timeline_label,
)
from moe_hang.report.screen import headline
from moe_hang.report.words import (
    ReportContext,
    collective_text,
    culprit_words,
    exit_words,
    fix_words,
    next_words,
    run_words,
    site_groups,
    site_text,
    timing_parts,
    tokens_text,
)
from moe_hang.report.wrap import display_path, shorten_paths

MAX_FILES = 300  # links to a run directory's files; a huge capture is summarised

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:72em;padding:0 1em;
color:#1d1d1f;background:#fff}
h1{font-size:1.35em;margin:.2em 0 .6em}h2{font-size:1.1em;margin:1.6em 0 .5em;
border-bottom:1px solid #ddd}
.bad{color:#b3261e}.warn{color:#9a6700}.good{color:#1a7f37}
code,pre,td.mono{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:13px}
pre{background:#f6f8fa;padding:.6em .8em;overflow-x:auto;margin:.3em 0}
table{border-collapse:collapse;margin:.4em 0}
th,td{border:1px solid #d0d7de;padding:.25em .55em;text-align:left;vertical-align:top}
th{background:#f6f8fa}tr.culprit td{background:#fff1f0}
table.timeline td,table.timeline th{text-align:center}
.diverge{background:#ffe3e0 !important;font-weight:bold}
td.pending{color:#9a6700}td.missing{color:#b3261e}td.done,td.posted{color:#57606a}
td.unknown{color:#8c959f;font-style:italic}
details{margin:.25em 0}summary{cursor:pointer;font-weight:600}
ul.sites li.culprit{color:#b3261e}.dim{color:#57606a}
table.ranks{table-layout:fixed;width:100%}table.ranks td{overflow-wrap:break-word}
table.ranks td:nth-child(6),table.ranks td:nth-child(9){overflow-wrap:anywhere}
.pair{display:flex;gap:0 2em;align-items:flex-start}
.pair>div{min-width:0;overflow-x:auto}.pair>div:first-child{flex:1 1 0}
.pair>div:last-child{flex:0 0 auto;max-width:55%}
table.heat td{text-align:right;min-width:2.2em}table.heat td.mono{text-align:left}
table.heat caption{text-align:left;font-family:ui-monospace,monospace;font-size:13px}
td.starved{outline:2px solid #b3261e;color:#b3261e;font-weight:bold}
"""

_VERDICT_CLASS = {Verdict.HEALTHY: "good", Verdict.STRAGGLER: "warn",
                  Verdict.INCONCLUSIVE: "warn"}


def _e(text: object) -> str:
    return escape(str(text), quote=True)


def _verdict_section(d: Diagnosis, ctx: ReportContext) -> Iterator[str]:
    head = headline(d, ctx)
    cls = "good" if "green" in str(head.style) else _VERDICT_CLASS.get(d.verdict, "bad")
    yield f'<h1 id="verdict" class="{cls}">{_e(head.plain)}</h1>'
    yield f'<p class="summary">{_e(shorten_paths(d.summary))}</p>'
    culprit = culprit_words(d)
    if culprit is not None:
        label, names, why = culprit
        yield (f'<p class="culprits"><b>{_e(label)}:</b> <span class="bad">{_e(names)}</span>'
               + (f" ({_e(why)})" if why else "") + "</p>")
    groups = site_groups(d, max_groups=len(d.ranks) + 1)  # a page has room for every line
    if groups:
        yield '<ul class="sites">'
        for members, phrase, is_culprit in groups:
            cls = ' class="culprit"' if is_culprit else ""
            yield f"<li{cls}><b>{_e(who(members))}</b> {_e(phrase)}</li>"
        yield "</ul>"
    fix = fix_words(d)
    if fix is not None:
        label, hint, code = fix
        yield f'<p class="fix"><b class="good">{_e(label)}:</b> {_e(hint)}</p>'
        if code:
            yield f'<pre class="fix-code">{_e(code)}</pre>'
    nxt = next_words(d, ctx)
    if nxt is not None:
        what, why = nxt
        yield (f'<p class="next"><b>next:</b> <code>{_e(what)}</code>'
               + (f" ({_e(why)})" if why else "") + "</p>")



def _rank_row(r: RankReport, culprit: bool) -> str:
    state = f"{r.state}" + (f" ({r.phase})" if r.phase else "")
    if r.autograd_function:
        state += f", in {r.autograd_function}.backward"
    cells = [str(r.rank), str(r.pid or "-"), r.host or "-", state,
             collective_text(r.collective) if r.collective else "-",
             site_text(r.callsite), tokens_text(r.tokens) or "-",
             "-" if r.exit_code is None else f"{r.exit_code} ({exit_words(r.exit_code)})",
             shorten_paths(clean_evidence(r.note, limit=2000)) if r.note else ""]
    cls = ' class="culprit"' if culprit else ""
    return f"<tr{cls}>" + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>"


_RANK_COLUMNS = {"rank": 5, "pid": 7, "host": 5, "state": 12, "collective": 14, "call site": 20,
                 "tokens": 7, "exit": 9, "note": 21}


def _ranks_section(d: Diagnosis) -> Iterator[str]:
    if not d.ranks:
        return
    yield '<h2 id="ranks">ranks</h2><table class="ranks"><colgroup>'
    # a fixed layout keeps the table inside the page; the widths give the call site and the
    # note the room, not the pid
    yield "".join(f'<col style="width:{w}%">' for w in _RANK_COLUMNS.values())
    yield "</colgroup><thead><tr>"
    yield "".join(f"<th>{h}</th>" for h in _RANK_COLUMNS)
    yield "</tr></thead><tbody>"
    culprits = set(d.culprit_ranks)
    for r in sorted(d.ranks, key=lambda r: r.rank):
        yield _rank_row(r, r.rank in culprits)
    yield "</tbody></table>"


def _timeline_section(tl: Timeline | None) -> Iterator[str]:
    if tl is None or not tl.seqs:
        return
    yield (f'<h2 id="timeline">collectives of {_e(pg_label(tl.pg, tl.pg_desc))} by sequence '
           'number</h2><table class="timeline"><thead><tr><th>rank</th>')
    for s in tl.seqs:
        cls = ' class="diverge"' if s == tl.highlight else ""
        yield f"<th{cls}>{'▶' if s == tl.highlight else ''}{s}</th>"
    yield "</tr></thead><tbody>"
    for r, cells in sorted(tl.ranks.items()):
        row = [f"<th>{r}</th>"]
        for i, s in enumerate(tl.seqs):
            c = cells[i] if i < len(cells) else None
            state = "missing" if c is None else c.state
            classes = state + (" diverge" if s == tl.highlight else "")
            text = "—" if c is None else "?" if c.state == "unknown" else timeline_label(
                c.op, c.sizes)
            title = ' title="posted (its own counts say so), not in its evidence"' if (
                c is not None and c.state == "unknown") else "" if c is None or not c.name \
                else f' title="{_e(c.name)}"'
            row.append(f'<td class="{classes}"{title}>{_e(text)}</td>')
        yield "<tr>" + "".join(row) + "</tr>"
    yield "</tbody></table>"


def _routing_section(d: Diagnosis) -> Iterator[str]:
    """The heat map: tokens per expert (columns) for each block and rank (rows) at the step
    the job stopped in; an expert one rank starved while another fed it, outlined red."""
    r = d.routing
    if r is None or not r.counts:
        return
    starved = {(g.block, g.expert, rank) for g in r.gaps for rank in g.starved}
    blocks = list(dict.fromkeys(b for c in r.counts.values() for b in c))
    width = max((len(v) for c in r.counts.values() for v in c.values()), default=0)
    top = max((n for c in r.counts.values() for v in c.values() for n in v), default=0) or 1
    head, short = _common_part(blocks)
    caption = f"<caption>block: {_e(head)}</caption>" if head != "block" else ""
    yield (f'<h2 id="routing">tokens per expert at step {r.step}</h2><table class="heat">'
           f"{caption}<thead><tr><th>block</th><th>rank</th>"
           + "".join(f"<th>{e}</th>" for e in range(width)) + "</tr></thead><tbody>")
    for block in blocks:
        for rank in sorted(r.counts):
            counts = r.counts[rank].get(block)
            if counts is None:
                continue
            cells = []
            for e, n in enumerate(counts):
                shade = int(255 - 120 * n / top)
                cls = ' class="starved"' if (block, e, rank) in starved else ""
                cells.append(f'<td{cls} style="background:rgb({shade},{shade},255)">{n}</td>')
            yield (f'<tr><td class="mono" title="{_e(block)}">{_e(short[block])}</td>'
                   f"<th>{rank}</th>" + "".join(cells) + "</tr>")
    yield "</tbody></table>"
    said = [ragged_sentence(g, d.culprit_ranks) for g in r.ragged[:5]] + [
        gap_sentence(g, d.culprit_ranks) for g in r.gaps[:10]]
    if said:
        yield '<ul class="evidence">' + "".join(f"<li>{_e(x)}</li>" for x in said) + "</ul>"


def _common_part(blocks: list[str]) -> tuple[str, dict[str, str]]:
    """The blocks' names without what they all share, and the header that says it
    (``model.layers.*.block_sparse_moe`` over ``0``, ``1``): the heat map keeps its width
    for the experts. One block, or nothing shared: the names whole."""
    parts = [b.split(".") for b in blocks]
    if len(parts) < 2:
        return "block", {b: b for b in blocks}
    pre = 0
    while all(len(p) > pre + 1 and p[pre] == parts[0][pre] for p in parts):
        pre += 1
    post = 0
    while all(len(p) > pre + post + 1 and p[-1 - post] == parts[0][-1 - post] for p in parts):
        post += 1
    short = {b: ".".join(p[pre:len(p) - post]) for b, p in zip(blocks, parts, strict=True)}
    if not pre and not post:
        return "block", short
    head = ".".join([*parts[0][:pre], "*", *parts[0][len(parts[0]) - post:]])
    return head, short


def _side_by_side(*parts: list[str]) -> Iterator[str]:
    """The grid and the heat map beside each other where the page is wide enough."""
    shown = [p for p in parts if p]
    if len(shown) < 2:
        yield from (line for p in shown for line in p)
        return
    yield '<div class="pair">' + "".join(
        "<div>" + "".join(p) + "</div>" for p in shown) + "</div>"


def _stacks_section(d: Diagnosis) -> Iterator[str]:
    ranks = [r for r in sorted(d.ranks, key=lambda r: r.rank) if r.stack]
    if not ranks:
        return
    yield '<h2 id="stacks">stacks (innermost first)</h2>'
    for r in ranks:
        frames = "\n".join(shorten_paths(s) for s in r.stack)
        src = f" ({r.stack_source})" if r.stack_source else ""
        yield (f'<details class="stack"><summary>{_e(rank_name(r.rank))}{_e(src)}</summary>'
               f"<pre>{_e(frames)}</pre></details>")


def _reference_section(ref: ReferenceReport | None) -> Iterator[str]:
    if ref is None:
        return
    yield ('<h2 id="reference">single-process reference</h2><table><thead><tr><th>compared'
           "</th><th>max abs err</th><th>max rel err</th><th>rtol</th><th>result</th></tr>"
           "</thead><tbody><tr>")
    yield "".join(f"<td>{_e(c)}</td>" for c in (
        f"{ref.compared} tensors × {ref.steps} steps", f"{ref.max_abs_err:.3e}",
        f"{ref.max_rel_err:.3e}", f"{ref.rtol:.0e}"))
    ok = '<td class="good">match</td>' if ref.ok else '<td class="bad">MISMATCH</td>'
    yield ok + "</tr></tbody></table>"
    if ref.failures:
        yield '<ul class="failures">' + "".join(f"<li>{_e(f)}</li>" for f in ref.failures)
        yield "</ul>"


def _evidence_section(d: Diagnosis) -> Iterator[str]:
    if not d.evidence:
        return
    yield '<h2 id="evidence">evidence</h2><ul class="evidence">'
    for line in d.evidence:
        yield f"<li><code>{_e(shorten_paths(clean_evidence(line, limit=2000)))}</code></li>"
    yield "</ul>"


def _href(target: Path, page: Path, inside: bool) -> str:
    """A relative link when the page lives in the run directory (it moves with it), else an
    absolute ``file://`` one."""
    if inside:
        return urllib.parse.quote(os.path.relpath(target, page.parent))
    return target.resolve().as_uri()


def run_roots(d: Diagnosis, ctx: ReportContext) -> list[Path]:
    """The directories the report's files live in (analyze: every capture it merged)."""
    if not d.artifacts:
        return []
    names = d.artifacts.split(", ") if ctx.command == "analyze" else [d.artifacts]
    return [Path(n) for n in names if Path(n).is_dir()]


def _files_section(d: Diagnosis, ctx: ReportContext, page: Path) -> Iterator[str]:
    page = page.resolve()
    for root in run_roots(d, ctx):
        root = root.resolve()
        inside = page.is_relative_to(root)
        yield (f'<h2 id="files">{_e(display_path(str(root)))}</h2>'
               f'<p><a href="{_e(_href(root, page, inside) or ".")}">{_e(root)}</a></p><ul>')
        files = sorted(p for p in root.rglob("*") if p.is_file() and p != page)
        for p in files[:MAX_FILES]:
            try:
                size = f"{p.stat().st_size:,} B"
            except OSError:  # gone since (a probe's temporary file)
                continue
            yield (f'<li><a href="{_e(_href(p, page, inside))}">{_e(p.relative_to(root))}</a> '
                   f'<span class="dim">{size}</span></li>')
        if len(files) > MAX_FILES:
            yield f"<li>… and {len(files) - MAX_FILES} more files</li>"
        yield "</ul>"


def _footer(d: Diagnosis, ctx: ReportContext) -> Iterator[str]:
    parts = timing_parts(d)
    where = run_words(d, ctx)
    if where:
        parts.append(where)
    if parts:
        yield f'<p class="dim">{_e(" · ".join(parts))}</p>'


def to_html(d: Diagnosis, ctx: ReportContext, page: Path) -> str:
    """The whole page; ``page`` is where it will be written (for its links)."""
    ref = d.run.reference if isinstance(d.run, ScenarioRun) else None
    title = headline(d, ctx).plain
    body = [*_verdict_section(d, ctx), *_ranks_section(d),
            *_side_by_side(list(_timeline_section(d.timeline)), list(_routing_section(d))),
            *_stacks_section(d), *_reference_section(ref), *_evidence_section(d),
            *_files_section(d, ctx, page), *_footer(d, ctx)]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(title)}</title><style>{CSS}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def save_html(d: Diagnosis, ctx: ReportContext, page: Path) -> None:
    write_atomic(page, to_html(d, ctx, page).encode())


def save_console_log(d: Diagnosis, ctx: ReportContext, path: Path) -> None:
    """``console.log``: the first screen and every detail, at :data:`LOG_WIDTH` columns."""
    write_atomic(path, render_text(d, ctx, width=LOG_WIDTH, verbose=True).encode())
