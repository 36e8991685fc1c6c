"""What ``scripts/bench_postmortem.py`` records and how it judges and tabulates it: each tool's
run on a synthetic dump set (:class:`ToolRun`, :class:`Case`), torchfrtrace's findings parsed
from its log, moe-hang's from its JSON, both judged against the planted fault, the table, and
bench.json's ``postmortem`` key. No processes here: the script runs the tools."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ToolRun:
    status: str = "not run"  # ok | error | crashed | did not finish | not run
    rc: int | None = None
    wall_s: float | None = None
    cpu_s: float | None = None  # user + system, its own and its children's (wait4)
    peak_rss_mb: float | None = None
    ratio: float | None = None  # wall_s / the case's floor
    verdict: str | None = None  # moe-hang's verdict
    exact_culprit: bool | None = None  # moe-hang named the planted culprit(s) and no other
    reports: int = 0  # findings blocks the tool printed
    first: dict[str, Any] = field(default_factory=dict)  # its first finding
    named_culprit: bool | None = None  # the planted culprit among the first finding's ranks
    named_group: bool | None = None
    named_seq: bool | None = None
    any_named_culprit: bool | None = None  # ... among any finding's ranks
    error_tail: str = ""


@dataclass
class Case:
    ranks: int
    entries: int
    mesh: str
    fault: str
    set_dir: str
    set_mb: float
    gen_s: float | None
    truth: dict[str, Any]
    backend: str = "nccl"
    floor_s: float | None = None
    floor_cpu_s: float | None = None
    torchfrtrace: ToolRun = field(default_factory=ToolRun)
    moe_hang: ToolRun = field(default_factory=ToolRun)
    core: ToolRun = field(default_factory=ToolRun)
    screen: ToolRun = field(default_factory=ToolRun)  # the CLI as a person runs it


_SEQ = re.compile(r"(?:sequence number:|Collective sequence number:)\s*(\d+)")
_GROUP = re.compile(r"^group info:\s*(\S+)")
_MISSING = re.compile(r"^missing ranks:\s*\{([^}]*)\}")
_CULPRIT = re.compile(r"Culprit rank (\d+)")


def parse_frtrace(text: str) -> list[dict[str, Any]]:
    """torchfrtrace's findings: one block per reported collective (it logs through the
    'Flight Recorder' logger, one fact a line)."""
    blocks: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    for line in text.splitlines():
        m = _SEQ.search(line)
        if m and ("has errors" in line or "Not all ranks joining" in line
                  or "Input/output mismatch" in line):
            cur = {"kind": line.split(",")[0].split(":")[0].strip()[:60], "seq": int(m.group(1)),
                   "group": None, "collective": None, "ranks": []}
            blocks.append(cur)
            continue
        if cur is None:
            continue
        if (g := _GROUP.match(line)) is not None:
            cur["group"] = g.group(1).split(":")[0]
        elif line.startswith("collective: "):
            cur["collective"] = line.split(": ", 1)[1].strip()
        elif (mm := _MISSING.match(line)) is not None:
            cur["ranks"] += [int(x) for x in mm.group(1).split(",") if x.strip()]
        elif "Culprit rank" in line:
            cur["ranks"] += [int(x) for x in _CULPRIT.findall(line)]
    for b in blocks:
        b["ranks"] = sorted(set(b["ranks"]))
        if len(b["ranks"]) > 20:
            b["ranks"] = [*b["ranks"][:20], f"... {len(b['ranks'])} in all"]
    return blocks


def judge(run: ToolRun, blocks: list[dict[str, Any]], truth: dict[str, Any]) -> None:
    run.reports = len(blocks)
    culprits = set(truth.get("culprits", []))
    if not blocks:
        if truth.get("fault") != "none":
            run.named_culprit = run.named_group = run.named_seq = run.any_named_culprit = False
        return
    first = blocks[0]
    run.first = first
    if truth.get("fault") == "none":
        return
    gname = (truth.get("group") or {}).get("name")
    seqs = {truth.get("seq")} | ({truth["second_group"]["seq"]} if "second_group" in truth
                                 else set())
    groups = {gname} | ({truth["second_group"]["name"]} if "second_group" in truth else set())
    run.named_culprit = bool(culprits & {r for r in first["ranks"] if isinstance(r, int)})
    run.named_group = first["group"] in groups
    run.named_seq = first["seq"] in seqs
    run.any_named_culprit = any(culprits & {r for r in b["ranks"] if isinstance(r, int)}
                                for b in blocks)


def summary(r: ToolRun) -> str:
    if r.status == "did not finish":
        return f"did not finish in {r.wall_s} s (peak {r.peak_rss_mb} MB)"
    s = f"{r.status} rc={r.rc} {r.wall_s} s (cpu {r.cpu_s} s), peak {r.peak_rss_mb} MB"
    if r.ratio is not None:
        s += f", {r.ratio}x the floor"
    if r.verdict is not None:
        s += f", {r.verdict} {r.first.get('culprit_ranks')} {r.first.get('pg')}#" \
             f"{r.first.get('seq')}"
    else:
        s += f", {r.reports} findings"
    if r.named_culprit is not None:
        s += (f"; culprit {_yn(r.named_culprit)} group {_yn(r.named_group)} "
              f"seq {_yn(r.named_seq)}")
    if r.error_tail:
        s += " | " + r.error_tail.splitlines()[-1][:160]
    return s


def _yn(b: bool | None) -> str:
    return "-" if b is None else ("yes" if b else "NO")


def _right(r: ToolRun) -> str:
    """culprit/group/seq, each yes or NO ('-' where not judged); exact culprit set marked."""
    if r.status in ("not run",):
        return "-"
    if r.status != "ok":
        return r.status
    return f"{_yn(r.named_culprit)}/{_yn(r.named_group)}/{_yn(r.named_seq)}"


# every tool a case measures, as its Case field names them
TOOLS = ("torchfrtrace", "moe_hang", "core", "screen")


def _secs(r: ToolRun) -> str:
    if r.wall_s is None:
        return "-"
    return f">{r.wall_s:.0f}" if r.status == "did not finish" else f"{r.wall_s:.2f}"


HEAD = ("backend", "size", "fault", "set MB", "floor s", "frtrace s", "frtrace MB",
        "frtrace c/g/s", "moe-hang s", "ratio", "moe-hang MB", "moe-hang c/g/s", "core s",
        "core ratio", "core CPU ratio", "screen s", "screen ratio")


def _cpu_ratio(r: ToolRun, floor_cpu: float | None) -> str:
    """CPU seconds (the process and its workers) over the floor's: steadier than wall time
    on a shared machine, and what a second core cannot hide."""
    if r.cpu_s is None or not floor_cpu or r.status != "ok":
        return "-"
    return f"{r.cpu_s / floor_cpu:.2f}"


def rows(cases: list[Case]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for c in cases:
        t, m, k, v = c.torchfrtrace, c.moe_hang, c.core, c.screen
        out.append((
            c.backend, f"{c.ranks}x{c.entries}", c.fault, f"{c.set_mb}", f"{c.floor_s}",
            _secs(t), "-" if t.peak_rss_mb is None else f"{t.peak_rss_mb:.0f}",
            _right(t) if t.status != "crashed" else "crashed",
            _secs(m), "-" if m.ratio is None else f"{m.ratio:.2f}",
            "-" if m.peak_rss_mb is None else f"{m.peak_rss_mb:.0f}",
            _right(m) if m.status != "not run" else _right(k),
            _secs(k), "-" if k.ratio is None else f"{k.ratio:.2f}",
            _cpu_ratio(k, c.floor_cpu_s),
            _secs(v), "-" if v.ratio is None else f"{v.ratio:.2f}"))
    return out


def table(cases: list[Case]) -> str:
    body: list[tuple[str, ...]] = [HEAD, *rows(cases)]
    widths = [max(len(str(r[i])) for r in body) for i in range(len(HEAD))]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(r, widths, strict=True)) for r in body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown(cases: list[Case]) -> str:
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(cases)]
    return "\n".join(lines)


_RUN_KEYS = ("status", "wall_s", "cpu_s", "peak_rss_mb", "ratio", "verdict", "named_culprit",
             "named_group", "named_seq", "exact_culprit", "any_named_culprit")


def compact(case: dict[str, Any]) -> dict[str, Any]:
    """A case as bench.json keeps it: the planted fault and each tool's numbers and answers
    (--json has everything, findings and logs' tails included)."""
    t = case["truth"]
    out = {k: case[k] for k in ("backend", "ranks", "entries", "mesh", "fault", "set_mb",
                                "floor_s", "floor_cpu_s")}
    out["planted"] = {"culprits": t.get("culprits"), "group": (t.get("group") or {}).get("name"),
                      "seq": t.get("seq")}
    for tool in TOOLS:
        out[tool] = {k: case[tool].get(k) for k in _RUN_KEYS if case[tool].get(k) is not None}
    return out


def case_key(c: dict[str, Any]) -> tuple[Any, ...]:
    return (c.get("backend"), c.get("ranks"), c.get("entries"), c.get("mesh"), c.get("fault"))


def update_bench_json(path: Path, result: dict[str, Any]) -> None:
    """bench.json's ``postmortem`` key gains this run (its meta under ``runs``, its cases
    replacing those of the same backend, size, mesh and fault); every other key stays."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    if not isinstance(data, dict):
        data = {}
    found = data.get("postmortem")
    old: dict[str, Any] = found if isinstance(found, dict) else {}
    before = {case_key(c): c for c in old.get("cases", [])}
    fresh = [compact(c) for c in result["cases"]]
    for c in fresh:  # a tool this run skipped keeps its earlier result
        prev = before.get(case_key(c), {})
        for tool in TOOLS:
            if c[tool].get("status") == "not run" and tool in prev:
                c[tool] = prev[tool]
    new_keys = {case_key(c) for c in fresh}
    cases = [c for c in old.get("cases", []) if case_key(c) not in new_keys] + fresh
    data["postmortem"] = {"runs": [*old.get("runs", []), result["meta"]], "cases": cases}
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")  # bench.py's layout
    tmp.replace(path)


def case_from(d: dict[str, Any]) -> Case:
    fields: dict[str, Any] = dict(d)
    for k in TOOLS:
        if k in fields:
            fields[k] = ToolRun(**fields[k])
    return Case(**fields)
