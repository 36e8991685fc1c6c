"""False alarms of ``diagnose`` (issue 28): healthy generated jobs, one per family and step
layout, each with a straggler (one rank computes ``--busy`` seconds longer at one step while
the others wait for it in a collective, or on a handle they posted earlier), diagnosed at
random moments of that window; beside a busy neighbour for a third of them. A healthy job is
never hung: any exit 3 is a false alarm. Every job must still finish by itself, exit 0, after
being diagnosed, and leave no process behind.

    python scripts/false_alarms.py --seed S [--per-job K] [--busy SECONDS] [--family F ...]
                                   [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import subprocess
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import moe_hang.testing.fuzz.catalogue as catalogue
import moe_hang.testing.fuzz.families as families
from moe_hang.testing.fuzz.corpus import ROOT, corpus_module, role_envs, to_case
from moe_hang.testing.fuzz.draw import NEIGHBOUR_EVERY, JobSpec
from moe_hang.testing.fuzz.neighbour import busy_neighbour
from moe_hang.testing.fuzz.plant import Plant, eligible_sites
from moe_hang.testing.fuzz.runner import write_job
from moe_hang.testing.fuzz.shapes import SHAPES
from moe_hang.testing.fuzz.truth import Truth, truth
from moe_hang.testing.script import written

EXIT_PROBLEM = 3  # a verdict of a problem (or inconclusive): on a healthy job, a false alarm
FINISH_SLACK_S = 120.0  # after the busy window: the rest of the steps, two shared cores


@dataclass
class Diagnosed:
    at_s: float  # after every rank reached the busy step
    exit_code: int | None
    verdict: str | None
    rule: str | None
    culprits: list[int]
    summary: str
    wall_s: float
    error: str = ""  # the tool's [error] line (exit 1: e.g. the job ended under it)


@dataclass
class JobRun:
    name: str
    family: str
    shape: str
    world: int
    neighbour: bool
    busy_rank: int
    busy_s: float
    diagnosed: list[Diagnosed] = field(default_factory=list)
    job_exit: int | None = None
    # every rank printed "done", then one aborted in gloo's teardown ("terminate called
    # without an active exception"): torch's, seen without the tool too (docs/accuracy.md)
    teardown_abort: bool = False
    error: str | None = None
    survivors: list[str] = field(default_factory=list)

    @property
    def false_alarms(self) -> int:
        return sum(d.exit_code == EXIT_PROBLEM for d in self.diagnosed)

    @property
    def errors(self) -> int:
        return sum(d.exit_code not in (0, EXIT_PROBLEM) for d in self.diagnosed)


def healthy_jobs(seed: int, busy_s: float, only: set[str] | None) -> list[tuple[JobSpec, Truth]]:
    """One job per family and step layout the family takes: a straggler at step 2 of 4."""
    busy = catalogue.kind("busy")
    out = []
    index = 0
    for family in families.FAMILIES:
        if only and family not in only:
            continue
        for shape in SHAPES:
            rng = random.Random(f"{seed}:alarms:{family}:{shape}")
            world = rng.choice([w for w in families.worlds(family) if w <= 4])
            mesh = (2, world // 2) if family == "mesh2d" else None
            try:
                fam = families.build(family, world, mesh, shape)
            except ValueError:
                continue
            sites = eligible_sites(fam, busy)
            if not sites:
                continue
            site, variant = rng.choice(sites)
            plant = Plant("busy", site.name, 2, 4, variant, 0, busy_s)
            culprit = rng.randrange(world)
            t = truth(fam, plant, busy, frozenset({culprit}), frozenset(), "diagnose")
            out.append((JobSpec(seed, index, "busy", family, world, mesh, "torchrun",
                                "diagnose", plant, (culprit,), (), None, None, shape,
                                index % NEIGHBOUR_EVERY == 0), t))
            index += 1
    return out


def run_job(spec: JobSpec, t: Truth, work: Path, per_job: int, harness: Any) -> JobRun:
    rng = random.Random(f"{spec.seed}:alarms:moments:{spec.index}")
    res = JobRun(spec.name, spec.family, spec.shape, spec.world, spec.neighbour,
                 spec.culprits[0], spec.plant.seconds)
    jobs = work / "jobs"
    job = write_job(spec, jobs)
    case = to_case(spec, t, job)
    run_dir = work / spec.name
    marks = run_dir / "marks"
    marks.mkdir(parents=True)
    run_id = f"{harness.SESSION}-{uuid.uuid4().hex}"
    env = harness.case_env(case, role_envs(spec, t)[0], marks, run_id)
    pgids: list[int] = []
    limit = 120.0 + 15.0 * spec.world + spec.plant.seconds + FINISH_SLACK_S
    with contextlib.ExitStack() as stack:
        if spec.neighbour:
            stack.enter_context(busy_neighbour(limit))
        with open(run_dir / "job.log", "wb") as log:
            proc = subprocess.Popen(harness.torchrun_argv(job, spec.world), stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, cwd=jobs, start_new_session=True)
        pgids.append(proc.pid)
        try:
            err = harness.wait_marks(marks, "hang", spec.world, proc, limit)
            if err:
                res.error = err
                return res
            t0 = time.monotonic()
            # the busy window and a little after it: the ranks go on to finish the job
            moments = sorted(rng.uniform(0.0, spec.plant.seconds + 2.0) for _ in range(per_job))
            for k, at in enumerate(moments):
                time.sleep(max(0.0, at - (time.monotonic() - t0)))
                if proc.poll() is not None:
                    break
                res.diagnosed.append(_diagnose(proc.pid, run_dir / f"diag{k}", env, harness,
                                               time.monotonic() - t0))
            try:
                res.job_exit = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                res.error = f"the job did not finish within {limit:.0f} s after being diagnosed"
            log_text = (run_dir / "job.log").read_text(errors="replace")
            res.teardown_abort = res.job_exit != 0 and log_text.count(": done") >= spec.world \
                and "terminate called without an active exception" in log_text
        finally:
            with contextlib.suppress(OSError):
                proc.kill()
            res.survivors = harness.kill_run(run_id, pgids)
    return res


def _diagnose(pid: int, out: Path, env: dict[str, str], harness: Any, at: float) -> Diagnosed:
    t0 = time.monotonic()
    argv = [*harness.moe_hang_argv(), "diagnose", str(pid), "--json", "--out", str(out)]
    err = ""
    try:
        proc = subprocess.run(argv, capture_output=True, env=env, timeout=120,
                              start_new_session=True, check=False)
        code: int | None = proc.returncode
        err = " ".join(proc.stderr.decode(errors="replace").strip().splitlines()[-1:])
        d = json.loads(proc.stdout or b"{}")
    except subprocess.TimeoutExpired:
        code, d, err = None, {}, "diagnose did not end within 120 s"
    except json.JSONDecodeError:
        d = {}
    return Diagnosed(round(at, 2), code, d.get("verdict"), d.get("rule"),
                     list(d.get("culprit_ranks") or []), str(d.get("summary", ""))[:300],
                     round(time.monotonic() - t0, 2), err if code != 0 else "")


def table(runs: list[JobRun]) -> str:
    rows = ["family     layout  ranks  neighbour  diagnosed  false alarms  verdicts (exit 1: "
            "the tool's error)",
            "-" * 78]
    for r in runs:
        verdicts = Counter(d.verdict or f"exit {d.exit_code}" for d in r.diagnosed)
        what = ", ".join(f"{v} {n}" for v, n in sorted(verdicts.items())) or (r.error or "")
        rows.append(f"{r.family:<10} {r.shape:<7} {r.world:>5}  {'yes' if r.neighbour else '':<9}"
                    f"  {len(r.diagnosed):>9}  {r.false_alarms:>12}  {what}"[:120])
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--per-job", type=int, default=3, help="diagnoses per job")
    ap.add_argument("--busy", type=float, default=12.0, help="the straggler's extra seconds")
    ap.add_argument("--family", nargs="+", choices=list(families.FAMILIES))
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args(argv)
    harness = corpus_module("harness")
    work = ROOT / "runs" / f"alarms-{args.seed}-{uuid.uuid4().hex[:6]}"
    specs = healthy_jobs(args.seed, args.busy, set(args.family or ()))
    print(f"[alarms] seed {args.seed}: {len(specs)} healthy jobs x {args.per_job} diagnoses, "
          f"work directory {work}", flush=True)
    t0 = time.monotonic()
    runs = []
    for spec, t in specs:
        r = run_job(spec, t, work, args.per_job, harness)
        runs.append(r)
        print(f"{spec.name}: {spec.family}/{spec.shape} x{spec.world}"
              f"{' +neighbour' if spec.neighbour else ''}: "
              + ", ".join(f"{d.at_s:.1f}s→{d.verdict}({d.exit_code})" for d in r.diagnosed)
              + f"; job exit {r.job_exit}" + (f"; {r.error}" if r.error else "")
              + (f"; LEFT {r.survivors}" if r.survivors else ""), flush=True)
    n = sum(len(r.diagnosed) for r in runs)
    alarms = sum(r.false_alarms for r in runs)
    unfinished = [r.name for r in runs if r.job_exit != 0 and not r.teardown_abort]
    aborted = [r.name for r in runs if r.teardown_abort]
    out = written(Path(args.json) if args.json else work / "alarms.json")
    out.write_text(json.dumps({"schema": "moe-hang/alarms/v1", "seed": args.seed,
                               "per_job": args.per_job, "busy_s": args.busy,
                               "total_s": round(time.monotonic() - t0, 1),
                               "runs": [asdict(r) | {"false_alarms": r.false_alarms}
                                        for r in runs]}, indent=2) + "\n")
    print()
    print(table(runs))
    print(f"\nJSON {out} · {time.monotonic() - t0:.0f} s wall")
    print(f"jobs that did not finish: {len(unfinished)} {unfinished or ''}")
    print(f"jobs that finished, then a rank aborted in gloo's teardown (torch's, not the "
          f"tool's): {len(aborted)} {aborted or ''}")
    errors = [d.error for r in runs for d in r.diagnosed if d.exit_code not in (0, EXIT_PROBLEM)]
    print(f"the tool's errors: {len(errors)}" + "".join(f"\n  {e}" for e in errors))
    print(f"false alarms: {alarms}/{n} diagnoses of healthy jobs")
    return 1 if alarms or unfinished or any(r.survivors for r in runs) else 0
