"""The accuracy corpus: run every case of tests/corpus/cases.py through the real CLI, one at a
time, and score each diagnosis against its ground truth.

    python scripts/corpus.py [--fast] [--case NAME ...] [--json OUT] [--no-mirror]
                             [--require-basis] [--workdir DIR] [--list] [--rescore REPORT]

Prints a table (case, verdict, culprit, lines, advice: ``ok`` or what differed), then the
accuracy (runs fully right / runs scored; a mirrored twin is a run of its own). Every case has
a hard timeout, and after each one every process it started is killed (its process groups and
every process carrying its ``MOE_HANG_CORPUS_RUN`` id); a survivor is reported and fails the
run. Exit 0 when every run scored is right, 1 otherwise (2 on a usage error).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "corpus"
if str(CORPUS) not in sys.path:
    sys.path.insert(0, str(CORPUS))

import harness  # noqa: E402
from cases import CASES  # noqa: E402

from moe_hang.testing.script import end_on_signals, exit_code  # noqa: E402

COLUMNS = ("verdict", "culprit", "lines", "advice")


def _out(path: str) -> Path:
    """Where --json goes, its directory made first (a fresh clone has no runs/). The runner
    imports nothing of moe_hang: it only runs its command line."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def _cell(score: harness.Score, key: str, width: int) -> str:
    if score.skipped:
        return "-"
    value = score.checks.get(key, harness.NOT_CHECKED)
    if key == "verdict" and value == harness.OK:
        value = f"ok {score.got.get('verdict')}"
    if key == "culprit" and value == harness.OK and score.got.get("culprits"):
        value = f"ok {score.got.get('culprits')}"
    return value if len(value) <= width else value[: width - 1] + "…"


def _others(score: harness.Score) -> str:
    if score.skipped:
        return score.skipped
    bad = [f"{k}: {v}" for k, v in score.checks.items()
           if k not in COLUMNS and v not in (harness.OK, harness.NOT_CHECKED)]
    return "; ".join(bad)


def table(scores: list[harness.Score]) -> str:
    widths = {"case": max([len("case"), *(len(s.label) for s in scores)]),
              "verdict": 26, "culprit": 18, "lines": 44, "advice": 30}
    head = (f"{'case':<{widths['case']}}  {'verdict':<{widths['verdict']}}  "
            f"{'culprit':<{widths['culprit']}}  {'lines':<{widths['lines']}}  "
            f"{'advice':<{widths['advice']}}  {'time':>6}  other")
    rows = [head, "-" * len(head)]
    for s in scores:
        rows.append(
            f"{s.label:<{widths['case']}}  "
            + "  ".join(f"{_cell(s, k, widths[k]):<{widths[k]}}" for k in COLUMNS)
            + f"  {s.outcome.wall_s:>5.1f}s  {_others(s)}")
    scored = [s for s in scores if s.skipped is None]
    right = sum(s.ok for s in scored)
    rows.append("")
    rows.append(f"accuracy: {right}/{len(scored)} runs fully right"
                + (f" ({100 * right / len(scored):.0f} %)" if scored else "")
                + (f"; {len(scores) - len(scored)} skipped" if len(scored) < len(scores)
                   else ""))
    per_field = []
    for key in (*harness.FIELDS,):
        checked = [s for s in scored if s.checks.get(key) != harness.NOT_CHECKED]
        if checked:
            good = sum(s.checks[key] == harness.OK for s in checked)
            per_field.append(f"{key} {good}/{len(checked)}")
    if per_field:
        rows.append("per field: " + ", ".join(per_field))
    leaks = [s.label for s in scores if s.outcome.survivors or s.outcome.tool_leaked]
    rows.append("processes left behind: " + (", ".join(leaks) if leaks else "none"))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fast", action="store_true", help="only the fast subset (CI)")
    ap.add_argument("--case", nargs="+", metavar="NAME", help="only these cases")
    ap.add_argument("--json", metavar="OUT", help="write every field of every run here")
    ap.add_argument("--no-mirror", action="store_true", help="skip the mirrored twins")
    ap.add_argument("--require-basis", action="store_true",
                    help="an expected culprit_basis/certainty that is absent is a miss")
    ap.add_argument("--workdir", metavar="DIR",
                    help="keep each run's files here (default: a new directory in /tmp)")
    ap.add_argument("--clean", action="store_true",
                    help="delete the work directory at the end")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--rescore", metavar="REPORT",
                    help="score the runs saved in a --json report again (runs nothing)")
    ap.add_argument("--rediagnose", action="store_true",
                    help="with --rescore: analyse each run's saved evidence again with this "
                         "code first (the jobs are not run again)")
    args = ap.parse_args(argv)
    if args.rediagnose and not args.rescore:
        ap.error("--rediagnose needs --rescore REPORT")
    if args.rescore:
        again = harness.rescore(json.loads(Path(args.rescore).read_text()),
                                args.require_basis, args.rediagnose)
        print(table(again))
        if args.json:
            _out(args.json).write_text(json.dumps(
                {"schema": "moe-hang/corpus/v1", "rescored_from": args.rescore,
                 "runs": [harness.score_to_json(s) for s in again]}, indent=1, default=str)
                + "\n")
        return 0 if all(s.ok or s.skipped for s in again) else 1

    cases = harness.select(args.case, args.fast)
    if args.list:
        for c in CASES:
            twin = " +mirror" if c.mirror is not None else ""
            print(f"{c.name:<30} {c.mode:<8} n={c.nproc} {'fast ' if c.fast else ''}"
                  f"{'|'.join(sorted(c.verdicts))}{twin}")
        return 0
    work = harness.new_workdir(args.workdir)
    print(f"[corpus] {len(cases)} case(s), work directory {work}", file=sys.stderr, flush=True)
    scores: list[harness.Score] = []
    t0 = time.monotonic()
    for case in cases:
        for i, (env, mirrored) in enumerate(harness.runs_of(case, not args.no_mirror)):
            label = case.name + (" (mirrored)" if mirrored else "")
            print(f"[corpus] {label} ...", file=sys.stderr, flush=True)
            s = harness.run_and_score(case, env, mirrored, work / f"{case.name}-{i}",
                                      require_basis=args.require_basis)
            scores.append(s)
            status = s.skipped or ("ok" if s.ok else "WRONG: " + "; ".join(
                f"{k} {v}" for k, v in s.checks.items()
                if v not in (harness.OK, harness.NOT_CHECKED)))
            print(f"[corpus]   {s.outcome.wall_s:.1f} s  {status}", file=sys.stderr,
                  flush=True)
    left = harness.any_tagged()
    print(table(scores))
    print(f"processes of this corpus run alive at the end: {len(left)}"
          + (f" {left}" if left else ""))
    total = round(time.monotonic() - t0, 1)
    print(f"total {total} s", file=sys.stderr)
    if args.json:
        report: dict[str, Any] = {
            "schema": "moe-hang/corpus/v1", "total_s": total, "work_dir": str(work),
            "runs": [harness.score_to_json(s) for s in scores],
            "accuracy": {"right": sum(s.ok for s in scores if s.skipped is None),
                         "scored": sum(s.skipped is None for s in scores),
                         "skipped": sum(s.skipped is not None for s in scores)}}
        report["alive_at_end"] = left
        _out(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    if args.clean:
        shutil.rmtree(work, ignore_errors=True)
    survivors = [s for s in scores if s.outcome.survivors]
    return 0 if all(s.ok or s.skipped for s in scores) and not survivors and not left else 1


if __name__ == "__main__":
    end_on_signals()  # SIGTERM ends the running case's process groups, as Ctrl-C does
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:
        sys.exit(exit_code(exc))
    except (OSError, ValueError) as exc:  # one line, never a traceback
        print(f"[error] corpus.py: {exc}", file=sys.stderr)
        sys.exit(1)
