"""Start a job under real torchrun, in its own session, with everything it starts tracked."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from moe_hang.errors import MoeHangError
from moe_hang.probe.env import FR_BUFFER
from moe_hang.runtime.procs import Tracker, end_tree


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def pick_port(requested: int | None) -> int:
    """The user's port if it is free (else a clear error), or one the kernel says is free."""
    if requested is not None:
        if not port_is_free(requested):
            raise MoeHangError(f"port {requested} is busy: another process is listening on it "
                               "(pass another --port, or omit it to pick a free one)")
        return requested
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def project_root() -> Path:
    return Path(__file__).resolve().parent.parent


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # the workers import moe_hang even when it runs from a source checkout
    root = str(project_root())
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")  # also silences torchrun's banner
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TORCH_FR_BUFFER_SIZE", FR_BUFFER)  # the probe's ring, as under watch
    env.update(extra or {})
    return env


def torchrun_argv(nproc: int, port: int, module_args: list[str],
                  log_dir: Path | None = None) -> list[str]:
    """torchrun's argv. ``log_dir`` keeps its per-run directory out of /tmp (torchrun makes
    one with mkdtemp and never removes it)."""
    logs = ["--log_dir", str(log_dir)] if log_dir is not None else []
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--nnodes", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
            "--max_restarts", "0", *logs, *module_args]


@dataclass
class LaunchedJob:
    """A running command (typically torchrun) and every process it has started."""

    popen: subprocess.Popen[bytes]
    log_path: Path
    tracker: Tracker = field(default_factory=Tracker)
    _log: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait_exit(self, timeout: float) -> int | None:
        """Its exit code once it has exited by itself within ``timeout`` s; None if it is
        still up then (nothing is sent to it)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=max(0.0, timeout))
        return self.popen.poll()

    def refresh(self) -> None:
        self.tracker.add_tree(self.popen.pid)

    def send(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.send_signal(sig)

    def terminate(self, grace: float = 3.0, first_signal: int = signal.SIGTERM,
                  group: bool = False) -> list[int]:
        """End the job and every process it started, whatever launched its ranks
        (:func:`~moe_hang.runtime.procs.end_tree`); returns pids that survived SIGKILL.

        ``group`` sends the first signal to the job's whole process group, as a terminal's
        Ctrl-C would (torchrun's agent handles it and stops its workers; mp.spawn's ranks are
        in that group themselves)."""
        self.refresh()
        try:
            return end_tree(self.popen, self.tracker, grace=grace, first_signal=first_signal,
                            group=group)
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None


def start(argv: list[str], log_path: Path, env: dict[str, str], cwd: Path | None = None,
          stream: bool = False) -> LaunchedJob:
    """Start ``argv`` in a new session; stdout+stderr go to ``log_path`` (or a pipe if
    ``stream``). No shell is involved anywhere."""
    log = None if stream else open(log_path, "ab")  # noqa: SIM115 - closed by Job.terminate
    try:
        popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if log is None else log, stderr=subprocess.STDOUT,
            env=env, cwd=cwd, start_new_session=True)
    except FileNotFoundError:
        if log is not None:
            log.close()
        raise MoeHangError(f"command not found: {argv[0]}") from None
    except PermissionError:
        if log is not None:
            log.close()
        raise MoeHangError(f"cannot execute {argv[0]}: permission denied") from None
    job = LaunchedJob(popen, log_path, _log=log)
    job.refresh()
    return job

