"""Measure what the counters say (docs/DESIGN.md §9, docs/reference.md "How moving is
decided"): real torchrun jobs (tests/e2e/jobs/chatty.py, gloo) healthy, hung and slow, each rank
read over a plain window (no py-spy) and over ``diagnose``'s own window
(capture.window.sample_window: four py-spy samples 0.25 s apart), as rates per second.

    python scripts/activity_table.py                      # 2 ranks, every mode
    python scripts/activity_table.py --nproc 8 --modes healthy,stop
    python scripts/activity_table.py --json runs/activity.json

Modes: ``healthy`` (a loop of small all-reduces), ``sleep`` (rank 1 sleeps outside collectives,
the others wait in an all-reduce), ``compute`` (rank 1 computes for ever), ``skip`` (rank 1 in
a barrier, the others in an all-reduce), ``stop`` (a healthy run, rank 1 SIGSTOPped), ``probe``
(``skip`` with moe-hang's probe in every rank, as under watch: its heartbeats are the tool's
own activity). Every process of every job is ended before the next starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "tests" / "e2e" / "jobs"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(JOBS))

from _wait import wait_marks  # noqa: E402

from moe_hang.capture.window import activity_between, sample_window  # noqa: E402
from moe_hang.evidence.activity import Activity  # noqa: E402
from moe_hang.runtime.procs import read_counters  # noqa: E402
from moe_hang.settings import Settings  # noqa: E402

MODES = ("healthy", "sleep", "compute", "skip", "stop", "probe")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ranks(agent: int, marks: Path) -> dict[int, int]:
    out: dict[int, int] = {}
    for p in psutil.Process(agent).children(recursive=True):
        try:
            env = p.environ()
            if "RANK" in env and env.get("JOB_MARKS") == str(marks) and p.num_threads() > 1:
                out.setdefault(int(env["RANK"]), p.pid)
        except psutil.Error:
            continue
    return out


def _rates(a: Activity) -> dict[str, Any]:
    def per_s(v: int | None) -> float | None:
        return None if v is None else v / a.window_s
    return {"activity": a.to_dict(), "wakeups_s": per_s(a.wakeups), "syscalls_s": per_s(a.syscalls),
            "kb_s": None if a.io_bytes is None else a.io_bytes / a.window_s / 1024,
            "window_s": a.window_s, "attaches": a.attaches, "stopped": a.stopped}


def measure(mode: str, nproc: int, windows: int, tmp: Path) -> list[dict]:
    marks = tmp / f"marks-{mode}-{nproc}"
    marks.mkdir()
    env = dict(os.environ, JOB_MARKS=str(marks), OMP_NUM_THREADS="1", RUN_S="600",
               CHATTY_MODE="skip" if mode == "probe" else
               ("healthy" if mode == "stop" else mode))
    env["PYTHONPATH"] = str(JOBS)
    if mode == "probe":
        site = ROOT / "moe_hang" / "probe" / "_site"
        probe = tmp / f"probe-{nproc}"
        probe.mkdir()
        env.update(PYTHONPATH=f"{site}{os.pathsep}{JOBS}", MOE_HANG_PROBE_DIR=str(probe))
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(_port()), str(JOBS / "chatty.py")]
    log = open(tmp / f"{mode}-{nproc}.log", "wb")  # noqa: SIM115
    job = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True)
    rows = []
    stopped: list[int] = []
    try:
        wait_marks(marks, nproc, job, 180.0)
        time.sleep(2.0)  # the fault has taken effect: the others are blocked on it
        ranks = _ranks(job.pid, marks)
        if mode == "stop":
            os.kill(ranks[1], signal.SIGSTOP)
            stopped.append(ranks[1])
            time.sleep(1.0)
        for w in range(windows):
            a = {r: read_counters(p) for r, p in ranks.items()}
            time.sleep(1.0)
            b = {r: read_counters(p) for r, p in ranks.items()}
            for r in ranks:
                ca, cb = a[r], b[r]
                if ca is not None and cb is not None:
                    rows.append({"mode": mode, "nproc": nproc, "rank": r, "window": "plain",
                                 "round": w, **_rates(activity_between(ca, cb, attaches=0))})
            for r, rw in sample_window(ranks, Settings()).items():
                if rw.activity is not None:
                    rows.append({"mode": mode, "nproc": nproc, "rank": r, "window": "diagnose",
                                 "round": w, **_rates(rw.activity)})
    finally:
        for p in stopped:
            os.kill(p, signal.SIGCONT)
        for p in [*psutil.Process(job.pid).children(recursive=True), psutil.Process(job.pid)]:
            with contextlib.suppress(psutil.Error):
                p.kill()
        job.wait(10)
        log.close()
    return rows


def _span(vals: list[float | None]) -> str:
    v = [x for x in vals if x is not None]
    if not v:
        return "-"
    lo, hi = min(v), max(v)
    return f"{lo:.0f}" if round(lo) == round(hi) else f"{lo:.0f}–{hi:.0f}"


def table(rows: list[dict]) -> str:
    out = ["| job | ranks | rank | window | main-thread wakeups/s | read+write syscalls/s | "
           "KB/s through them |", "|---|---|---|---|---|---|---|"]
    keys = sorted({(r["mode"], r["nproc"], r["window"]) for r in rows},
                  key=lambda k: (MODES.index(k[0]), k[1], k[2] != "plain"))
    for mode, n, win in keys:
        mine = [r for r in rows if (r["mode"], r["nproc"], r["window"]) == (mode, n, win)]
        odd = mode != "healthy"
        for who, sel in (("1", [r for r in mine if r["rank"] == 1]) if odd else ("all", mine),
                         ("others", [r for r in mine if r["rank"] != 1]) if odd else ("", [])):
            if not sel:
                continue
            out.append(f"| {mode} | {n} | {who} | {win} | {_span([r['wakeups_s'] for r in sel])}"
                       f" | {_span([r['syscalls_s'] for r in sel])} | "
                       f"{_span([r['kb_s'] for r in sel])} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", default="2", help="comma-separated world sizes (default 2)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--windows", type=int, default=3, help="windows per job (default 3)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="moe-hang-activity-") as d:
        for n in [int(x) for x in args.nproc.split(",")]:
            for mode in args.modes.split(","):
                print(f"measuring {mode} on {n} ranks", file=sys.stderr, flush=True)
                rows += measure(mode, n, args.windows, Path(d))
    print(table(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
