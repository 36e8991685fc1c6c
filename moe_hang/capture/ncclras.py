"""NCCL's own RAS client binary, ``ncclras``, run bounded: in its own process group, output to
temporary files, the whole group killed at the deadline (it retries a connection that timed
out forever), on an error and on Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from moe_hang.runtime.procs import starting_child

ENV_NCCLRAS = "MOE_HANG_NCCLRAS"  # a specific ncclras binary (else PATH)


def find_ncclras() -> str | None:
    chosen = os.environ.get(ENV_NCCLRAS)
    if chosen:
        return chosen if os.access(chosen, os.X_OK) else None
    return shutil.which("ncclras")


class NcclrasError(Exception):
    """Why ncclras gave no report, in one line."""


@dataclass
class BinaryAnswer:
    text: str
    fmt: str
    asked_at: float
    notes: list[str] = field(default_factory=list)


def _exited(pid: int) -> bool:
    """Has it exited? Without reaping it: a zombie keeps its pid, and so its process group's
    id, from being reused until we have killed what it left in the group."""
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    return info is not None


def _run(argv: list[str], deadline: float) -> tuple[int | None, str, str]:
    """(exit code or None when killed at the deadline, stdout, stderr)."""
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        proc: subprocess.Popen[bytes] | None = None
        done = False
        try:
            with starting_child():
                proc = subprocess.Popen(argv, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
            while not (done := _exited(proc.pid)) and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            if proc is not None:
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)  # it (unless done) and its children
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=2.0)
        fo.seek(0)
        fe.seek(0)
        code = proc.returncode if done and proc is not None else None
        return code, fo.read().decode(errors="replace"), fe.read().decode(errors="replace")


def _why(stderr: str, code: int) -> str:
    low = stderr.lower()
    if "failed to connect to the nccl ras service" in low:
        first = next((ln for ln in stderr.splitlines() if ln.startswith("Connecting to")), "")
        return ("ncclras found nothing listening (no NCCL process with RAS there)"
                + (f": {first}" if first else ""))
    last = next((ln for ln in reversed(stderr.splitlines()) if ln.strip()), "")
    return f"ncclras failed (exit {code}): {last[:200]}" if last else f"ncclras exited {code}"


def ask_binary(exe: str, host: str, port: int, *, fmt: str, ras_timeout_s: int,
               deadline: float) -> BinaryAnswer:
    """One ``ncclras -f FMT -t S -h HOST -p PORT``; raises :class:`NcclrasError`."""
    base = [exe, "-t", str(ras_timeout_s), "-h", host, "-p", str(port)]
    notes: list[str] = []
    asked = time.monotonic()
    try:
        code, out, err = _run([exe, "-f", fmt, *base[1:]], deadline)
        if code not in (0, None) and ("invalid option" in err or "unrecognized option" in err):
            # ncclras older than 2.28.7 has no -f: its text report, then
            notes.append("ncclras has no -f (NCCL older than 2.28.7): read its text report")
            fmt = "text"
            asked = time.monotonic()
            code, out, err = _run(base, deadline)
    except OSError as exc:
        raise NcclrasError(f"ncclras could not run: {exc.strerror or exc}") from None
    if code is None:
        raise NcclrasError(f"ncclras did not finish within its deadline (killed; it retries a "
                           f"connection to {host}:{port} that times out, forever)")
    if code != 0:
        raise NcclrasError(_why(err, code))
    if not out.strip():
        raise NcclrasError("ncclras printed no report")
    return BinaryAnswer(out, fmt, asked, notes)
