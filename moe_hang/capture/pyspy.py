"""py-spy stacks of live ranks, all at once, each bounded by a timeout (it runs in parallel
across ranks and is killed at the deadline, on an error and on Ctrl-C)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_hang.capture import source
from moe_hang.errors import MoeHangError
from moe_hang.evidence.calls import ROOTED_FUNCS
from moe_hang.evidence.rankid import RANK_LOCALS, WORLD_LOCALS
from moe_hang.evidence.stacks import Frame, is_library_frame, is_stdlib_frame
from moe_hang.probe.env import write_atomic
from moe_hang.probe.layout import RunLayout
from moe_hang.runtime.procs import descendants, is_stopped, starting_child

ENV_PYSPY = "MOE_HANG_PYSPY"  # a specific py-spy binary (else next to python, else PATH)


def find_pyspy() -> str | None:
    chosen = os.environ.get(ENV_PYSPY)
    if chosen:
        return chosen if os.access(chosen, os.X_OK) else None
    here = Path(sys.executable).parent / "py-spy"
    if here.exists():
        return str(here)
    return shutil.which("py-spy")


def require_pyspy() -> str:
    exe = find_pyspy()
    if exe is None:
        raise MoeHangError("py-spy is not installed",
                           hint="pip install py-spy, in the same environment as moe-hang")
    return exe


@dataclass
class StackResult:
    pid: int
    data: Any | None  # py-spy JSON
    error: str | None
    seconds: float


def _pyspy_error(stderr: str, returncode: int) -> str:
    text = stderr.strip()
    low = text.lower()
    if "permission denied" in low or "operation not permitted" in low or "ptrace" in low:
        return ("py-spy cannot attach: no ptrace permission (run as root, add CAP_SYS_PTRACE, "
                "or set kernel.yama.ptrace_scope=0)")
    if "no such process" in low or "failed to find process" in low:
        return "process is gone"
    first = text.splitlines()[-1] if text else f"exit code {returncode}"
    return f"py-spy failed: {first[:200]}"


def _parse_result(pid: int, returncode: int | None, out: bytes, err: bytes,
                  seconds: float, timeout: float) -> StackResult:
    if returncode is None:
        return StackResult(pid, None, f"py-spy did not answer within {timeout:.0f} s", seconds)
    if returncode != 0:
        return StackResult(pid, None, _pyspy_error(err.decode(errors="replace"), returncode),
                           seconds)
    try:
        return StackResult(pid, strip_locals(json.loads(out)), None, seconds)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return StackResult(pid, None, "py-spy printed something that is not JSON", seconds)


# the arguments that say whom a send/recv waits for, and a rooted collective's root (every
# member must name the same); every other local is dropped at once: a rank's locals may
# hold anything (a token, a password), and nothing else is needed
_P2P_LOCALS = {"send": {"dst", "tag", "group"}, "isend": {"dst", "tag", "group"},
               "recv": {"src", "tag", "group"}, "irecv": {"src", "tag", "group"},
               **{f: {arg, f"group_{arg}", "group"} for f, arg in ROOTED_FUNCS.items()}}
# and, in any frame, the integers that may say which rank this is (rankid.identity_from_locals)
_IDENTITY_LOCALS = {*RANK_LOCALS, *WORLD_LOCALS}


def _kept(f: dict[str, Any], v: Any) -> bool:
    if not isinstance(v, dict):
        return False
    if v.get("name") in _IDENTITY_LOCALS and str(v.get("repr", "")).isdigit():
        return True
    if str(v.get("repr", "")).isdigit() and _loop_counter(f, str(v.get("name"))):
        return True
    keep = _P2P_LOCALS.get(str(f.get("name"))) \
        if str(f.get("filename", "")).endswith("distributed_c10d.py") else None
    return keep is not None and v.get("name") in keep


def _loop_counter(f: dict[str, Any], name: str) -> bool:
    """An integer the job's own ``for`` loop around this frame's line binds (``for step in
    range(n)``): which iteration each rank is in, so that two ranks at two lines of one loop
    are known to be in one iteration or a lap apart (analysis/position.position_order)."""
    file, line = str(f.get("filename", "")), f.get("line")
    if not isinstance(line, int) or is_library_frame(Frame(file, line, "")) \
            or is_stdlib_frame(Frame(file, line, "")):
        return False
    return name in source.loop_targets(file, line)


def strip_locals(data: Any) -> Any:
    """py-spy JSON with only the peer arguments of c10d send/recv frames, integer rank and
    world-size locals, and the integer counters of the job's own loops kept."""
    threads = data.get("threads", []) if isinstance(data, dict) else data
    for t in threads if isinstance(threads, list) else []:
        for f in t.get("frames", []) if isinstance(t, dict) else []:
            if not isinstance(f, dict) or "locals" not in f:
                continue
            kept = [v for v in f["locals"] or [] if _kept(f, v)]
            if kept:
                f["locals"] = kept
            else:
                del f["locals"]
    return data


def pyspy_many(pids: dict[int, int], *, timeout: float, native: bool = False,
               with_locals: bool = False) -> dict[int, StackResult]:
    """rank -> stacks: one py-spy per rank, all at once, each bounded by ``timeout``
    (``Settings.pyspy_timeout_s``).

    Outputs go to temporary files (no pipe can fill up), and every py-spy still running when
    we leave (deadline, Ctrl-C, an error) is killed: none outlives this call. A rank whose
    process is stopped (SIGSTOP: py-spy cannot suspend what is already stopped) is read again
    without suspending it: stopped, its memory holds still, and the stack is exact."""
    exe = find_pyspy()
    if exe is None:
        return {r: StackResult(p, None, "py-spy is not installed (pip install py-spy)", 0.0)
                for r, p in pids.items()}

    def argv(pid: int, nonblocking: bool = False) -> list[str]:
        a = [exe, "dump", "--json", "--pid", str(pid)] + (["--native"] if native else [])
        if with_locals:  # the peer of a send/recv is an argument: who waits for whom
            a.append("--locals")
        return a + (["--nonblocking"] if nonblocking else [])

    t0 = time.monotonic()
    out = _run_all({r: argv(p) for r, p in pids.items()}, pids, timeout)
    stopped = {r: p for r, p in pids.items() if out[r].data is None and is_stopped(p)}
    if stopped:
        left = max(1.0, timeout - (time.monotonic() - t0))
        out.update(_run_all({r: argv(p, nonblocking=True) for r, p in stopped.items()},
                            stopped, left))
    return out


def _run_all(argvs: dict[int, list[str]], pids: dict[int, int],
             timeout: float) -> dict[int, StackResult]:
    t0 = time.monotonic()
    running: dict[int, tuple[subprocess.Popen[bytes], Any, Any]] = {}
    out: dict[int, StackResult] = {}
    try:
        for rank, argv in argvs.items():
            fo, fe = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # noqa: SIM115
            with starting_child():
                try:
                    proc = subprocess.Popen(argv, stdout=fo, stderr=fe,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
                except OSError as exc:
                    fo.close()
                    fe.close()
                    out[rank] = StackResult(pids[rank], None,
                                            f"py-spy could not run: {exc.strerror}", 0.0)
                    continue
                running[rank] = (proc, fo, fe)
        deadline = t0 + timeout
        while running and time.monotonic() < deadline:
            for rank in [r for r, (p, _, _) in running.items() if p.poll() is not None]:
                proc, fo, fe = running.pop(rank)
                fo.seek(0)
                fe.seek(0)
                out[rank] = _parse_result(pids[rank], proc.returncode, fo.read(), fe.read(),
                                          time.monotonic() - t0, timeout)
                fo.close()
                fe.close()
            if running:
                time.sleep(0.01)
    finally:
        for rank, (proc, fo, fe) in running.items():
            with contextlib.suppress(OSError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=2.0)
            fo.close()
            fe.close()
            out.setdefault(rank, _parse_result(pids[rank], None, b"", b"", timeout, timeout))
    return out


def save_stacks(results: dict[int, StackResult], layout: RunLayout) -> None:
    """Each rank's py-spy JSON (or why there is none) under the run directory's stacks/."""
    layout.stacks_dir.mkdir(exist_ok=True, mode=0o700)
    for rank, res in results.items():
        files = layout.rank(rank)
        if res.data is not None:
            write_atomic(files.pyspy, json.dumps(res.data).encode())
        else:
            write_atomic(files.pyspy_error, (res.error or "").encode())


HELPERS_PER_RANK = 4  # the first few children: DataLoader workers come first


def helper_stacks(pids: dict[int, int], outside: set[int], *,
                  timeout: float) -> dict[int, list[dict[str, Any]]]:
    """rank -> py-spy of each of its own child processes (at most HELPERS_PER_RANK), for the
    ranks ``outside`` every collective: a rank waiting on its own worker is named with where
    the worker is. Bounded as :func:`pyspy_many` (one py-spy per process, all at once)."""
    kids: dict[int, tuple[int, int, str]] = {}  # key -> (rank, pid, name)
    for r in sorted(outside):
        for c in descendants(pids[r])[:HELPERS_PER_RANK]:
            try:
                kids[len(kids)] = (r, c.pid, c.name())
            except Exception:
                continue
    if not kids:
        return {}
    got = pyspy_many({k: pid for k, (_, pid, _) in kids.items()}, timeout=timeout)
    out: dict[int, list[dict[str, Any]]] = {}
    for k, (r, pid, name) in kids.items():
        res = got.get(k)
        if res is not None and res.data is not None:
            out.setdefault(r, []).append({"pid": pid, "name": name, "stack": res.data})
    return out


def save_helpers(found: dict[int, list[dict[str, Any]]], layout: RunLayout) -> None:
    layout.stacks_dir.mkdir(exist_ok=True, mode=0o700)
    for rank, helpers in found.items():
        write_atomic(layout.rank(rank).helpers, json.dumps(helpers).encode())
