"""Side-by-side post-mortem benchmark on synthetic Flight Recorder dump sets.

    python scripts/bench_postmortem.py [--sizes 512x200,2048x200,512x2000,8192x200@64x128]
        [--faults missing_rank,size,...] [--backends nccl[,gloo]] [--timeout 300]
        [--repeat N] [--json OUT] [--bench-json bench.json] [--markdown FILE] [--work DIR]
        [--no-torchfrtrace] [--no-moe-hang] [--no-core] [--version V]

For each size RANKSxENTRIES (optionally ``@DPxTP``; default mesh RANKS/8 x 8), backend and
fault kind it makes (or reuses) a dump set with scripts/fr_synth.py, then measures on that same
set, one after the other:

  (a) floor: a bare ``pickle.load`` of every dump file, in this process, page cache warm
      (every file read once first), garbage collector off as torchfrtrace has it;
  (b) torchfrtrace DIR -p PREFIX, as a subprocess: wall time, CPU time and peak RSS (from
      wait4), exit status, and whether its report named the planted culprit, group and
      sequence number;
  (c) moe-hang analyze DIR --json of this checkout (``python -m moe_hang.cli``), the same way,
      judged from its JSON (``culprit_ranks``, ``first_divergence.pg`` / ``.seq``);
  (d) "core": the same analysis without the CLI's report rendering (``analyze_paths`` and the
      JSON, in a subprocess): what reading the dumps and the verdict cost by themselves;
  (e) "screen": ``moe-hang analyze DIR`` as a person runs it, to its first screen (exit 3 or
      0 is an answer; the verdict itself is judged from (c)).

``ratio`` is wall time over the floor measured in the same case. With ``--repeat N`` the floor
and moe-hang runs are repeated and the fastest kept (the machine is shared; torchfrtrace runs
once). A run past --timeout is killed with its process group and reported as "did not
finish". Prints a table (and a Markdown one with --markdown); --json writes every number;
--bench-json adds them under the ``postmortem`` key of bench.json (a later run replaces the
cases it measured again), keeping its other keys.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from moe_hang.testing.postmortem_bench import (
    TOOLS,
    Case,
    ToolRun,
    case_from,
    case_key,
    judge,
    markdown,
    parse_frtrace,
    summary,
    table,
    update_bench_json,
)
from moe_hang.testing.script import run, written

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


def _load_synth() -> Any:
    from moe_hang.testing import fr_synth

    return fr_synth


@dataclass
class Bounded:
    status: str  # exited | did not finish
    rc: int | None
    wall_s: float
    cpu_s: float
    peak_rss_mb: float


def run_bounded(cmd: list[str], timeout: float, log: Path,
                env: dict[str, str] | None = None) -> Bounded:
    """Run ``cmd`` with stdout+stderr to ``log``; kill its process group past ``timeout`` or on
    Ctrl-C. CPU (with the children it reaped) comes from wait4; peak memory is the larger of
    wait4's peak RSS (one process) and the highest sum of RSS over the process and its
    children, sampled every 20 ms (moe-hang's worker processes count, shared pages twice)."""
    with log.open("wb") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env, cwd=ROOT)
        tree_peak = 0
        try:
            while True:
                pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    wall = time.monotonic() - t0
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    return Bounded("exited", proc.returncode, wall, ru.ru_utime + ru.ru_stime,
                                   max(ru.ru_maxrss * 1024, tree_peak) / 2**20)
                if time.monotonic() - t0 > timeout:
                    os.killpg(proc.pid, signal.SIGKILL)
                    _, status, ru = os.wait4(proc.pid, 0)
                    return Bounded("did not finish", None, time.monotonic() - t0,
                                   ru.ru_utime + ru.ru_stime,
                                   max(ru.ru_maxrss * 1024, tree_peak) / 2**20)
                tree_peak = max(tree_peak, _tree_rss(proc.pid))
                time.sleep(0.02)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            raise


def _tree_rss(pid: int) -> int:
    """Bytes resident in ``pid`` and its descendants now (0 when it is gone)."""
    try:
        import psutil

        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except Exception:  # psutil missing, or the process just ended
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except Exception:
            continue
    return total


def _truth_targets(truth: dict[str, Any]) -> tuple[set[Any], set[Any]]:
    """The groups and sequence numbers a right answer may name (an order fault is a cycle
    through two groups: either end is right)."""
    groups = {(truth.get("group") or {}).get("name")}
    seqs = {truth.get("seq")}
    if "second_group" in truth:
        groups.add(truth["second_group"]["name"])
        seqs.add(truth["second_group"]["seq"])
    return groups, seqs


def judge_moe_hang(run: ToolRun, verdict: dict[str, Any], truth: dict[str, Any]) -> None:
    """From the diagnosis JSON (docs/DESIGN.md §5): its culprits and first divergence."""
    run.verdict = verdict.get("verdict")
    ranks = [r for r in verdict.get("culprit_ranks") or [] if isinstance(r, int)]
    fd = verdict.get("first_divergence") or {}
    run.first = {"verdict": run.verdict, "culprit_ranks": ranks[:20], "pg": fd.get("pg"),
                 "seq": fd.get("seq"), "kind": fd.get("kind")}
    run.reports = 1 if ranks or fd else 0
    culprits = set(truth.get("culprits", []))
    if truth.get("fault") == "none":
        run.exact_culprit = not ranks
        return
    run.named_culprit = bool(culprits) and culprits <= set(ranks)
    run.any_named_culprit = run.named_culprit
    run.exact_culprit = set(ranks) == culprits
    groups, seqs = _truth_targets(truth)
    run.named_group = fd.get("pg") in groups
    run.named_seq = fd.get("seq") in seqs


def floor_load(files: list[Path]) -> tuple[float, float]:
    """(wall, CPU) seconds of a bare pickle.load of every file, cache warm, GC off."""
    for p in files:  # warm the page cache
        p.read_bytes()
    gc.disable()
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        for p in files:
            with p.open("rb") as f:
                pickle.load(f)
        return time.perf_counter() - t0, time.process_time() - c0
    finally:
        gc.enable()


# analyze_paths and the JSON, without the CLI's rich report (what (d) measures)
CORE = ("import sys; from pathlib import Path; "
        "from moe_hang.commands.diagnose import analyze_paths; "
        "from moe_hang.report.json import to_json; "
        "print(to_json(analyze_paths([Path(sys.argv[1])], force=False)))")


def _env(work: Path) -> dict[str, str]:
    """This checkout on the path, with compiled bytecode as an installed package has it
    (PYTHONDONTWRITEBYTECODE would recompile every module at every start), kept under
    ``work`` so the tree stays clean."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONPYCACHEPREFIX=str(work / "pycache"))
    env.pop("MOE_HANG_DEBUG", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def bench_case(args: argparse.Namespace, synth: Any, size: str, backend: str, fault: str,
               work: Path) -> Case:
    spec, _, mesh = size.partition("@")
    ranks, entries = (int(x) for x in spec.lower().split("x"))
    dp, tp = synth.parse_mesh(mesh or None, ranks)
    mesh = f"{dp}x{tp}"
    d = work / f"{backend}_{args.version}_{ranks}x{entries}_{mesh}_{fault}_s{args.seed}"
    truth_path = d / synth.TRUTH_NAME
    gen_s = None
    if not truth_path.exists():
        t0 = time.monotonic()
        synth.main([str(d), "--ranks", str(ranks), "--entries", str(entries), "--mesh", mesh,
                    "--fault", fault, "--backend", backend, "--version", args.version,
                    "--seed", str(args.seed)] + (["--frames"] if args.frames else []))
        gen_s = time.monotonic() - t0
    truth = json.loads(truth_path.read_text())
    prefix = truth["prefix"]
    files = sorted(p for p in d.iterdir() if p.name.startswith(prefix))
    case = Case(ranks, entries, mesh, fault, str(d),
                round(sum(p.stat().st_size for p in files) / 1e6, 1), gen_s, truth,
                backend=backend)
    print(f"[{backend} {ranks}x{entries} {fault}] set {case.set_mb} MB", flush=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    tag = d.name
    if not args.no_torchfrtrace:
        log = logs / f"{tag}.torchfrtrace.log"
        cmd = [str(VENV_BIN / "torchfrtrace"), str(d), "-p", prefix]
        case.torchfrtrace = tool_run(cmd, args.timeout, log, truth, frtrace=True)
        print(f"  torchfrtrace: {summary(case.torchfrtrace)}", flush=True)
    runs: list[tuple[str, list[str]]] = []
    if not args.no_moe_hang:
        runs.append(("moe_hang", [sys.executable, "-m", "moe_hang.cli", "analyze", str(d),
                                  "--json"]))
    if not args.no_core:
        runs.append(("core", [sys.executable, "-c", CORE, str(d)]))
    if not args.no_moe_hang:
        runs.append(("screen", [sys.executable, "-m", "moe_hang.cli", "analyze", str(d)]))
    floors: list[tuple[float, float]] = []
    for _ in range(max(1, args.repeat)):
        # floor and moe-hang back to back, so both see the same load on a shared machine
        floors.append(floor_load(files))
        for name, cmd in runs:
            got = tool_run(cmd, args.timeout, logs / f"{tag}.{name}.log", truth, frtrace=False,
                           screen=name == "screen")
            best = getattr(case, name)
            if best.wall_s is None or (got.wall_s is not None and got.wall_s < best.wall_s):
                setattr(case, name, got)
    case.floor_s = round(min(f[0] for f in floors), 3)
    case.floor_cpu_s = round(min(f[1] for f in floors), 3)
    print(f"  floor pickle.load: {case.floor_s} s (cpu {case.floor_cpu_s} s)", flush=True)
    for name, _cmd in runs:
        r = getattr(case, name)
        if r.wall_s is not None and case.floor_s:
            r.ratio = round(r.wall_s / case.floor_s, 2)
        label = {"moe_hang": "analyze", "core": "core   "}.get(name, name)
        print(f"  moe-hang {label}: {summary(r)}", flush=True)
    return case


def tool_run(cmd: list[str], timeout: float, log: Path, truth: dict[str, Any],
             frtrace: bool, screen: bool = False) -> ToolRun:
    b = run_bounded(cmd, timeout, log, env=None if frtrace else _env(log.parent.parent))
    run = ToolRun(rc=b.rc, wall_s=round(b.wall_s, 3), cpu_s=round(b.cpu_s, 3),
                  peak_rss_mb=round(b.peak_rss_mb, 0))
    text = log.read_text(errors="replace")
    if b.status == "did not finish":
        run.status = b.status
        return run
    if frtrace:
        blocks = parse_frtrace(text)
        crashed = "Traceback (most recent call last)" in text
        run.status = "crashed" if crashed else ("ok" if b.rc == 0 else "error")
        judge(run, blocks, truth)
    else:
        # exit 3 is a problem found (docs/DESIGN.md §4), 0 healthy: both are answers
        run.status = "ok" if b.rc in (0, 3) else "error"
        if run.status == "ok" and not screen:
            try:
                verdict = json.loads(text[text.find("{"):]) if "{" in text else {}
            except json.JSONDecodeError:
                verdict = {}
                run.status = "error"
            judge_moe_hang(run, verdict, truth)
    if run.status != "ok":
        run.error_tail = "\n".join(text.strip().splitlines()[-3:])[-600:]
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--sizes", default="512x200",
                    help="RANKSxENTRIES[@DPxTP],... e.g. 512x200,2048x200,512x2000,8192x200@64x128")
    ap.add_argument("--faults", default="missing_rank",
                    help="comma list of: missing_rank,size,dtype,op,order,p2p,none (or all)")
    ap.add_argument("--backends", default="nccl", help="comma list of nccl, gloo")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per tool run")
    ap.add_argument("--repeat", type=int, default=1,
                    help="floor and moe-hang runs per case; the fastest is kept")
    ap.add_argument("--json", type=Path, default=None, help="write all results here")
    ap.add_argument("--bench-json", type=Path, default=None,
                    help="add the results under 'postmortem' in this bench.json")
    ap.add_argument("--table", type=Path, default=None, help="also write the table here")
    ap.add_argument("--markdown", type=Path, default=None, help="the table as Markdown, here")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bench_postmortem",
                    help="where dump sets are generated (and reused)")
    ap.add_argument("--version", default="2.13")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--frames", action="store_true")
    ap.add_argument("--no-torchfrtrace", action="store_true")
    ap.add_argument("--no-moe-hang", action="store_true")
    ap.add_argument("--no-core", action="store_true",
                    help="skip (d), the analysis without the CLI's report")
    ap.add_argument("--from-json", type=Path, action="append", default=[],
                    help="measure nothing: print (and --markdown, --bench-json) the results of "
                         "earlier --json files")
    args = ap.parse_args(argv)
    if args.from_json:
        return _replay(args)
    synth = _load_synth()
    faults = [f for f in args.faults.split(",") if f]
    if faults == ["all"]:
        faults = list(synth.FAULTS)
    for f in faults:
        if f not in synth.FAULTS:
            ap.error(f"unknown fault {f!r}")
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in ("nccl", "gloo"):
            ap.error(f"unknown backend {b!r}")
    args.work.mkdir(parents=True, exist_ok=True)
    # compile this checkout's bytecode once, outside any measurement
    subprocess.run([sys.executable, "-c", "import moe_hang.cli, moe_hang.commands.diagnose, "
                    "moe_hang.report.json"], env=_env(args.work), cwd=ROOT, timeout=120,
                   check=False)
    cases: list[Case] = []
    t0 = time.monotonic()
    for size in args.sizes.split(","):
        for backend in backends:
            for fault in faults:
                cases.append(bench_case(args, synth, size, backend, fault, args.work))
    tab = table(cases)
    print()
    print(tab)
    meta = {"argv": sys.argv[1:], "python": sys.version.split()[0], "cpus": os.cpu_count(),
            "load_avg_at_end": os.getloadavg(), "total_s": round(time.monotonic() - t0, 1),
            "torch": _torch_version(), "timeout_s": args.timeout, "repeat": args.repeat}
    result = {"meta": meta, "cases": [asdict(c) for c in cases]}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        written(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.bench_json:
        update_bench_json(args.bench_json, result)
    if args.table:
        written(args.table).write_text(tab + "\n")
    if args.markdown:
        written(args.markdown).write_text(markdown(cases) + "\n")
    return 0


def _replay(args: argparse.Namespace) -> int:
    results = [json.loads(p.read_text()) for p in args.from_json]
    by_key: dict[tuple[Any, ...], Case] = {}
    for r in results:  # a later file's case replaces an earlier one, tool by tool
        for d in r["cases"]:
            c = case_from(d)
            prev = by_key.get(case_key(d))
            if prev is not None:
                for tool in TOOLS:
                    if getattr(c, tool).status == "not run":
                        setattr(c, tool, getattr(prev, tool))
            by_key[case_key(d)] = c
    cases = list(by_key.values())
    print(table(cases))
    if args.markdown:
        written(args.markdown).write_text(markdown(cases) + "\n")
    if args.bench_json:
        for r in results:
            update_bench_json(args.bench_json, r)
    return 0


def _torch_version() -> str:
    try:
        out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.strip()
    except (subprocess.TimeoutExpired, OSError):
        return "?"


if __name__ == "__main__":
    run(main)
