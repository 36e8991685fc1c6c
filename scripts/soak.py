"""Soak: many repro/verify cycles, then two repros at once; report what leaked (not in CI).

    python scripts/soak.py [--cycles 20] [--json soak.json]

After every command it checks the process table (anything whose command line mentions the run
directory, polled for up to 5 s), listening ports opened since the start, this process's open file
descriptors, and files left in the temporary directory. Every leak count must be zero, every
exit code the expected one, and the two concurrent repros must use different ports and each
write its own run directory (a diagnosis.json naming that directory, and rank pids no other run
has).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from moe_hang.testing.script import run, written

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "tests" / "e2e" / "jobs") not in sys.path:
    sys.path.append(str(ROOT / "tests" / "e2e" / "jobs"))  # its _wait.py, shared with the tests
from _wait import processes_mentioning  # noqa: E402


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "moe_hang.cli", *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT)


def listening_ports() -> set[int]:
    return {c.laddr.port for c in psutil.net_connections("tcp") if c.status == "LISTEN"}


def survivors(needle: str, wait: float = 5.0) -> list[int]:
    """Pids of live processes whose command line mentions ``needle``, polled until none is left
    or ``wait`` seconds have passed (the kernel may still be reaping a just-ended job)."""
    deadline = time.monotonic() + wait
    while True:
        out = [p.pid for p in processes_mentioning(needle)]
        if not out or time.monotonic() >= deadline:
            return out
        time.sleep(0.1)


def leaked_listening_ports(before: set[int], wait: float = 5.0) -> list[int]:
    """Listening ports not in ``before``, polled until none is left or ``wait`` has passed."""
    deadline = time.monotonic() + wait
    while True:
        leaked = sorted(listening_ports() - before)
        if not leaked or time.monotonic() >= deadline:
            return leaked
        time.sleep(0.1)


def own_run(run: Path) -> list[int] | None:
    """The rank pids a run recorded in its own directory, or None unless ``run`` holds a
    diagnosis.json that names ``run`` itself as its artifacts (no run wrote into another's)."""
    try:
        on_disk = json.loads((run / "diagnosis.json").read_text())
    except (OSError, ValueError):
        return None
    pids = sorted(r["pid"] for r in on_disk.get("ranks", []) if r.get("pid") is not None)
    if on_disk.get("artifacts") != str(run.resolve()) or not pids:
        return None
    return pids


def port_of(run: Path) -> int | None:
    """The rendezvous port a run recorded in its meta.json (None: not recorded)."""
    try:
        return json.loads((run / "meta.json").read_text()).get("port")
    except (OSError, ValueError):
        return None


def tmp_entries() -> set[str]:
    return set(os.listdir(tempfile.gettempdir()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--json", default="soak.json")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="moe-hang-soak-"))
    ports0, fds0, tmp0 = listening_ports(), psutil.Process().num_fds(), tmp_entries()
    rows: list[dict[str, Any]] = []
    t_start = time.time()

    def check(kind: str, run: Path, proc: subprocess.CompletedProcess[str],
              want: int) -> dict[str, Any]:
        row: dict[str, Any] = {"kind": kind, "exit": proc.returncode, "expected": want,
               "leaked_processes": len(survivors(str(run))),
               "wall_s": None}
        with contextlib.suppress(OSError, ValueError, KeyError):
            row["wall_s"] = json.loads((run / "diagnosis.json").read_text())["timings"]["wall_s"]
        rows.append(row)
        print(f"{len(rows):3d} {kind:14s} exit {row['exit']} (want {want})  "
              f"leaked processes {row['leaked_processes']}  wall {row['wall_s']}", flush=True)
        return row

    for i in range(args.cycles):
        run = base / f"repro-{i}"
        check("repro", run, cli("repro", "--out", str(run)), 3)
        run = base / f"verify-{i}"
        check("verify --fixed", run, cli("verify", "--fixed", "--out", str(run)), 0)

    # two at once: different ports and run directories, no collision
    results: dict[str, subprocess.CompletedProcess[str]] = {}
    runs = [base / "concurrent-a", base / "concurrent-b"]

    def go(run: Path) -> None:
        results[run.name] = cli("repro", "--out", str(run), "--json")

    threads = [threading.Thread(target=go, args=(r,)) for r in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for run in runs:
        check("concurrent repro", run, results[run.name], 3)
    job_ports = [port_of(run) for run in runs]
    owned = [own_run(run) for run in runs]
    # each run wrote its own directory (artifacts, rank pids) and no two runs share a rank
    pids = [pid for o in owned for pid in o or []]
    run_dirs_distinct = None not in owned and len(set(pids)) == len(pids)
    leaked_ports = leaked_listening_ports(ports0)
    leaked_fds = psutil.Process().num_fds() - fds0
    leaked_tmp = sorted(e for e in tmp_entries() - tmp0 if not e.startswith("moe-hang-soak-"))
    summary = {
        "commands": len(rows),
        "wrong_exit_codes": sum(r["exit"] != r["expected"] for r in rows),
        "leaked_processes": sum(r["leaked_processes"] for r in rows),
        "leaked_listening_ports": leaked_ports,
        "leaked_fds": leaked_fds,
        "leaked_tmp_files": leaked_tmp,
        "concurrent_ports": job_ports,
        "concurrent_ports_distinct": len(set(job_ports)) == len(job_ports),
        "run_dirs_distinct": run_dirs_distinct,
        "total_s": round(time.time() - t_start, 1),
    }
    written(Path(args.json)).write_text(json.dumps({"summary": summary, "rows": rows}, indent=2)
                                        + "\n")
    print(json.dumps(summary, indent=2))
    ok = (summary["wrong_exit_codes"] == 0 and summary["leaked_processes"] == 0
          and not leaked_ports and leaked_fds <= 0 and not leaked_tmp
          and summary["concurrent_ports_distinct"] and run_dirs_distinct)
    return 0 if ok else 1


if __name__ == "__main__":
    run(main)
