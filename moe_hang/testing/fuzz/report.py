"""What a fuzz run prints and writes: a line per run while it runs, the table by fault kind,
the JSON of every field of every run, and each miss as a self-contained corpus case (the job
file with its markers, the ``Case(...)`` source, the run directory)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from moe_hang.testing.fuzz.catalogue import KINDS
from moe_hang.testing.fuzz.runner import Run

COLUMNS = ("verdict", "exit", "culprit", "lines", "advice")
OK, NOT_CHECKED = "ok", "n/a"


def _bad(r: Run) -> dict[str, str]:
    return {k: v for k, v in r.score.checks.items() if v not in (OK, NOT_CHECKED)}


def run_line(i: int, n: int, r: Run) -> str:
    s = r.spec
    result = "ok" if r.ok else "MISS " + "; ".join(f"{k}: {v}" for k, v in _bad(r).items())
    if len(result) > 160:
        result = result[:159] + "…"
    return (f"[{i:>{len(str(n))}}/{n}] seed {s.seed} job {s.index:03d} {s.kind:<12} "
            f"{s.family:<9} w{s.world} {s.launch:<9} {s.mode:<8} "
            f"{'neighbour' if s.neighbour else 'alone':<9} "
            f"{'no-stacks' if s.stackless else 'stacks':<9} "
            f"{'mirrored' if r.mirrored else 'primary ':<8} {r.wall_s:>6.1f}s  {result}")


def _cell(runs: Sequence[Run], key: str) -> str:
    checked = [r for r in runs if r.score.checks.get(key) != NOT_CHECKED]
    if not checked:
        return "-"
    return f"{sum(r.score.checks[key] == OK for r in checked)}/{len(checked)}"


def table(runs: Sequence[Run]) -> str:
    """By fault kind; a mirrored twin is a run of its own."""
    head = (f"{'fault kind':<13} {'runs':>4}  {'fully right':>11}  "
            + "  ".join(f"{c:>7}" for c in COLUMNS))
    rows = ["runs by fault kind (a mirrored twin is a run of its own; a cell: right/checked)",
            head, "-" * len(head)]
    for k in [k.name for k in KINDS]:
        mine = [r for r in runs if r.spec.kind == k]
        if not mine:
            continue
        right = sum(r.ok for r in mine)
        rows.append(f"{k:<13} {len(mine):>4}  {right:>5}/{len(mine):<5}  "
                    + "  ".join(f"{_cell(mine, c):>7}" for c in COLUMNS))
    right = sum(r.ok for r in runs)
    rows.append("-" * len(head))
    rows.append(f"{'all':<13} {len(runs):>4}  {right:>5}/{len(runs):<5}  "
                + "  ".join(f"{_cell(runs, c):>7}" for c in COLUMNS))
    for what, key in (("family", lambda r: r.spec.family), ("world", lambda r: f"w{r.spec.world}"),
                      ("launch", lambda r: r.spec.launch), ("mode", lambda r: r.spec.mode),
                      ("neighbour", lambda r: "busy" if r.spec.neighbour else "alone"),
                      ("recorder", lambda r: "stackless" if r.spec.stackless else "stacks")):
        groups: dict[str, list[Run]] = {}
        for r in runs:
            groups.setdefault(key(r), []).append(r)
        rows.append(f"by {what}: " + ", ".join(
            f"{g} {sum(x.ok for x in rs)}/{len(rs)}" for g, rs in sorted(groups.items())))
    return "\n".join(rows)


def markdown(runs: Sequence[Run]) -> str:
    """The table by fault kind for the README (a mirrored twin is a run of its own)."""
    rows = ["| fault kind | runs | fully right | verdict | exit | culprit | lines | advice |",
            "|---|---|---|---|---|---|---|---|"]
    for k in [k.name for k in KINDS]:
        mine = [r for r in runs if r.spec.kind == k]
        if mine:
            rows.append(f"| {k} | {len(mine)} | {sum(r.ok for r in mine)}/{len(mine)} | "
                        + " | ".join(_cell(mine, c) for c in COLUMNS) + " |")
    right = sum(r.ok for r in runs)
    pct = f" ({100 * right / len(runs):.0f} %)" if runs else ""
    rows.append(f"| **all** | {len(runs)} | **{right}/{len(runs)}{pct}** | "
                + " | ".join(_cell(runs, c) for c in COLUMNS) + " |")
    return "\n".join(rows)


def accuracy_line(runs: Sequence[Run]) -> str:
    return f"accuracy: {sum(r.ok for r in runs)}/{len(runs)} runs fully right"


def _label(r: Run) -> str:
    return r.spec.name + ("-mirrored" if r.mirrored else "")


def write_miss(r: Run, misses: Path) -> Path:
    """The miss as a corpus case: ``<name>.py`` (the job) and ``case.py`` (what to add to
    tests/corpus/cases.py, with what differed and where the run's files are)."""
    d = misses / _label(r)
    d.mkdir(parents=True, exist_ok=True)
    (d / r.job.name).write_text(r.job.read_text())
    o = r.score.outcome
    dirs = [n.out_dir for n in o.nodes] if o.nodes else [o.out_dir]
    which = "mirrored twin" if r.mirrored else "primary"
    head = [f"# {_label(r)}: the tool got it wrong ({which} run)",
            f"# job: {r.job.name} (copy it to tests/corpus/jobs/)",
            *(f"# run directory: {x}" for x in dirs),
            f"# environment of this run: {r.score.env}"]
    head += [f"# {k}: {v}" for k, v in _bad(r).items()]
    got = r.score.got
    head.append(f"# tool said: verdict {got.get('verdict')}, culprits {got.get('culprits')}, "
                f"exit {got.get('exit_code')}")
    for line in str(got.get("summary") or "").splitlines():
        head.append(f"#   {line}")
    body = "\n".join(head) + "\n\n" + r.case_source
    (d / "case.py").write_text(body)
    return d


def run_json(r: Run, score_json: dict[str, Any]) -> dict[str, Any]:
    spec = asdict(r.spec)
    return {"spec": spec, "name": r.spec.name, "mirrored": r.mirrored, "job": str(r.job),
            "wall_s": r.wall_s, "case_source": r.case_source,
            "truth_outcome": r.truth.primary.outcome.state, **score_json}


def write_json(path: Path, header: dict[str, Any], runs: Sequence[Run],
               score_jsons: Sequence[dict[str, Any]]) -> None:
    by_kind = {}
    for k in KINDS:
        mine = [r for r in runs if r.spec.kind == k.name]
        if mine:
            by_kind[k.name] = {"runs": len(mine), "right": sum(r.ok for r in mine),
                               **{c: _cell(mine, c) for c in COLUMNS}}
    report = {**header, "runs": [run_json(r, sj) for r, sj in zip(runs, score_jsons, strict=True)],
              "by_kind": by_kind,
              "accuracy": {"right": sum(r.ok for r in runs), "runs": len(runs)}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
