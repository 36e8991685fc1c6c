"""``scripts/fuzz.py``: generate N runs of real jobs with planted faults from a seed, run each
through the real CLI, score it against the generator's truth; print a line per run, the table
by fault kind and, last, ``accuracy: R/N runs fully right``.

    python scripts/fuzz.py --seed S [-n N] [--json OUT] [--workdir DIR] [--kind K ...]
                           [--family F ...] [--job I ...] [--list] [--strict]
                           [--rescore REPORT [--markdown] [--rediagnose]]

N counts runs: a job and its mirrored twin (the roles swapped) are two. Every miss is written
as a self-contained corpus case under ``<workdir>/misses/``. Exit 0 when every run was scored
and no process outlived it (``--strict``: and every run was fully right), 1 otherwise."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import moe_hang.testing.fuzz.catalogue as catalogue
import moe_hang.testing.fuzz.families as families
import moe_hang.testing.fuzz.report as report
import moe_hang.testing.fuzz.runner as runner
from moe_hang.testing.fuzz.corpus import ROOT, corpus_module, describe


def _workdir(arg: str | None, seed: int) -> Path:
    base = Path(arg).resolve() if arg else ROOT / "runs" / f"fuzz-{seed}"
    p, k = base, 1
    while p.exists():  # never write over an earlier run of the same seed
        k += 1
        p = base.with_name(f"fuzz-{seed}.{k}")
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("-n", type=int, default=200, help="runs (a mirrored twin is a run)")
    ap.add_argument("--json", metavar="OUT", help="every field of every run "
                    "(default: <workdir>/fuzz.json)")
    ap.add_argument("--workdir", metavar="DIR", help="jobs, run directories and misses "
                    "(default: runs/fuzz-SEED/)")
    ap.add_argument("--kind", nargs="+", metavar="K",
                    choices=[k.name for k in catalogue.KINDS],
                    help="only the jobs of these fault kinds (the others are drawn and skipped)")
    ap.add_argument("--family", nargs="+", metavar="F", choices=list(families.FAMILIES),
                    help="only the jobs of these families")
    ap.add_argument("--job", nargs="+", type=int, metavar="I",
                    help="only these jobs of the seed (by index: to run a miss again)")
    ap.add_argument("--list", action="store_true", help="print what would run, run nothing")
    ap.add_argument("--rescore", metavar="REPORT", help="score the runs of a saved JSON "
                    "report again against the truth drawn now (runs nothing)")
    ap.add_argument("--strict", action="store_true", help="exit 1 unless every run is right")
    ap.add_argument("--markdown", action="store_true",
                    help="with --rescore: print the table by fault kind as Markdown too")
    ap.add_argument("--rediagnose", action="store_true",
                    help="with --rescore: analyse each run's saved evidence again with this "
                         "code first (the jobs are not run again)")
    args = ap.parse_args(argv)
    if args.rediagnose and not args.rescore:
        ap.error("--rediagnose needs --rescore REPORT")
    if args.n < 1:
        ap.error("-n must be at least 1")
    only = runner.Only(frozenset(args.kind) if args.kind else None,
                       frozenset(args.family) if args.family else None,
                       frozenset(args.job) if args.job else None)
    if args.list:
        count = 0
        for spec, t in runner.jobs(args.seed, only):
            if count >= args.n:
                break
            runs = min(len(t.roles()), args.n - count)
            count += runs
            print(f"{spec.name}: {describe(spec)} ({runs} run{'s' * (runs > 1)})")
        return 0
    if args.rescore:
        left_out: list[str] = []
        again = runner.rescore(json.loads(Path(args.rescore).read_text()), left_out,
                               args.rediagnose)
        for i, r in enumerate(again, 1):
            print(report.run_line(i, len(again), r))
        if left_out:
            print(f"left out (drawn differently now): {', '.join(left_out)}")
        print(report.table(again))
        if args.markdown:
            print(report.markdown(again))
        print(report.accuracy_line(again))
        return 0
    work = _workdir(args.workdir, args.seed)
    work.mkdir(parents=True, exist_ok=True)
    command = shlex.join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])
    print(f"[fuzz] seed {args.seed}, {args.n} runs, work directory {work}", flush=True)
    t0 = time.monotonic()
    harness = corpus_module("harness")
    misses = work / "misses"
    miss_dirs: list[Path] = []
    done: list[runner.Run] = []

    def on_run(r: runner.Run) -> None:
        done.append(r)
        print(report.run_line(len(done), args.n, r), flush=True)
        if not r.ok:
            miss_dirs.append(report.write_miss(r, misses))

    with runner.session() as sid:
        runs = runner.run(args.seed, args.n, work, on_run, only)
        left = runner.left_behind(sid)
    total = round(time.monotonic() - t0, 1)
    out = Path(args.json) if args.json else work / "fuzz.json"
    report.write_json(out, {"schema": "moe-hang/fuzz/v1", "seed": args.seed, "n": args.n,
                            "command": command, "total_s": total, "work_dir": str(work),
                            "alive_at_end": left},
                      runs, [harness.score_to_json(r.score) for r in runs])
    print()
    print(f"seed {args.seed} · `{command}` · {total:.0f} s wall · JSON {out}")
    print(f"misses written as corpus cases: {len(miss_dirs)} under {misses}"
          if miss_dirs else "misses: none")
    print(f"processes of any run alive at the end: {len(left)}" + (f" {left}" if left else ""))
    print(report.table(runs))
    print(report.accuracy_line(runs))
    survivors = any(r.score.outcome.survivors for r in runs)
    unscored = any(r.score.checks.get("run") != "ok" for r in runs)
    if left or survivors:
        return 1
    if args.strict and (unscored or not all(r.ok for r in runs)):
        return 1
    return 0
