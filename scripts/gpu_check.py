"""The steps of scripts/gpu_check.sh (run that, not this): what only a GPU can show.

    python scripts/gpu_check.py STEP WORKDIR      # env | single | samegpu | hang
    python scripts/gpu_check.py combine WORKDIR OUT [--dry REASON]

Each step writes WORKDIR/STEP.json and records every pid it starts in WORKDIR/pids (the shell
script kills what is left of them); ``combine`` writes the one JSON file and prints the table.
Steps (docs/nccl_evidence.md): ``env`` (GPUs, torch, NCCL, ncclras); ``single`` (a world-1 NCCL
group: the recorder's states and times with TORCH_NCCL_ENABLE_TIMING=1, the steps/s of a small
all-reduce loop with and without it, and whether RAS answers on its default port);
``samegpu`` (whether NCCL takes 2 ranks on one GPU); ``hang`` (2 ranks, one skips an
all-reduce: what the blocked CUDA rank looks like — CPU, py-spy, its recorder, RAS's two
polls, ``moe-hang diagnose`` — then everything killed).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpu_check_report import combine  # noqa: E402 - scripts/ is on the path


def _term(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # timeout's SIGTERM: unwind, so every finally kills


def _record_pid(work: Path, pid: int) -> None:
    with (work / "pids").open("a") as f:
        f.write(f"{pid}\n")


def _write(work: Path, step: str, result: dict[str, Any]) -> None:
    tmp = work / f".{step}.json"
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.rename(work / f"{step}.json")


# ----------------------------------------------------------------------------- env


def step_env(work: Path, out: dict[str, Any]) -> None:
    import shutil

    import torch

    out.update({"torch": torch.__version__, "cuda": torch.version.cuda,
                "gpus": torch.cuda.device_count(), "ncclras": shutil.which("ncclras")})
    out["names"] = [torch.cuda.get_device_name(i) for i in range(out["gpus"])]
    with contextlib.suppress(Exception):
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))


# ----------------------------------------------------------------------------- single


def _fr_entries(torch: Any) -> list[dict[str, Any]]:
    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_fr_trace", None) or c10d._dump_nccl_trace
    data = pickle.loads(bytes(dump(includeStackTraces=False)))  # this process's own dump
    return list(data.get("entries") or [])


def _loop(dist: Any, torch: Any, group: Any, iters: int) -> float:
    x = torch.ones(1024, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x, group=group)
    torch.cuda.synchronize()
    return iters / (time.perf_counter() - t0)


def step_single(work: Path, out: dict[str, Any]) -> None:
    """World 1 on GPU 0: the recorder with and without timing, its cost, RAS's port."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "20000")
    os.environ.pop("TORCH_NCCL_ENABLE_TIMING", None)
    import torch
    import torch.distributed as dist

    from moe_hang.capture.ras import query_ras
    from moe_hang.settings import Settings

    torch.cuda.set_device(0)
    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    off = dist.new_group([0])  # the env is read when a group is made
    os.environ["TORCH_NCCL_ENABLE_TIMING"] = "1"
    on = dist.new_group([0])
    for g in (off, on):
        _loop(dist, torch, g, 50)  # warm-up: communicators made, kernels loaded
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(3):  # interleaved rounds: drift hits both alike
        for name, g in (("off", off), ("on", on)):
            rates[name].append(_loop(dist, torch, g, 3000))
    med = {k: sorted(v)[1] for k, v in rates.items()}
    out["steps_per_s"] = {k: round(v, 1) for k, v in med.items()}
    out["rounds"] = {k: [round(x, 1) for x in v] for k, v in rates.items()}
    out["timing_cost_pct"] = round(100 * (med["off"] - med["on"]) / med["off"], 2)
    time.sleep(1.5)  # the watchdog discovers completions on its own schedule
    entries = _fr_entries(torch)
    by_pg: dict[str, dict[str, Any]] = {}
    names = {"off": off.group_name, "on": on.group_name}
    for label, name in names.items():
        es = [e for e in entries if str(e.get("process_group", ("",))[0]) == str(name)]
        by_pg[label] = {
            "entries": len(es), "states": sorted({str(e.get("state")) for e in es}),
            "with_started_ns": sum(1 for e in es if e.get("time_discovered_started_ns")),
            "with_completed_ns": sum(1 for e in es if e.get("time_discovered_completed_ns")),
            "with_duration_ms": sum(1 for e in es if e.get("duration_ms") is not None)}
    out["recorder"] = by_pg
    ras = query_ras(ras_timeout_s=Settings().ras_timeout_s, deadline_s=15)
    out.update({"ras": {"ok": ras.ok, "via": ras.via, "fmt": ras.fmt, "error": ras.error,
                   "notes": list(ras.notes), "seconds": round(ras.seconds, 2),
                   "nccl_version": ras.report.nccl_version if ras.report else None,
                   "communicators": [(c.hash, c.size) for c in ras.report.communicators]
                   if ras.report else None}})
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- jobs

SAMEGPU_JOB = """
import os, torch, torch.distributed as dist
rank = int(os.environ["RANK"])
torch.cuda.set_device(0)
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
x = torch.ones(4, device="cuda")
dist.all_reduce(x)
print("samegpu-ok", rank, x[0].item(), flush=True)
dist.destroy_process_group()
"""

# rank 1 skips the 6th all-reduce and waits outside NCCL; rank 0 posts it and blocks in
# .item() behind the kernel (its host thread spins in the CUDA sync); a thread of rank 0
# dumps its recorder while it hangs
HANG_JOB = """
import os, sys, threading, time, pickle, torch, torch.distributed as dist
rank = int(os.environ["RANK"]); marks = sys.argv[1]
dev = int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count()
torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=torch.device("cuda", dev))
x = torch.ones(1024, device="cuda")
for _ in range(5):
    dist.all_reduce(x)
torch.cuda.synchronize()
def dump():
    time.sleep(6)
    c10d = torch._C._distributed_c10d
    f = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace")
    open(os.path.join(marks, f"fr{rank}.pkl"), "wb").write(bytes(f(includeStackTraces=False)))
threading.Thread(target=dump, daemon=True).start()
open(os.path.join(marks, f"posted{rank}"), "w").write(str(os.getpid()))
if rank == 0:
    dist.all_reduce(x)
    x.sum().item()
else:
    time.sleep(600)
"""


def _spawn(work: Path, argv: list[str], env: dict[str, str], log: Path
           ) -> subprocess.Popen[bytes]:
    with log.open("wb") as f:
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    _record_pid(work, p.pid)
    return p


def _tree(pid: int) -> list[int]:
    import psutil

    try:
        return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _kill_all(work: Path, pids: list[int]) -> list[int]:
    """SIGKILL each (their own sessions: torchrun's workers are not in its group); the ones
    still alive after 5 s."""
    import psutil

    for p in pids:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
    left = []
    for p in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(p)
            with contextlib.suppress(psutil.TimeoutExpired):
                proc.wait(5)
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
    return left


def _torchrun(work: Path, job: str, nproc: int, extra_env: dict[str, str]
              ) -> tuple[subprocess.Popen[bytes], Path]:
    """torchrun of ``job`` (its argv[1]: a directory of its own for marks and dumps)."""
    d = Path(tempfile.mkdtemp(prefix="job-", dir=work))
    script = d / "job.py"
    script.write_text(job)
    env = dict(os.environ, **extra_env)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-port", str(29500 + os.getpid() % 1000), str(script), str(d)]
    return _spawn(work, argv, env, d / "log.txt"), d


def step_samegpu(work: Path, out: dict[str, Any]) -> None:
    p, d = _torchrun(work, SAMEGPU_JOB, 2, {"CUDA_VISIBLE_DEVICES": "0"})
    try:
        code = p.wait(timeout=45)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        left = _kill_all(work, _tree(p.pid))
    log = (d / "log.txt").read_text(errors="replace")
    dup = next((ln.strip() for ln in log.splitlines() if "uplicate GPU" in ln), None)
    out.update({"ok": code == 0 and log.count("samegpu-ok") == 2, "exit_code": code,
                "nccl_refused": dup, "log_tail": log[-1500:], "left_alive": left})


def _pyspy_top(pid: int) -> list[str]:
    from moe_hang.capture.pyspy import find_pyspy

    exe = find_pyspy()
    if exe is None:
        return ["py-spy not installed"]
    r = subprocess.run([exe, "dump", "--json", "--pid", str(pid)], capture_output=True,
                       text=True, timeout=20)
    if r.returncode:
        return [f"py-spy failed: {r.stderr.strip()[-200:]}"]
    threads = json.loads(r.stdout)
    main = next((t for t in threads if t.get("thread_name") == "MainThread"), threads[0])
    return [f"{f.get('name')} {Path(f.get('filename', '')).name}:{f.get('line')}"
            for f in main.get("frames", [])[:6]]


def _rank_pids(d: Path) -> dict[int, int]:
    return {r: int((d / f"posted{r}").read_text()) for r in (0, 1)
            if (d / f"posted{r}").exists()}


def _observe_hang(work: Path, p: subprocess.Popen[bytes], d: Path, out: dict[str, Any]) -> None:
    import psutil

    from moe_hang.analysis.ras.compare import compare_reports
    from moe_hang.capture.ras import take_two
    from moe_hang.settings import Settings

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(_rank_pids(d)) < 2 and p.poll() is None:
        time.sleep(0.5)
    pids = _rank_pids(d)
    out["ranks_up"] = sorted(pids)
    if len(pids) < 2:
        out["error"] = "the job did not reach the hang"
        return
    for pid in pids.values():
        _record_pid(work, pid)
    time.sleep(7)  # blocked for a while; rank 0's recorder has dumped
    procs = {r: psutil.Process(pid) for r, pid in pids.items()}
    for pr in procs.values():
        pr.cpu_percent(None)
    time.sleep(2.0)
    out["cpu_percent"] = {r: pr.cpu_percent(None) for r, pr in procs.items()}
    out["pyspy_rank0"] = _pyspy_top(pids[0])
    fr = d / "fr0.pkl"
    if fr.exists():
        es = pickle.loads(fr.read_bytes()).get("entries") or []  # our job's own dump
        out["recorder_rank0_last"] = [{k: e.get(k) for k in (
            "profiling_name", "collective_seq_id", "state", "time_discovered_started_ns",
            "time_discovered_completed_ns", "duration_ms")} for e in es[-3:]]
    pair = take_two(3.0, ras_timeout_s=Settings().ras_timeout_s, deadline_s=10)
    out["ras"] = {"first": pair.first.error or pair.first.fmt,
                  "second": (pair.second.error or pair.second.fmt) if pair.second else None}
    if pair.second and pair.first.report and pair.second.report:
        cmp = compare_reports(pair.first.report, pair.second.report,
                              interval_s=pair.interval_s)
        out["ras"]["findings"] = [(f.kind.value, f.sentence) for f in cmp.findings][:6]
    diag_dir = Path(tempfile.mkdtemp(prefix="diag-", dir=work)) / "run"
    r = subprocess.run([sys.executable, "-m", "moe_hang.cli", "diagnose", str(p.pid), "--json",
                        "--out", str(diag_dir)], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    out["diagnose_exit"] = r.returncode
    try:
        dj = json.loads(r.stdout)
    except json.JSONDecodeError:
        out["diagnose_stderr"] = r.stderr[-800:]
        return
    out["diagnose"] = {k: dj.get(k) for k in ("verdict", "rule", "certainty", "culprit_ranks",
                                              "summary")}
    out["diagnose"]["ranks"] = [{k: x.get(k) for k in ("rank", "state", "collective",
                                                       "stack_source")}
                                for x in dj.get("ranks", [])]


def step_hang(work: Path, out: dict[str, Any]) -> None:
    import torch

    env = {"TORCH_NCCL_ENABLE_TIMING": "1", "TORCH_FR_BUFFER_SIZE": "2000"}
    if torch.cuda.device_count() < 2:
        sg = work / "samegpu.json"
        same = json.loads(sg.read_text()) if sg.exists() else {}
        if not same.get("ok"):
            out["skipped"] = ("needs 2 GPUs, or NCCL taking 2 ranks on one GPU (it did not: "
                              f"{same.get('nccl_refused') or same.get('exit_code')})")
            return
        env["CUDA_VISIBLE_DEVICES"] = "0"
    p, d = _torchrun(work, HANG_JOB, 2, env)
    try:
        _observe_hang(work, p, d, out)
    finally:
        out["left_alive"] = _kill_all(work, _tree(p.pid) + list(_rank_pids(d).values()))
        out["log_tail"] = (d / "log.txt").read_text(errors="replace")[-1500:]


STEPS = {"env": step_env, "single": step_single, "samegpu": step_samegpu, "hang": step_hang}


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _term)
    if len(argv) >= 3 and argv[0] == "combine":
        dry = argv[argv.index("--dry") + 1] if "--dry" in argv else None
        return combine(Path(argv[1]), Path(argv[2]), dry)
    if len(argv) != 2 or argv[0] not in STEPS:
        print(__doc__, file=sys.stderr)
        return 2
    work = Path(argv[1])
    t0 = time.monotonic()
    res: dict[str, Any] = {}
    try:
        STEPS[argv[0]](work, res)
    except BaseException as exc:  # what it had measured is kept, and why it stopped
        res["stopped"] = ("its timeout" if isinstance(exc, SystemExit) else
                          f"{type(exc).__name__}: {exc}"[:300])
        raise
    finally:
        res["seconds"] = round(time.monotonic() - t0, 1)
        _write(work, argv[0], res)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
