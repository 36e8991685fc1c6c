"""Run the README's "What you see" examples for real and print each as it appears there (the
command, its first screen at 80 columns, its exit code), so the README shows what the tool
prints now, not what it printed once.

    python scripts/readme_examples.py                    # every example
    python scripts/readme_examples.py --only watch,ras   # some
    python scripts/readme_examples.py --json runs/readme_examples.json

Examples: ``repro``, ``verify``, ``watch`` (tests/e2e/jobs/skip_collective.py under torchrun),
``check`` (tests/e2e/jobs/moe_fsdp_train.py under its routing plans), ``p2p`` (torch's own
dumps of a recv no rank sends), ``ras`` (the NCCL transport hang from
recorder dumps and two RAS reports), ``nodes`` (two torchrun agents with c10d rendezvous on
this host, one watcher in front of each; the first node's screen is printed). Run directories
go under one fresh temporary directory (printed); every child runs in its own session and is
ended, with its group, on a timeout.
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
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from moe_hang.testing.script import run, written  # noqa: E402

FIX = "tests/unit/fixtures"
TIMEOUT_S = 240.0


@dataclass
class Example:
    name: str
    shown: str  # the command as the README shows it
    output: str
    exit_code: int | None
    wall_s: float


def _moe_hang() -> list[str]:
    return [sys.executable, "-m", "moe_hang.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ, COLUMNS="80", OMP_NUM_THREADS="1", NO_COLOR="1")
    env.pop("FORCE_COLOR", None)
    return env


def _end(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


def _start(argv: list[str], out: Path | None = None) -> subprocess.Popen[str]:
    # the job's own output goes to a file: the README shows only the tool's screen
    return subprocess.Popen(argv, cwd=ROOT, env=_env(), text=True, start_new_session=True,
                            stdout=subprocess.PIPE,
                            stderr=(out.open("w") if out is not None else subprocess.DEVNULL))


def _one(name: str, shown: str, argv: list[str], tmp: Path) -> Example:
    t0 = time.monotonic()
    p = _start(argv, tmp / f"{name}.stderr")
    try:
        out, _ = p.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _end(p)
        raise TimeoutError(f"{name}: no result in {TIMEOUT_S:.0f} s") from None
    finally:
        _end(p)
    return Example(name, shown, out.rstrip(), p.returncode, round(time.monotonic() - t0, 1))


def _nodes(tmp: Path) -> Example:
    """Two agents of one job, one watcher in front of each, as srun would start them."""
    endpoint = f"127.0.0.1:{_free_port()}"
    shown = ("moe-hang watch -- torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d "
             "--rdzv-endpoint HOST:PORT tests/e2e/jobs/expert_skip.py   # on each node")
    t0 = time.monotonic()
    procs = [_start([*_moe_hang(), "watch", "--out", str(tmp / "runs" / f"node{i}"), "--",
                     sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                     "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                     endpoint, "--rdzv-id", f"readme-{os.getpid()}", "--max-restarts", "0",
                     "tests/e2e/jobs/expert_skip.py"], tmp / f"node{i}.stderr")
             for i in (0, 1)]
    outs: list[str] = []
    try:
        deadline = time.monotonic() + TIMEOUT_S
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"nodes: no result in {TIMEOUT_S:.0f} s") from None
            outs.append(out.rstrip())
    finally:
        for p in procs:
            _end(p)
    return Example("nodes", shown, outs[0], procs[0].returncode,
                   round(time.monotonic() - t0, 1))


def _examples(tmp: Path) -> dict[str, tuple[str, list[str]]]:
    runs = tmp / "runs"
    ras = f"{FIX}/ras/symmetric_hang_1node_poll"
    return {
        "repro": ("moe-hang repro", [*_moe_hang(), "repro", "--out", str(runs / "repro")]),
        "verify": ("moe-hang verify --fixed",
                   [*_moe_hang(), "verify", "--fixed", "--out", str(runs / "verify")]),
        "watch": ("moe-hang watch -- torchrun --nproc-per-node 2 "
                  "tests/e2e/jobs/skip_collective.py",
                  [*_moe_hang(), "watch", "--out", str(runs / "watch"), "--", sys.executable,
                   "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                   str(_free_port()), "tests/e2e/jobs/skip_collective.py"]),
        "check": ("moe-hang check -- torchrun --nproc-per-node 2 "
                  "tests/e2e/jobs/moe_fsdp_train.py",
                  [*_moe_hang(), "check", "--out", str(runs / "check"), "--", sys.executable,
                   "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                   str(_free_port()), "tests/e2e/jobs/moe_fsdp_train.py"]),
        "p2p": (f"moe-hang analyze {FIX}/fr_real/p2p2/pickle",
                [*_moe_hang(), "analyze", f"{FIX}/fr_real/p2p2/pickle"]),
        "ras": (f"moe-hang analyze {FIX}/fr_started/json --ras {ras}1.json --ras {ras}2.json",
                [*_moe_hang(), "analyze", f"{FIX}/fr_started/json", "--ras", f"{ras}1.json",
                 "--ras", f"{ras}2.json"]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated names (default: all)")
    ap.add_argument("--json", type=Path, default=None, help="also write the outputs here")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="moe-hang-readme-"))
    table = _examples(tmp)
    names = [*table, "nodes"]
    want = [n.strip() for n in a.only.split(",") if n.strip()] or names
    if bad := [n for n in want if n not in names]:
        raise ValueError(f"unknown example(s) {', '.join(bad)}; known: {', '.join(names)}")
    print(f"run directories under {tmp}", file=sys.stderr)
    done = []
    for n in want:
        print(f"[{n}] ...", file=sys.stderr, flush=True)
        ex = _nodes(tmp) if n == "nodes" else _one(n, *table[n], tmp)
        done.append(ex)
        print(f"```\n$ {ex.shown}\n{ex.output}\n[exit {ex.exit_code}]\n```\n({ex.wall_s} s)\n")
    if a.json is not None:
        written(a.json).write_text(json.dumps([asdict(e) for e in done], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    run(main)
