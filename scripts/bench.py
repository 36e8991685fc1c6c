"""Benchmarks: time to verdict, diagnose latency, probe overhead, and the cost of each fix.

    python scripts/bench.py [--quick] [--only overhead] [--rounds N] [--against DIR]
                            [--json bench.json]

Prints a table per section and writes bench.json with the keys ``time_to_verdict_s``,
``repro_wall_s``, ``verify_s``, ``pg_timeout_s``, ``diagnose_s``, ``probe_overhead_ratio``,
``detail_overhead_ratio`` and ``fix_cost``. ``--quick`` (under 3 minutes on a 2-core machine)
runs fewer repeats and a smaller fix matrix. ``--only SECTION`` (verdict, verify, diagnose,
overhead, fix) runs that section alone (``--rounds`` overhead rounds; JSON keys of the others
are absent). Nothing here is asserted by the test suite.

What each number is:

* time to verdict: from hang onset (the Flight Recorder's creation time of the collective that
  never completes, or the crash time) to diagnosis.json on disk (``timings.onset_to_verdict_s``
  of the run), against what you wait today: the process-group timeout before the recorder
  dumps (NCCL 600 s, gloo 1800 s by default).
* verify: wall time of ``moe-hang verify --fixed --scenario S`` (the fixed variant under
  torchrun and its single-process reference, compared) per scenario (median of 3, 1 with
  ``--quick``), with the comparison's max relative error and the count of tensors compared;
  ``--against DIR`` times another checkout's the same way, interleaved run by run.
* diagnose: wall time of ``moe-hang diagnose PID`` on N hung ranks (median of 3).
* probe overhead: steps/s of the healthy model (varlen fix) plain vs. with only the Flight
  Recorder on vs. under ``moe-hang watch`` (recorder + probe + the watcher process) vs. with
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, runs interleaved, median of the per-round ratios (>1
  means slower).
* fix cost: step time; bytes a rank puts on the wire per step per layer, forward and backward
  (from the recorder's sizes of every collective of one step, with nccl-tests' bus-bandwidth
  factors: all-reduce 2(n-1)/n of the buffer, all-gather (n-1)/n of the output, all-to-all
  (n-1)/n of the input), and the plain sum of input sizes beside it; RSS high-water growth
  of one step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moe_hang.testing.script import run, written

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "tests" / "e2e" / "jobs"
if str(JOBS) not in sys.path:
    sys.path.append(str(JOBS))  # tests/e2e/jobs/_wait.py: the waits the tests use
from _wait import wait_blocked, wait_marks  # noqa: E402

PG_TIMEOUT_S = {"nccl (default)": 600, "gloo (default)": 1800}
SECTIONS = ("verdict", "verify", "diagnose", "overhead", "fix")


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    e.update(extra)
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli(*args: str, extra_env: dict[str, str] | None = None,
        timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "moe_hang.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env(**(extra_env or {})), cwd=ROOT)


def torchrun(nproc: int, *script: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *script]


def table(title: str, header: list[str], rows: list[list[object]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=False)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(r, widths, strict=False)))


# ----------------------------------------------------------------------------- 1. verdicts


def time_to_verdict(tmp: Path) -> tuple[dict[str, float], dict[str, float]]:
    ttv: dict[str, float] = {}
    wall: dict[str, float] = {}
    for scenario in ("ep-ragged", "ep-no-anchor", "fsdp-skip"):
        out = tmp / f"repro-{scenario}"
        t0 = time.monotonic()
        proc = cli("repro", "--scenario", scenario, "--out", str(out), "--json")
        wall[scenario] = round(time.monotonic() - t0, 2)
        d = json.loads(proc.stdout)
        ttv[scenario] = d["timings"]["onset_to_verdict_s"]
    out = tmp / "watch-skip"
    proc = cli("watch", "--stall", "5", "--out", str(out), "--json", "--",
               *torchrun(2, str(JOBS / "skip_collective.py")))
    ttv["watch: skip_collective.py"] = json.loads(proc.stdout)["timings"]["onset_to_verdict_s"]
    table("time to verdict (hang onset -> diagnosis.json)",
          ["case", "moe-hang", "repro wall", "vs NCCL timeout", "vs gloo timeout"],
          [[k, f"{v:.2f} s", f"{wall.get(k, '-')} s" if k in wall else "-",
            f"{600 / v:.0f}x sooner", f"{1800 / v:.0f}x sooner"] for k, v in ttv.items()])
    return ttv, wall


def _verify_once(root: Path, scenario: str, out: Path) -> tuple[float, dict]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "moe_hang.cli", "verify", "--fixed",
                           "--scenario", scenario, "--out", str(out), "--json"],
                          capture_output=True, text=True, timeout=600, cwd=root,
                          env=dict(env(), PYTHONPATH=str(root)))
    wall = round(time.monotonic() - t0, 2)
    d = json.loads(proc.stdout)
    assert d["verified"] is True, proc.stdout[:300]
    return wall, d.get("reference") or {}


def verify_wall(tmp: Path, samples: int, against: Path | None
                ) -> dict[str, dict[str, dict[str, object]]]:
    """Per scenario and code (this checkout; ``against``, another checkout, run interleaved
    with it, sample by sample, so both see the same load)."""
    codes = {"this": ROOT} | ({"against": against} if against else {})
    out: dict[str, dict[str, dict[str, object]]] = {}
    rows: list[list[object]] = []
    for scenario in ("ep-ragged", "ep-no-anchor", "fsdp-skip"):
        times: dict[str, list[float]] = {c: [] for c in codes}
        ref: dict[str, dict] = {}
        for i in range(samples):
            for code, root in reversed(codes.items()):
                t, ref[code] = _verify_once(root, scenario, tmp / f"verify-{code}-{scenario}-{i}")
                times[code].append(t)
        out[scenario] = {}
        for code in codes:
            wall, err = statistics.median(times[code]), ref[code].get("max_rel_err")
            out[scenario][code] = {"wall_s": round(wall, 2), "runs_s": times[code],
                                   "max_rel_err": err, "compared": ref[code].get("compared")}
            rows.append([scenario, code, f"{wall:.2f} s", " ".join(map(str, times[code])),
                         "-" if err is None else f"{err:.2e}", ref[code].get("compared")])
    table("verify --fixed (fixed variant under torchrun + single-process reference)",
          ["scenario", "code", "wall (median)", "runs", "max rel err", "compared"], rows)
    return out


# ----------------------------------------------------------------------------- 2. diagnose


def diagnose_latency(tmp: Path, sizes: list[int], samples: int = 3) -> dict[str, float]:
    import psutil

    out: dict[str, float] = {}
    for n in sizes:
        marks = Path(tempfile.mkdtemp(prefix="marks-", dir=tmp))
        job = subprocess.Popen(torchrun(n, str(JOBS / "skip_collective.py")), cwd=JOBS,
                               env=env(JOB_MARKS=str(marks), SKIP_RANK=str(n - 1)),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
        try:
            wait_marks(marks, n, job, timeout=300)
            ranks = [c.pid for c in psutil.Process(job.pid).children()]
            wait_blocked(ranks, timeout=120)  # every rank sits blocked (no CPU over 0.3 s)
            times = []
            for _ in range(samples):
                t0 = time.monotonic()
                proc = cli("diagnose", str(job.pid), "--json")
                times.append(time.monotonic() - t0)
                assert json.loads(proc.stdout)["verdict"] == "desync", proc.stdout[:300]
            out[str(n)] = round(statistics.median(times), 3)
        finally:
            for p in psutil.Process(job.pid).children(recursive=True):
                p.kill()
            job.kill()
            job.wait()
    table(f"diagnose PID on hung ranks (wall, median of {samples})", ["ranks", "seconds"],
          [[k, f"{v:.2f}"] for k, v in out.items()])
    return out


# ----------------------------------------------------------------------------- 3. overhead


def _steps_run(mode: str, tmp: Path, steps: int, warmup: int = 5) -> tuple[float, float]:
    """(steps per second, CPU milliseconds per step) of one run."""
    res = tmp / f"overhead-{mode}-{time.monotonic_ns()}.jsonl"
    case = json.dumps([{"fix": "varlen", "experts": 8, "topk": 2, "tokens": "256,768",
                        "hidden": 128, "ffn": 256}])
    job = torchrun(2, str(ROOT / "scripts" / "bench_steps.py"), "--cases", case,
                   "--steps", str(steps), "--warmup", str(warmup), "--out", str(res))
    if mode == "watch":
        proc = cli("watch", "--stall", "30", "--out", str(tmp / f"w-{res.stem}"), "--json",
                   "--", *job)
    else:
        extra = {"detail": {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
                 "recorder": {"TORCH_FR_BUFFER_SIZE": "2000"}}.get(mode, {})
        proc = subprocess.run(job, capture_output=True, text=True, timeout=600,
                              env=env(**extra), cwd=ROOT)
    if proc.returncode != 0:
        detail = proc.stderr[-1000:]
        if mode == "watch":  # the watch run directory says what went wrong, keep its verdict
            with contextlib.suppress(OSError, ValueError):
                detail = json.loads(proc.stdout)["summary"] + "\n" + detail
        raise RuntimeError(f"{mode} run failed: {detail}")
    row = json.loads(res.read_text().splitlines()[0])
    return float(row["steps_per_s"]), float(row.get("cpu_ms_per_step") or 0.0)


def overhead(tmp: Path, rounds: int,
             steps: int) -> tuple[float, float, float, list[list[float]], list[float]]:
    per_round, cpu_round = [], []
    for _ in range(rounds):  # interleaved, so drift in machine load hits every mode alike
        got = [_steps_run(m, tmp, steps) for m in ("plain", "recorder", "watch", "detail")]
        per_round.append([g[0] for g in got])
        cpu_round.append([g[1] for g in got])
    ratio = [statistics.median(r[0] / r[i] for r in per_round) for i in (1, 2, 3)]
    cpu = [statistics.median(r[i] / r[0] for r in cpu_round if r[0]) if any(r[0] for r in
           cpu_round) else 0.0 for i in (1, 2, 3)]
    table("overhead (steps/s, healthy varlen model, 2 ranks; higher is faster)",
          ["round", "plain", "recorder only", "under watch", "DETAIL"],
          [[i + 1, *[f"{x:.2f}" for x in r]] for i, r in enumerate(per_round)])
    print(f"median slowdown: Flight Recorder alone {100 * (ratio[0] - 1):+.1f} %, "
          f"watch (recorder + probe + watcher) {100 * (ratio[1] - 1):+.1f} %, "
          f"TORCH_DISTRIBUTED_DEBUG=DETAIL {100 * (ratio[2] - 1):+.1f} %")
    print(f"median CPU per step vs plain: recorder {100 * (cpu[0] - 1):+.1f} %, "
          f"watch {100 * (cpu[1] - 1):+.1f} %, DETAIL {100 * (cpu[2] - 1):+.1f} %")
    return (round(ratio[1], 4), round(ratio[2], 4), round(ratio[0], 4), per_round,
            [round(x, 4) for x in cpu])


# ----------------------------------------------------------------------------- 4. fix cost


def fix_cost(tmp: Path, quick: bool, steps: int, warmup: int = 3) -> list[dict]:
    rows: list[dict] = []
    worlds = (2, 4)
    for world in worlds:
        uniform = ",".join(["512"] * world)
        ragged = ",".join(str(x) for x in [256, 768, 1280, 384][:world])
        cases = []
        for topk in ((2,) if quick else (1, 2)):
            cases.append({"fix": "naive", "experts": 8, "topk": topk, "tokens": uniform})
            for fix in ("varlen", "a2a"):
                for tokens in ((ragged,) if quick else (uniform, ragged)):
                    cases.append({"fix": fix, "experts": 8, "topk": topk, "tokens": tokens})
        res = tmp / f"fixcost-{world}.jsonl"
        proc = subprocess.run(
            torchrun(world, str(ROOT / "scripts" / "bench_steps.py"), "--cases",
                     json.dumps(cases), "--steps", str(steps), "--warmup", str(warmup),
                     "--out", str(res)),
            capture_output=True, text=True, timeout=1200, cwd=ROOT,
            env=env(TORCH_FR_BUFFER_SIZE="20000", MALLOC_MMAP_THRESHOLD_="65536"))
        if proc.returncode != 0:
            raise RuntimeError(f"fix-cost run failed: {proc.stderr[-1500:]}")
        rows.extend(json.loads(line) for line in res.read_text().splitlines())
    for r in rows:
        r["kind"] = "uniform" if len(set(r["tokens"].split(","))) == 1 else "ragged"
    table("cost of each fix (E=8, D=256, F=512, 2 layers; per rank, per step, per layer)",
          ["fix", "world", "top-k", "tokens", "step ms", "wire MB", "input MB", "peak MB"],
          [[r["fix"], r["world"], r["topk"], r["tokens"], f"{r['step_ms']:.1f}",
            f"{r['bytes_per_step'] / 2**20:.2f}", f"{r['input_bytes_per_step'] / 2**20:.2f}",
            f"{r['peak_mem_mb']:.1f}"] for r in rows])
    return [{"fix": r["fix"], "world": r["world"], "experts": r["experts"], "topk": r["topk"],
             "tokens": r["tokens"], "kind": r["kind"], "step_ms": r["step_ms"],
             "bytes_per_step": r["bytes_per_step"],
             "input_bytes_per_step": r["input_bytes_per_step"],
             "peak_mem_mb": r["peak_mem_mb"]} for r in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description="moe-hang benchmarks")
    ap.add_argument("--quick", action="store_true",
                    help="one round each, fewer sizes (under 3 minutes); numbers are indicative")
    ap.add_argument("--json", default="bench.json", help="where to write the results")
    ap.add_argument("--only", choices=SECTIONS, action="append",
                    help="run only this section (repeatable); default: all of them")
    ap.add_argument("--against", type=Path, default=None,
                    help="verify: another checkout (e.g. a git worktree of an older commit) "
                         "timed interleaved with this one")
    ap.add_argument("--rounds", type=int, default=None,
                    help="overhead rounds (default 5, 1 with --quick)")
    args = ap.parse_args()
    only = set(args.only or SECTIONS)
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="moe-hang-bench-"))
    result: dict = {
        "command": " ".join(["python scripts/bench.py", *sys.argv[1:]]),
        "quick": args.quick, "pg_timeout_s": PG_TIMEOUT_S}
    try:
        if "verdict" in only:
            result["time_to_verdict_s"], result["repro_wall_s"] = time_to_verdict(tmp)
        if "verify" in only:
            result["verify_s"] = verify_wall(tmp, 1 if args.quick else 3, args.against)
        if "diagnose" in only:
            result["diagnose_s"] = diagnose_latency(tmp, [2, 4] if args.quick else [2, 4, 8],
                                                    samples=1 if args.quick else 3)
        if "overhead" in only:
            rounds = args.rounds or (1 if args.quick else 5)
            probe_ratio, detail_ratio, fr_ratio, per_round, cpu = overhead(
                tmp, rounds, 20 if args.quick else 60)
            result.update({
                "probe_overhead_ratio": probe_ratio, "detail_overhead_ratio": detail_ratio,
                "recorder_overhead_ratio": fr_ratio, "overhead_rounds_steps_per_s": per_round,
                # CPU per step of each mode over plain's (recorder, watch, detail): load-robust
                "cpu_per_step_ratio": cpu,
                "overhead_columns": ["plain", "recorder", "watch", "detail"]})
        if "fix" in only:
            result["fix_cost"] = fix_cost(tmp, args.quick, 3 if args.quick else 10,
                                          warmup=1 if args.quick else 3)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result["total_s"] = round(time.monotonic() - t0, 1)
    result["machine"] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    written(Path(args.json)).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.json} in {result['total_s']} s")
    return 0


if __name__ == "__main__":
    run(main)
